"""Joining a room with thousands of members' state from a second Tributary, and the resident's
partial-state answer (``omit_members``).

Both servers run in this process (``two_servers`` of test_federation.py) and talk over
TLS on loopback. A's room gets its members through ``tests.big_room.add_members`` (signed
joins written in bulk), among them one event that fails the auth rules and one whose
signature was altered after signing: B must reject the first and drop the second.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from homeserver.app import HomeServer
from homeserver.events import EventTemplate, get_room_version, make_event, parse_create_room_request, sign_pdu
from homeserver.remote.client import HttpResponseError
from tests.big_room import add_members, add_members_to_process
from tests.conftest import scratch_database
from tests.harness import TributaryProcess, configure_workers
from tests.integration.test_federation import FED, eventually, name, stored, two_servers

MEMBERS = 3000


def q(value: str) -> str:
    return quote(value, safe="")


async def _member_rows(hs: HomeServer, room_id: str) -> dict[str, str | None]:
    """User ID -> membership in ``hs``'s current state of the room."""
    assert hs.process.events_store is not None
    state = await hs.process.events_store.get_current_state_ids(room_id)
    rows = await hs.process.events_store.get_events([i for k, i in state.items() if k[0] == "m.room.member"])
    return {row.pdu()["state_key"]: row.pdu()["content"].get("membership") for row in rows.values()}


async def _signed_join(b: HomeServer, a_name: str, room_id: str, user_id: str) -> dict[str, Any]:
    """``user_id``'s join, made by A (make_join) and signed by B, not sent yet."""
    assert b.process.federation is not None and b.process.signing_key is not None
    made = await b.process.federation.client.get_json(
        a_name, f"/_matrix/federation/v1/make_join/{q(room_id)}/{q(user_id)}", query={"ver": ["12"]})
    pdu = made["event"]
    pdu["origin_server_ts"] = int(time.time() * 1000)
    for field in ("hashes", "signatures", "event_id"):
        pdu.pop(field, None)
    join = sign_pdu(get_room_version(made["room_version"]), pdu, name(b), b.process.signing_key)
    return dict(join.get_pdu_json()) | {"event_id": join.event_id}


@pytest.mark.timeout(180)
async def test_join_of_a_room_with_thousands_of_members(database_dsn: str, second_database_dsn: str,
                                                        tmp_path: Path) -> None:
    """Bob on B joins Alice's room on A, which holds 3,000 members' state: B ends up with the
    whole member list as current state, the forbidden ban stored but rejected (and so no
    state of m1, whom it banned), the event with a broken signature not stored at all, and the room usable (a
    message from A arrives). Then a server asking A with ``omit_members`` gets the state
    without member events but the heroes', an auth chain without what the state holds, and
    the servers in the room."""
    # The whole state in the send_join answer (partial-state joins: test_federation_partial_join.py).
    full_joins = {"federation": {**FED, "partial_state_joins": False}}
    async with two_servers(database_dsn, second_database_dsn, tmp_path, extra=full_joins) as (a, b):
        assert a.process.room_events is not None and a.process.signing_key is not None
        assert b.process.federation is not None and b.process.events_store is not None
        alice, bob = f"@alice:{name(a)}", f"@bob:{name(b)}"
        room_id = await a.process.room_events.create_room(alice, parse_create_room_request({"preset": "public_chat"}))
        added = add_members(database_dsn, room_id, name(a), a.process.signing_key, MEMBERS,
                            origin_server_ts=int(time.time() * 1000), odd_ones_out=True)
        assert added.forbidden is not None and added.bad_signature is not None

        started = time.monotonic()
        join = await b.process.federation.membership.join_remote(room_id, bob, [name(a)])
        took = time.monotonic() - started

        members = await _member_rows(b, room_id)
        # m1: A's state holds only a ban of m1 that fails the auth rules; rejected, it is no state.
        assert len(members) == MEMBERS + 1 and members[bob] == "join" and members[alice] == "join"
        assert f"@m1:{name(a)}" not in members and members[f"@m2:{name(a)}"] == "join"
        assert f"@late:{name(a)}" not in members
        forbidden = await stored(b, added.forbidden)
        assert forbidden is not None and forbidden.outlier and forbidden.rejection_reason
        assert await stored(b, added.bad_signature) is None
        assert await b.process.events_store.get_joined_servers(room_id) == {name(a), name(b)}
        row = await stored(b, join.event_id)
        assert row is not None and not row.outlier
        assert took < 60, f"the join of a {MEMBERS}-member room took {took:.1f}s"

        message = await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": "hi"}), alice)
        row = await eventually(lambda: stored(b, message.event_id), timeout=30)
        assert not row.outlier and row.rejection_reason is None

        # Bob leaves and joins again: B holds the state events already (and the room's old
        # extremities); the second join stores only what is new and resolves with the old.
        assert b.process.room_events is not None
        bye = await b.process.room_events.send(room_id, EventTemplate("m.room.member", {"membership": "leave"}, bob),
                                               bob)
        await eventually(lambda: stored(a, bye.event_id), timeout=30)
        again = await b.process.federation.membership.join_remote(room_id, bob, [name(a)])
        members = await _member_rows(b, room_id)
        assert members[bob] == "join" and len(members) == MEMBERS + 1
        assert (await b.process.events_store.get_current_state_ids(room_id))[("m.room.member", bob)] == again.event_id

        # The resident's partial-state answer (MSC3706), to a join asked with omit_members.
        carol = f"@carol:{name(b)}"
        pdu = await _signed_join(b, name(a), room_id, carol)
        event_id = pdu.pop("event_id")
        answer = await b.process.federation.client.request(
            "PUT", name(a), f"/_matrix/federation/v2/send_join/{q(room_id)}/{q(event_id)}",
            query={"omit_members": "true"}, content=pdu)
        assert answer["members_omitted"] is True
        assert answer["servers_in_room"] == sorted({name(a), name(b)})
        state_members = sorted(e["state_key"] for e in answer["state"] if e["type"] == "m.room.member")
        # No name or canonical alias: the heroes are the first five joined (m1 is banned on A).
        assert state_members == sorted([alice, *(f"@m{i}:{name(a)}" for i in (0, 2, 3, 4))])
        assert {e["type"] for e in answer["state"]} >= {"m.room.create", "m.room.power_levels", "m.room.join_rules"}
        version = get_room_version("12")
        state_ids = {make_event(version, e).event_id for e in answer["state"]}
        chain_ids = {make_event(version, e).event_id for e in answer["auth_chain"]}
        assert len(state_ids) < 20 and not state_ids & chain_ids
        # Every auth event of what was sent is in the state or the auth chain.
        cited = {a for e in [*answer["state"], *answer["auth_chain"]] for a in e["auth_events"]}
        assert cited <= state_ids | chain_ids

        # A bad omit_members value is a 400, not a 5xx.
        with pytest.raises(HttpResponseError) as info:
            await b.process.federation.client.request(
                "PUT", name(a), f"/_matrix/federation/v2/send_join/{q(room_id)}/{q(event_id)}",
                query={"omit_members": "yes"}, content=pdu)
        assert info.value.code == 400


def resident_big_room(resident: TributaryProcess, dsn: str, members: int) -> str:
    """Alice's public room on ``resident`` with ``members`` more members, added in bulk while
    it is stopped; its ID. ``resident`` is left stopped."""
    resident.start()
    alice = _client_call(resident.client_port, "POST", "register",
                         {"username": "alice", "password": "pw", "auth": {"type": "m.login.dummy"}})
    room_id: str = _client_call(resident.client_port, "POST", "createRoom", {"preset": "public_chat"},
                                alice["access_token"])["room_id"]
    resident.stop()
    add_members_to_process(resident.config_path, dsn, room_id, members)
    return room_id


@pytest.mark.timeout(240)
def test_join_from_a_worker_layout_stores_through_the_rooms_persister(
    postgres_template: str, redis_url: str, tmp_path: Path
) -> None:
    """B runs as workers (main, an event persister p1, a generic worker g1); A is one process
    whose room has 2,000 members. Bob's /join on g1 checks A's send_join answer there and
    hands it all to p1, the room's events writer (``persist_join``, a body far over the
    default 1 MB limit). The join is partial (``omit_members``): g1 resyncs the state and p1
    stores it (``complete_partial_state``); /joined_members waits for it, then B's current
    state holds every member and Bob's /sync shows the room."""
    with scratch_database(postgres_template) as dsn_a, scratch_database(postgres_template) as dsn_b:
        resident = TributaryProcess.configure_federating(tmp_path / "a", database_url=dsn_a)
        main, workers, generic_port = configure_workers(tmp_path / "b", dsn_b, redis_url, persisters=1, senders=0)
        processes = [resident, main, workers["p1"], workers["g1"]]
        try:
            room_id = resident_big_room(resident, dsn_a, 2000)
            for process in processes:
                process.start()
            bob = _client_call(main.client_port, "POST", "register",
                               {"username": "bob", "password": "pw", "auth": {"type": "m.login.dummy"}})
            token = bob["access_token"]
            _client_call(generic_port, "POST", f"join/{q(room_id)}?server_name={q(resident.server_name)}", {}, token)
            members = _client_call(generic_port, "GET", f"rooms/{q(room_id)}/joined_members", None, token)
            assert len(members["joined"]) == 2002
            synced = _client_call(generic_port, "GET", "sync?timeout=0", None, token)
            assert room_id in synced["rooms"]["join"]
            # Checked where the join was asked (g1), stored by the room's writer (p1).
            assert "joined via" in workers["g1"].log_path.read_text(encoding="utf-8")
            assert "join state stored" in workers["p1"].log_path.read_text(encoding="utf-8")
            assert "join state stored" not in workers["g1"].log_path.read_text(encoding="utf-8")
            # The partial join's resync: fetched and checked on g1, stored by p1.
            assert "resynced the room's state" in workers["g1"].log_path.read_text(encoding="utf-8")
            assert "full state stored" in workers["p1"].log_path.read_text(encoding="utf-8")
        finally:
            for process in reversed(processes):
                process.kill()


def _client_call(port: int, method: str, path: str, body: Any, token: str | None = None) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/_matrix/client/v3/{path}", method=method,
        data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
