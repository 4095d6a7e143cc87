"""``GET /rooms/{roomId}/messages`` over HTTP against an in-process server and real PostgreSQL.

The spec's rule for ``end``: it is the token to continue paginating with, and it
is omitted when no further events are available (the start of the timeline going
backwards, the newest event going forwards, or nothing more the user may see).
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_client_rooms import ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import running_server


async def test_end_is_given_exactly_while_there_is_more_to_read(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, _ = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        for i in range(6):
            body = {"msgtype": "m.text", "body": f"m{i}"}
            await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/t{i}", body, token=alice)
        everything = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=1000", token=alice)
        total = len(everything["chunk"])
        assert "end" not in everything and total > 6

        # Backwards in pages of `size`: each page but the last has `end`; the pages cover
        # the room once, and the last page (even a full one) has none.
        for size in (1, 3, total, total - 1):
            seen: list[str] = []
            token = None
            while True:
                query = f"dir=b&limit={size}" + (f"&from={token}" if token else "")
                page = await _ok(client, "GET", f"rooms/{room_id}/messages?{query}", token=alice)
                assert page["chunk"], (size, page)
                seen.extend(e["event_id"] for e in page["chunk"])
                if "end" not in page:
                    break
                assert isinstance(page["end"], str) and page["end"] != page["start"]
                token = page["end"]
            assert seen == [e["event_id"] for e in everything["chunk"]], size

        # Forwards from the start: `end` while newer events remain, none at the newest.
        forward: list[str] = []
        token = "s0"
        while True:
            page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=f&limit=4&from={token}", token=alice)
            forward.extend(e["event_id"] for e in page["chunk"])
            if "end" not in page:
                break
            token = page["end"]
        assert forward == list(reversed(seen))

        # A filter that hides events does not end pagination early: `end` follows what is left to read.
        filt = '{"types":["m.room.message"]}'
        page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=3&filter={filt}", token=alice)
        assert [e["content"]["body"] for e in page["chunk"]] == ["m5", "m4", "m3"] and "end" in page
        page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=3&from={page['end']}&filter={filt}",
                         token=alice)
        assert [e["content"]["body"] for e in page["chunk"]] == ["m2", "m1", "m0"] and "end" in page
        rest = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=100&from={page['end']}&filter={filt}",
                         token=alice)
        assert rest["chunk"] == [] and "end" not in rest
