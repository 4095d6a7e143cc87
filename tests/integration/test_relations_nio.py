"""matrix-nio, unmodified, against an in-process server: Alice starts a thread, Bob loads it through
``/relations`` and ``/threads`` (nio's own paginating iterators) and sees the thread summary
bundled on the root in his ``/sync``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nio
from nio import responses
from nio.api import RelationshipType

from tests.integration.test_client_nio import run
from tests.integration.test_client_rooms import ROOM_LIMITS
from tests.integration.test_client_support import running_server


async def collect(iterator: Any) -> list[Any]:
    async def drain() -> list[Any]:
        return [event async for event in iterator]

    return await run(drain())


async def test_nio_threads_relations_and_sync_summary(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = nio.AsyncClient(client.base_url, "alice")
        bob = nio.AsyncClient(client.base_url, "bob")
        try:
            assert isinstance(await run(alice.register("alice", "pw")), responses.RegisterResponse)
            assert isinstance(await run(bob.register("bob", "pw")), responses.RegisterResponse)
            created = await run(alice.room_create(preset=nio.RoomPreset.public_chat))
            assert isinstance(created, responses.RoomCreateResponse), created
            room = created.room_id
            assert isinstance(await run(bob.join(room)), responses.JoinResponse)
            root = await run(alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "thread root"}))
            assert isinstance(root, responses.RoomSendResponse), root
            replies = []
            for i in range(3):
                sent = await run(alice.room_send(room, "m.room.message", {
                    "msgtype": "m.text", "body": f"reply {i}",
                    "m.relates_to": {"rel_type": "m.thread", "event_id": root.event_id}}))
                assert isinstance(sent, responses.RoomSendResponse), sent
                replies.append(sent.event_id)

            # nio pages through /relations (limit 2: two requests) and /threads.
            related = await collect(bob.room_get_event_relations(room, root.event_id, RelationshipType.thread,
                                                                 limit=2))
            assert [e.event_id for e in related] == list(reversed(replies))
            threads = await collect(bob.room_get_threads(room))
            assert [e.event_id for e in threads] == [root.event_id]
            summary = threads[0].source["unsigned"]["m.relations"]["m.thread"]
            assert summary["count"] == 3 and summary["latest_event"]["event_id"] == replies[-1]

            synced = await run(bob.sync(timeout=0, full_state=True))
            assert isinstance(synced, responses.SyncResponse), synced
            timeline = synced.rooms.join[room].timeline.events
            (bundled,) = [e for e in timeline if e.event_id == root.event_id]
            thread = bundled.source["unsigned"]["m.relations"]["m.thread"]
            assert thread["count"] == 3 and thread["current_user_participated"] is False
            assert thread["latest_event"]["content"]["body"] == "reply 2"
        finally:
            await run(alice.close())
            await run(bob.close())
