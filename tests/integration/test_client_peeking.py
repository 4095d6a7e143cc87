"""Peeking into ``world_readable`` rooms, and history visibility for guests (issue 20, Guest access).

The spec (client-server API, "Room History Visibility" and "Guest Access"): while a room's
``m.room.history_visibility`` is ``world_readable`` its events "may be shared by any
participant, including those not joined"; a user (or a guest) who is not in the room may
read them with ``/messages``, ``/rooms/{roomId}/initialSync`` and ``/events?room_id=``
(peeking), and nothing of a room with any other visibility. A guest, like a user, sees
history by the same rules once it joins a ``can_join`` room. The scenarios are those of
SyTest ``30rooms/30history-visibility.pl`` and ``30rooms/13guestaccess.pl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.integration.test_client_rooms import ALICE, ROOM_LIMITS, _ok
from tests.integration.test_client_support import Client, running_server


async def _guest(client: Client) -> str:
    response = await client.request("POST", "register?kind=guest", {})
    assert response.status == 200, response
    token: str = response.body["access_token"]
    return token


async def _send(client: Client, token: str, room_id: str, body: str) -> str:
    event_id: str = (await _ok(client, "POST", f"rooms/{room_id}/send/m.room.message", {"body": body},
                               token=token))["event_id"]
    return event_id


async def _visibility(client: Client, token: str, room_id: str, visibility: str) -> str:
    event_id: str = (await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.history_visibility",
                               {"history_visibility": visibility}, token=token))["event_id"]
    return event_id


async def _events(client: Client, token: str, room_id: str, since: str, timeout: int) -> dict[str, Any]:
    body: dict[str, Any] = await _ok(
        client, "GET", f"events?room_id={quote(room_id)}&from={quote(since)}&timeout={timeout}", token=token)
    return body


async def test_non_members_peek_into_world_readable_rooms_only(database_dsn: str, tmp_path: Path) -> None:
    """A user and a guest who never joined read a ``world_readable`` room: ``/messages`` and
    ``/rooms/{roomId}/initialSync`` give the events sent while it was world_readable (SyTest:
    "non-joined users can room initialSync for world_readable rooms": the visibility change and
    the message after it, not the one before); ``/events?room_id=`` from the initialSync's
    ``end`` follows the room's messages, typing, receipts and its members' presence (SyTest "Guest
    non-joined user can call /events on world_readable room", "Guest user calling /events
    doesn't tightloop"). A ``shared`` room refuses all three with 403; a guest's ``/events``
    needs ``room_id``."""
    async with running_server(database_dsn, tmp_path, allow_guest_access=True, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        carol = (await client.register_ok("carol"))["access_token"]
        guest = await _guest(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        private = await _send(client, alice, room_id, "private")
        world = await _visibility(client, alice, room_id, "world_readable")
        public = await _send(client, alice, room_id, "public")

        for token in (carol, guest):
            messages = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=20", token=token)
            seen = [e["event_id"] for e in messages["chunk"]]
            assert seen[-2:] == [public, world] and private not in seen  # then only what came later
            initial = await _ok(client, "GET", f"rooms/{room_id}/initialSync", token=token)
            assert [e["event_id"] for e in initial["messages"]["chunk"]][:2] == [world, public]
            assert "membership" not in initial  # a peeker has none
            assert ALICE in {e["state_key"] for e in initial["state"] if e["type"] == "m.room.member"}
            context = await _ok(client, "GET", f"rooms/{room_id}/context/{public}", token=token)
            assert context["event"]["event_id"] == public
            hidden = await client.request("GET", f"rooms/{room_id}/event/{private}", token=token)
            assert hidden.status == 404, hidden

            # Following the room from the initialSync's end: nothing new yet, then each kind of event.
            since = initial["messages"]["end"]
            quiet = await _events(client, token, room_id, since, 0)
            assert quiet["chunk"] == [] and quiet["start"] == since
            since = quiet["end"]
            mice = await _send(client, alice, room_id, "mice")
            got = await _events(client, token, room_id, since, 10000)
            assert [(e["event_id"], e["room_id"]) for e in got["chunk"]] == [(mice, room_id)]
            await _ok(client, "PUT", f"rooms/{room_id}/typing/{ALICE}", {"typing": True, "timeout": 30000}, token=alice)
            got = await _events(client, token, room_id, got["end"], 10000)
            assert [(e["type"], e["room_id"], e["content"]) for e in got["chunk"]] == [
                ("m.typing", room_id, {"user_ids": [ALICE]})]
            await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{mice}", {}, token=alice)
            got = await _events(client, token, room_id, got["end"], 10000)
            assert [e["type"] for e in got["chunk"]] == ["m.receipt"] and ALICE in got["chunk"][0]["content"][mice]["m.read"]
            await _ok(client, "PUT", f"presence/{ALICE}/status", {"presence": "online", "status_msg": f"{token[-4:]}"},
                      token=alice)
            got = await _events(client, token, room_id, got["end"], 10000)
            assert [(e["type"], e["content"]["user_id"]) for e in got["chunk"]] == [("m.presence", ALICE)]
            await _ok(client, "PUT", f"rooms/{room_id}/typing/{ALICE}", {"typing": False}, token=alice)

        guest_global = await client.request("GET", "events?timeout=0", token=guest)
        assert guest_global.status == 400 and guest_global.errcode == "M_MISSING_PARAM", guest_global

        shared = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _send(client, alice, shared, "members only")
        now = (await _ok(client, "GET", "events?timeout=0", token=carol))["end"]
        for token in (carol, guest):
            for path in (f"rooms/{shared}/messages?dir=b", f"rooms/{shared}/initialSync",
                         f"events?room_id={quote(shared)}&from={quote(now)}&timeout=0"):
                refused = await client.request("GET", path, token=token)
                assert refused.status == 403 and refused.errcode == "M_FORBIDDEN", (path, refused)


async def test_guests_see_history_by_the_room_history_visibility(database_dsn: str, tmp_path: Path) -> None:
    """SyTest "m.room.history_visibility == X allows/forbids appropriately for Guest users":
    before joining, a guest sees a room's messages only when it is ``world_readable``; after
    joining (the room's ``guest_access`` is ``can_join``), the message sent before the join is
    visible under ``world_readable`` and ``shared``, not under ``joined``; what is sent after the
    join always is, in ``/messages`` and in ``/sync``."""
    async with running_server(database_dsn, tmp_path, allow_guest_access=True, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        for visibility, before_join_visible in (("world_readable", True), ("shared", True), ("joined", False)):
            guest = await _guest(client)
            room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
            await _visibility(client, alice, room_id, visibility)
            await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.guest_access", {"guest_access": "can_join"},
                      token=alice)
            before = await _send(client, alice, room_id, "before")
            outside = await client.request("GET", f"rooms/{room_id}/messages?dir=b&limit=10", token=guest)
            if visibility == "world_readable":
                assert outside.status == 200 and before in [e["event_id"] for e in outside.body["chunk"]]
            else:
                assert outside.status == 403, (visibility, outside)

            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=guest)
            after = await _send(client, alice, room_id, "after")
            inside = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=10", token=guest)
            seen = [e["event_id"] for e in inside["chunk"]]
            assert (before in seen) is before_join_visible, (visibility, seen)
            assert after in seen
            synced = await _ok(client, "GET", "sync", token=guest)
            timeline = [e["event_id"] for e in synced["rooms"]["join"][room_id]["timeline"]["events"]]
            assert (before in timeline) is before_join_visible and timeline[-1] == after, (visibility, timeline)
