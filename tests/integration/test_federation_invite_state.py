"""What an invite to another server carries as ``invite_room_state`` (found by ``make interop``).

Since Matrix 1.16 (MSC4311) the ``PUT /_matrix/federation/v2/invite`` body's
``invite_room_state`` holds full PDUs, the ``m.room.create`` event among them, so
the invitee's server can check their format and signatures. Synapse 1.163 logs
"failed to validate `invite_room_state`" for stripped events in room version 12
and means to reject them with ``400 M_INVALID_PARAM``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from homeserver.events import parse_create_room_request
from homeserver.federation.pdus import parse_and_verify
from tests.integration.test_federation import name, two_servers


@pytest.mark.timeout(90)
async def test_invite_room_state_is_signed_pdus_with_the_create_event(
        database_dsn: str, second_database_dsn: str, tmp_path: Path) -> None:
    """Alice on A names a room and invites Bob on B. The invite request A sends holds the
    room's create, join rules and name events as full PDUs that B can verify against A's
    key, each the event A has in its current state."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        assert a.process.room_events is not None and a.process.federation is not None and a.process.events_store is not None
        assert b.process.federation is not None
        alice, bob = f"@alice:{name(a)}", f"@bob:{name(b)}"
        room_id = await a.process.room_events.create_room(
            alice, parse_create_room_request({"preset": "private_chat", "name": "Invited"}))

        bodies: list[Any] = []
        client = a.process.federation.client
        put_json = client.put_json

        async def recording_put_json(destination: str, path: str, content: Any, *,
                                     timeout: float | None = None) -> Any:
            if "/invite/" in path:
                bodies.append(content)
            return await put_json(destination, path, content, timeout=timeout)

        client.put_json = recording_put_json  # type: ignore[method-assign]
        try:
            await a.process.federation.membership.invite_remote(room_id, alice, bob)
        finally:
            client.put_json = put_json  # type: ignore[method-assign]

        [body] = bodies
        version = await a.process.room_events.room_version(room_id)
        current = await a.process.events_store.get_current_state_ids(room_id)
        received = [await parse_and_verify(b.process.federation.keyring, version, pdu) for pdu in body["invite_room_state"]]
        by_key = {(e.type, e.state_key or ""): e.event_id for e in received}
        assert set(by_key) == {("m.room.create", ""), ("m.room.join_rules", ""), ("m.room.name", "")}
        assert by_key == {key: current[key] for key in by_key}
        pdu_fields = {"hashes", "signatures", "auth_events", "prev_events"}
        assert all(pdu_fields <= set(pdu) for pdu in body["invite_room_state"])
