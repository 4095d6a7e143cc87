"""A big room, quickly: signed member joins appended to a room in a server's database in bulk.

Used by tests/integration/test_federation_big_join.py and bench/big_room_join.py, where
joining N users through the client API would take minutes. The events are what the
server itself would have made (signed with its key, auth events chosen by the builder,
a linear run of prev_events) and go in through ``storage.stores.room_state`` with real
state groups (a chain of one-entry deltas ending on a snapshot), memberships, current
state and the new forward extremity. The server must not be writing to the room
meanwhile; its caches of the room's extremities are read from the database by joins.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import attrs
import psycopg2
from signedjson.types import SigningKey

from homeserver.events import EventTemplate, build_pdu, get_room_version, select_auth_event_ids, sign_pdu
from homeserver.events import constants as C
from homeserver.events.canonical import thaw
from homeserver.config import load_config
from homeserver.keys import load_or_create_signing_key
from storage.database import Transaction
from storage.stores.events import StateKey, get_current_state_ids_txn, get_forward_extremities_txn, get_state_groups_txn
from storage.stores.room_state import (
    BulkEventRow,
    insert_events_bulk_txn,
    insert_memberships_txn,
    replace_current_state_txn,
    set_event_state_groups_txn,
    store_state_chain_txn,
    store_state_snapshot_txn,
)


@attrs.frozen
class AddedMembers:
    """What ``add_members`` appended: every event ID in order, and the odd ones out."""

    event_ids: list[str]
    # A ban by an ordinary member: fails the auth rules (the resident stored it anyway, as
    # a resident that does not check would).
    forbidden: str | None
    # A member join whose signature was altered after signing: fails verification.
    bad_signature: str | None


def add_members_to_process(config_path: Path, dsn: str, room_id: str, count: int, *,
                           odd_ones_out: bool = False) -> AddedMembers:
    """``add_members`` for the server whose config is ``config_path`` (its name and signing
    key are read from it); the server must be stopped or not writing to the room."""
    config = load_config(config_path)
    key = load_or_create_signing_key(config.effective_signing_key_path)
    return add_members(dsn, room_id, config.server_name, key, count, origin_server_ts=int(time.time() * 1000),
                       odd_ones_out=odd_ones_out)


def _row(event_json: dict[str, Any], event_id: str, room_id: str, membership: str) -> BulkEventRow:
    return BulkEventRow(
        event_id, room_id, C.MEMBER, event_json["state_key"], event_json["sender"], event_json["depth"],
        event_json["origin_server_ts"], json.dumps(event_json, ensure_ascii=False, separators=(",", ":")),
        tuple(event_json["prev_events"]), tuple(event_json["auth_events"]), membership=membership,
    )


def add_members(dsn: str, room_id: str, server_name: str, signing_key: SigningKey, count: int, *,
                origin_server_ts: int, odd_ones_out: bool = False) -> AddedMembers:
    """Append ``count`` joins (``@mN:server_name``, display name "Member N") to the room; with
    ``odd_ones_out``, one forbidden ban and one join with a broken signature follow them."""
    conn = psycopg2.connect(dsn)
    try:
        txn = Transaction("add_members", conn.cursor())
        txn.execute("SELECT room_version FROM rooms WHERE room_id = %s", (room_id,))
        version = get_room_version(str(txn.fetchall()[0][0]))
        txn.execute("SELECT instance_name FROM events WHERE room_id = %s LIMIT 1", (room_id,))
        instance = str(txn.fetchall()[0][0])
        extremities = get_forward_extremities_txn(txn, room_id)
        if len(extremities) != 1:
            raise ValueError(f"room {room_id} has {len(extremities)} forward extremities; add_members needs one")
        [(prev, depth)] = extremities.items()
        group = get_state_groups_txn(txn, [prev])[prev]
        state: dict[StateKey, str] = get_current_state_ids_txn(txn, room_id)
        txn.execute("SELECT event_id, membership FROM current_state_events WHERE room_id = %s", (room_id,))
        memberships: dict[str, str | None] = {row[0]: row[1] for row in txn.fetchall()}

        rows: list[BulkEventRow] = []

        def append(sender: str, target: str, membership: str, content: dict[str, Any], *,
                   tamper: bool = False, changes_state: bool = True) -> str:
            nonlocal prev, depth
            template = EventTemplate(C.MEMBER, {"membership": membership, **content}, target)
            pdu = build_pdu(version, template, sender=sender, room_id=room_id, prev_event_ids=[prev],
                            auth_event_ids=select_auth_event_ids(version, template, sender, state),
                            depth=depth + 1, origin_server_ts=origin_server_ts + len(rows))
            event = sign_pdu(version, pdu, server_name, signing_key)
            event_json = thaw(event.get_pdu_json())
            if tamper:
                sigs = event_json["signatures"][server_name]
                key_id = next(iter(sigs))
                sigs[key_id] = ("A" if sigs[key_id][0] != "A" else "B") + sigs[key_id][1:]
            rows.append(_row(event_json, event.event_id, room_id, membership))
            if changes_state:
                state[(C.MEMBER, target)] = event.event_id
                memberships[event.event_id] = membership
            prev, depth = event.event_id, event.depth
            return event.event_id

        for i in range(count):
            user = f"@m{i}:{server_name}"
            append(user, user, C.JOIN, {"displayname": f"Member {i}"})
        forbidden = bad_signature = None
        if odd_ones_out and count:
            forbidden = append(f"@m0:{server_name}", f"@m1:{server_name}", C.BAN, {})
            bad_signature = append(f"@late:{server_name}", f"@late:{server_name}", C.JOIN, {}, tamper=True)

        txn.execute("SELECT nextval('events_stream_seq') FROM generate_series(1, %s)", (len(rows),))
        orderings = [int(r[0]) for r in txn.fetchall()]
        insert_events_bulk_txn(txn, rows, orderings, instance_name=instance, is_local=True, outlier=False)
        chain = store_state_chain_txn(txn, room_id, group, [((C.MEMBER, r.state_key or ""), r.event_id)
                                                            for r in rows[:-1]])
        last = store_state_snapshot_txn(txn, room_id, state)
        afters = [*chain, last]
        befores = [group, *chain]
        set_event_state_groups_txn(txn, [(r.event_id, befores[i], afters[i]) for i, r in enumerate(rows)])
        insert_memberships_txn(txn, list(zip(rows, orderings)))
        replace_current_state_txn(txn, room_id, state, memberships)
        txn.execute("DELETE FROM event_forward_extremities WHERE room_id = %s", (room_id,))
        txn.execute("INSERT INTO event_forward_extremities (room_id, event_id) VALUES (%s, %s)", (room_id, prev))
        conn.commit()
        for table in ("events", "event_auth", "event_edges", "state_groups_state", "current_state_events"):
            txn.execute(f"ANALYZE {table}")
        conn.commit()
        return AddedMembers([r.event_id for r in rows], forbidden, bad_signature)
    finally:
        conn.close()
