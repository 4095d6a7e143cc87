"""Membership changes and state sends over HTTP against an in-process server and real PostgreSQL.

Each test states the client-server spec's rule (or, where the spec leaves it open,
Synapse's behaviour, as docs/client-api.md says): every membership change is
authorised against the room's current state before anything is sent, and
repeating a state change or a join creates no new event.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.test_client_rooms import ALICE, BOB, ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import SERVER_NAME, Client, running_server

CAROL = f"@carol:{SERVER_NAME}"


async def _event_ids(client: Client, room_id: str, token: str) -> list[str]:
    """Every event of the room the user can page back over, newest first."""
    page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=1000", token=token)
    return [e["event_id"] for e in page["chunk"]]


async def _membership(client: Client, room_id: str, user_id: str, token: str) -> Any:
    response = await client.request("GET", f"rooms/{room_id}/state/m.room.member/{user_id}", token=token)
    return response.body.get("membership") if response.status == 200 else None


async def _forbidden(client: Client, path: str, body: Any, token: str) -> None:
    response = await client.request("POST", path, body, token=token)
    assert response.status == 403 and response.errcode == "M_FORBIDDEN", (path, response)
    assert isinstance(response.body.get("error"), str) and response.body["error"], response


async def test_membership_changes_are_authorised_against_current_state(database_dsn: str, tmp_path: Path) -> None:
    """Kick, ban, unban, invite and join follow the auth rules; a refused change sends nothing.

    Spec (auth rules, m.room.member leave): a kicker must be joined. A kick of a user
    who is not in the room (left, or never joined) is refused, as Synapse does
    (403 "The target user is not in the room"); an unban applies only to a banned
    user. A banned user cannot join, nor be invited, until unbanned.
    """
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        carol = (await client.register_ok("carol"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        before = await _event_ids(client, room_id, alice)

        # Carol is not in the room: she cannot kick Bob (nor ban him), though he is there.
        await _forbidden(client, f"rooms/{room_id}/kick", {"user_id": BOB}, carol)
        await _forbidden(client, f"rooms/{room_id}/ban", {"user_id": BOB}, carol)
        # Bob (power 0) cannot kick Alice (power 100).
        await _forbidden(client, f"rooms/{room_id}/kick", {"user_id": ALICE}, bob)
        # An unban of someone who is not banned is refused (it would be a kick in disguise).
        await _forbidden(client, f"rooms/{room_id}/unban", {"user_id": BOB}, alice)
        # A kick of someone who never joined is refused.
        await _forbidden(client, f"rooms/{room_id}/kick", {"user_id": CAROL}, alice)
        assert await _event_ids(client, room_id, alice) == before
        assert await _membership(client, room_id, BOB, alice) == "join"

        # Bob leaves; a kick of a user who already left is refused and sends nothing.
        await _ok(client, "POST", f"rooms/{room_id}/leave", {}, token=bob)
        left = await _event_ids(client, room_id, alice)
        await _forbidden(client, f"rooms/{room_id}/kick", {"user_id": BOB}, alice)
        assert await _event_ids(client, room_id, alice) == left

        # A ban of a user who is not in the room is allowed; the banned user stays out.
        await _ok(client, "POST", f"rooms/{room_id}/ban", {"user_id": BOB, "reason": "spam"}, token=alice)
        assert await _membership(client, room_id, BOB, alice) == "ban"
        await _forbidden(client, f"rooms/{room_id}/join", {}, bob)
        await _forbidden(client, f"join/{room_id}", {}, bob)
        await _forbidden(client, f"rooms/{room_id}/invite", {"user_id": BOB}, alice)
        await _forbidden(client, f"rooms/{room_id}/kick", {"user_id": BOB}, alice)
        assert await _membership(client, room_id, BOB, alice) == "ban"

        # Unbanned, Bob may join the public room again.
        await _ok(client, "POST", f"rooms/{room_id}/unban", {"user_id": BOB}, token=alice)
        assert await _membership(client, room_id, BOB, alice) == "leave"
        await _forbidden(client, f"rooms/{room_id}/unban", {"user_id": BOB}, alice)
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        assert await _membership(client, room_id, BOB, alice) == "join"

        # Kick works on a joined user, and on an invited one (rescinding the invite).
        await _ok(client, "POST", f"rooms/{room_id}/kick", {"user_id": BOB}, token=alice)
        assert await _membership(client, room_id, BOB, alice) == "leave"
        await _ok(client, "POST", f"rooms/{room_id}/invite", {"user_id": CAROL}, token=alice)
        await _ok(client, "POST", f"rooms/{room_id}/kick", {"user_id": CAROL}, token=alice)
        assert await _membership(client, room_id, CAROL, alice) == "leave"

        # A room nobody here knows is 404, whatever the action.
        unknown = await client.request("POST", f"rooms/!nope:{SERVER_NAME}/kick", {"user_id": BOB}, token=alice)
        assert unknown.status == 404 and unknown.errcode == "M_NOT_FOUND"


async def test_repeating_a_state_change_or_a_join_creates_no_event(database_dsn: str, tmp_path: Path) -> None:
    """Setting the same state twice, or joining twice, answers the existing event and sends nothing.

    The spec leaves this open; Synapse (and clients that retry) expect a state event
    equal to the current one (same type, state key, sender and content) not to be sent
    again, its event ID answered instead, and a join of a joined user with unchanged
    content to succeed without a new event.
    """
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        topic = await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "t"}, token=alice)
        before = await _event_ids(client, room_id, alice)
        again = await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "t"}, token=alice)
        assert again["event_id"] == topic["event_id"]
        assert await _event_ids(client, room_id, alice) == before

        # Other content, or the same content from another sender, is a new event.
        changed = await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "u"}, token=alice)
        assert changed["event_id"] != topic["event_id"]
        back = await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "t"}, token=alice)
        assert back["event_id"] not in (topic["event_id"], changed["event_id"])
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        power = await _ok(client, "GET", f"rooms/{room_id}/state/m.room.power_levels/", token=alice)
        power["users"][BOB] = 100
        await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.power_levels/", power, token=alice)
        by_bob = await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "t"}, token=bob)
        assert by_bob["event_id"] != back["event_id"]

        # Joining a room one is joined to with the same content: 200, no new event.
        joined = await _event_ids(client, room_id, alice)
        assert (await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob))["room_id"] == room_id
        assert (await _ok(client, "POST", f"join/{room_id}", {}, token=bob))["room_id"] == room_id
        assert await _event_ids(client, room_id, alice) == joined
        # A join with a reason is other content: a new event.
        await _ok(client, "POST", f"rooms/{room_id}/join", {"reason": "back"}, token=bob)
        assert len(await _event_ids(client, room_id, alice)) == len(joined) + 1


async def test_join_keeps_custom_content_fields(database_dsn: str, tmp_path: Path) -> None:
    """``POST /join`` and ``/rooms/{roomId}/join``: the body's fields go into the member event.

    The spec names ``reason`` (and ``third_party_signed``, which is not content); as
    Synapse, other keys of the body are kept in the join's content, a ``displayname``
    or ``avatar_url`` given there is a per-room profile, and the server sets
    ``membership`` (and never takes ``join_authorised_via_users_server`` from a client).
    """
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        await _ok(client, "PUT", f"profile/{BOB}/displayname", {"displayname": "Bob"}, token=bob)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        body = {"reason": "hello", "foo": "bar", "nested": {"n": [1, 2]}, "membership": "leave",
                "join_authorised_via_users_server": ALICE}
        assert (await _ok(client, "POST", f"join/{room_id}", body, token=bob))["room_id"] == room_id
        member = await _ok(client, "GET", f"rooms/{room_id}/state/m.room.member/{BOB}", token=alice)
        assert member == {"membership": "join", "displayname": "Bob", "reason": "hello", "foo": "bar",
                          "nested": {"n": [1, 2]}}

        await _ok(client, "POST", f"rooms/{room_id}/join", {"displayname": "Bobby here", "x": True}, token=bob)
        member = await _ok(client, "GET", f"rooms/{room_id}/state/m.room.member/{BOB}", token=alice)
        assert member == {"membership": "join", "displayname": "Bobby here", "x": True}

        # Hostile content is refused, and sends nothing.
        before = await _event_ids(client, room_id, alice)
        for bad in ({"reason": 5}, {"displayname": ["x"]}, {"avatar_url": 1}, {"f": 1.5}):
            response = await client.request("POST", f"join/{room_id}", bad, token=bob)
            assert response.status == 400 and response.errcode in ("M_BAD_JSON", "M_INVALID_PARAM"), (bad, response)
        too_big = await client.request("POST", f"rooms/{room_id}/join", {"pad": "x" * 70_000}, token=bob)
        assert too_big.status in (400, 413), too_big
        assert await _event_ids(client, room_id, alice) == before
