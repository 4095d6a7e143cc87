"""Two real ``tributary`` processes federating on loopback, driven by matrix-nio through the client API.

Alice on A creates a room and invites Bob on B (A asks B to co-sign the invite);
Bob joins through his own server's client API (B joins over make_join/send_join
via the inviter's server); both send messages, and each one's /sync shows every
message of both, in order. Then Bob back-paginates to the room's start, which B
backfills from A.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nio
import pytest
from nio import responses

from tests.harness import TributaryProcess
from tests.integration.test_client_nio import run

pytestmark = pytest.mark.e2e

FILTER = {"room": {"timeline": {"limit": 100}}}


@pytest.fixture
def servers(tmp_path: Path, database_dsn: str, second_database_dsn: str) -> Iterator[tuple[TributaryProcess, ...]]:
    started: list[TributaryProcess] = []
    try:
        for label, dsn in (("a", database_dsn), ("b", second_database_dsn)):
            (tmp_path / label).mkdir()
            process = TributaryProcess.configure_federating(tmp_path / label, database_url=dsn)
            process.start()
            started.append(process)
        yield tuple(started)
    finally:
        for process in reversed(started):
            code = process.stop()
            assert code == 0, process.output
            assert "Traceback" not in process.output, process.output


async def _bodies_until(client: nio.AsyncClient, room_id: str, wanted: list[str], seen: list[str]) -> None:
    """Incremental syncs (long-polling) until ``seen`` holds every body of ``wanted``; at most ~20 s."""
    for _ in range(40):
        if set(wanted) <= set(seen):
            return
        response = await run(client.sync(timeout=500, sync_filter=FILTER))
        assert isinstance(response, responses.SyncResponse), response
        room = response.rooms.join.get(room_id)
        if room is not None:
            seen += [e.body for e in room.timeline.events if isinstance(e, nio.RoomMessageText)]
    raise AssertionError(f"{client.user} saw {seen}, wanted {wanted}")


@pytest.mark.timeout(120)
async def test_users_on_two_processes_chat_over_federation(servers: tuple[TributaryProcess, ...]) -> None:
    a, b = servers
    alice = nio.AsyncClient(a.base_url, "alice")
    bob = nio.AsyncClient(b.base_url, "bob")
    try:
        assert isinstance(await run(alice.register("alice", "pw-alice")), responses.RegisterResponse)
        assert isinstance(await run(bob.register("bob", "pw-bob")), responses.RegisterResponse)
        bob_id = f"@bob:{b.server_name}"
        assert bob.user_id == bob_id

        created = await run(alice.room_create(name="Across"))
        assert isinstance(created, responses.RoomCreateResponse), created
        room_id = created.room_id
        early = "before Bob"
        sent = await run(alice.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": early}))
        assert isinstance(sent, responses.RoomSendResponse), sent
        invited = await run(alice.room_invite(room_id, bob_id))
        assert isinstance(invited, responses.RoomInviteResponse), invited

        joined = await run(bob.join(room_id))
        assert isinstance(joined, responses.JoinResponse), joined
        assert joined.room_id == room_id
        await run(alice.sync(timeout=0, sync_filter=FILTER))
        await run(bob.sync(timeout=0, sync_filter=FILTER))

        wanted: list[str] = []
        for i in range(6):
            sender = alice if i % 2 == 0 else bob
            body = f"message {i} from {sender.user_id}"
            response = await run(sender.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": body}))
            assert isinstance(response, responses.RoomSendResponse), response
            wanted.append(body)

        alice_seen: list[str] = []
        bob_seen: list[str] = []
        await _bodies_until(alice, room_id, wanted, alice_seen)
        await _bodies_until(bob, room_id, wanted, bob_seen)
        # Each side's own messages are in send order, and so are the other side's.
        for seen in (alice_seen, bob_seen):
            for who in (alice.user_id, bob_id):
                mine = [m for m in wanted if m.endswith(who)]
                assert [m for m in seen if m.endswith(who)] == mine

        # Bob back-paginates to the room's start: B backfills what was said before he came.
        history = await run(bob.room_messages(room_id, start="", limit=50))
        assert isinstance(history, responses.RoomMessagesResponse), history
        bodies = [e.body for e in history.chunk if isinstance(e, nio.RoomMessageText)]
        token = history.end
        for _ in range(10):
            if early in bodies or not token:
                break
            page = await run(bob.room_messages(room_id, start=token, limit=50))
            assert isinstance(page, responses.RoomMessagesResponse), page
            bodies += [e.body for e in page.chunk if isinstance(e, nio.RoomMessageText)]
            token = page.end
        assert early in bodies
    finally:
        await run(alice.close())
        await run(bob.close())
