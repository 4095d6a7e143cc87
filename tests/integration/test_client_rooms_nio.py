"""matrix-nio's AsyncClient chatting through a real ``tributary`` process, unmodified.

Two users register; Alice creates a room and invites Bob, who joins; they
exchange 100 messages; each one's incremental syncs see every message exactly
once, in order; /messages back-paginates to the room's start; typing and
receipts reach the other user's sync; a repeated txnId returns the same event
ID; a redaction shows up redacted; after Bob leaves he stops seeing messages.
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

FILTER = {"room": {"timeline": {"limit": 500}}}


@pytest.fixture
def server(tmp_path: Path, database_dsn: str) -> Iterator[TributaryProcess]:
    # The harness's config already sets cheap bcrypt and generous rate limits.
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn)
    hs.start()
    try:
        yield hs
    finally:
        code = hs.stop()
        assert code == 0, hs.output
        assert "Traceback" not in hs.output, hs.output


async def _sync(client: nio.AsyncClient, room_id: str, timeout: int = 0) -> tuple[list[str], responses.SyncResponse]:
    """One incremental sync: the message bodies of ``room_id``'s timeline, in order."""
    response = await run(client.sync(timeout=timeout, sync_filter=FILTER))
    assert isinstance(response, responses.SyncResponse), response
    room = response.rooms.join.get(room_id)
    if room is None:
        return [], response
    assert not room.timeline.limited
    return [e.body for e in room.timeline.events if isinstance(e, nio.RoomMessageText)], response


async def test_two_users_chat_with_nio(server: TributaryProcess) -> None:
    alice = nio.AsyncClient(server.base_url, "alice")
    bob = nio.AsyncClient(server.base_url, "bob")
    try:
        assert isinstance(await run(alice.register("alice", "pw-alice")), responses.RegisterResponse)
        assert isinstance(await run(bob.register("bob", "pw-bob")), responses.RegisterResponse)
        await run(alice.set_displayname("Alice"))

        created = await run(alice.room_create(name="Chat", invite=["@bob:localhost"]))
        assert isinstance(created, responses.RoomCreateResponse), created
        room_id = created.room_id

        _, first = await _sync(bob, room_id)
        assert room_id in first.rooms.invite
        joined = await run(bob.join(room_id))
        assert isinstance(joined, responses.JoinResponse), joined
        await _sync(alice, room_id)
        await _sync(bob, room_id)

        sent: list[str] = []
        alice_seen: list[str] = []
        bob_seen: list[str] = []
        for i in range(100):
            sender = alice if i % 2 == 0 else bob
            body = f"message {i} from {sender.user}"
            response = await run(sender.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": body}))
            assert isinstance(response, responses.RoomSendResponse), response
            sent.append(body)
            if i % 7 == 0:
                alice_seen += (await _sync(alice, room_id))[0]
                bob_seen += (await _sync(bob, room_id))[0]
        alice_seen += (await _sync(alice, room_id))[0]
        bob_seen += (await _sync(bob, room_id))[0]
        assert alice_seen == sent
        assert bob_seen == sent

        # Same txnId, same event.
        once = await run(alice.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": "t"}, tx_id="fixed"))
        twice = await run(alice.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": "t"}, tx_id="fixed"))
        assert isinstance(once, responses.RoomSendResponse) and isinstance(twice, responses.RoomSendResponse)
        assert once.event_id == twice.event_id

        # Back-paginate to the room's start.
        assert (await _sync(bob, room_id))[0] == ["t"]
        bodies: list[str] = []
        token = bob.next_batch
        saw_create = False
        for _ in range(50):
            page = await run(bob.room_messages(room_id, start=token, limit=30))
            assert isinstance(page, responses.RoomMessagesResponse), page
            bodies += [e.body for e in page.chunk if isinstance(e, nio.RoomMessageText)]
            saw_create = saw_create or any(isinstance(e, nio.RoomCreateEvent) for e in page.chunk)
            if not page.end or not page.chunk:
                break
            token = page.end
        assert saw_create
        assert list(reversed(bodies)) == sent + ["t"]

        # Typing and receipts reach the other user's sync.
        await _sync(bob, room_id)
        typing = await run(alice.room_typing(room_id, True, timeout=10_000))
        assert isinstance(typing, responses.RoomTypingResponse), typing
        receipt = await run(alice.room_read_markers(room_id, once.event_id, once.event_id))
        assert isinstance(receipt, responses.RoomReadMarkersResponse), receipt
        _, synced = await _sync(bob, room_id, timeout=5000)
        ephemeral = synced.rooms.join[room_id].ephemeral
        assert any(isinstance(e, nio.TypingNoticeEvent) and "@alice:localhost" in e.users for e in ephemeral)
        assert any(isinstance(e, nio.ReceiptEvent) for e in ephemeral)

        # A redaction shows up redacted.
        redacted = await run(alice.room_redact(room_id, once.event_id, reason="oops"))
        assert isinstance(redacted, responses.RoomRedactResponse), redacted
        page = await run(bob.room_messages(room_id, start=bob.next_batch, limit=5))
        assert isinstance(page, responses.RoomMessagesResponse)
        target = [e for e in page.chunk if e.event_id == once.event_id]
        assert len(target) == 1 and isinstance(target[0], nio.RedactedEvent), target

        # After leaving, Bob sees no new messages.
        left = await run(bob.room_leave(room_id))
        assert isinstance(left, responses.RoomLeaveResponse), left
        await _sync(bob, room_id)
        await run(alice.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": "secret"}))
        seen, _ = await _sync(bob, room_id)
        assert seen == []
        history = await run(bob.room_messages(room_id, start=bob.next_batch, limit=20))
        assert isinstance(history, responses.RoomMessagesResponse)
        assert "secret" not in [getattr(e, "body", None) for e in history.chunk]
    finally:
        await run(alice.close())
        await run(bob.close())
