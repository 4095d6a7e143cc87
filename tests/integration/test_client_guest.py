"""Guest access over HTTP against an in-process server and real PostgreSQL.

The client-server spec's guest access module: ``POST /register?kind=guest``
makes a passwordless account (only when ``allow_guest_access`` is on), a guest
may call only the endpoints the spec lists for guests (everything else is 403
``M_GUEST_ACCESS_FORBIDDEN``), and joins only rooms whose
``m.room.guest_access`` is ``can_join``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from storage.stores.accounts import AccountStore
from tests.integration.test_client_support import SERVER_NAME, Client, running_server


async def _guest(client: Client, body: dict[str, Any] | None = None) -> dict[str, Any]:
    response = await client.request("POST", "register?kind=guest", {} if body is None else body)
    assert response.status == 200, response
    result: dict[str, Any] = response.body
    return result


async def _room(client: Client, token: str, guest_access: str | None) -> str:
    body: dict[str, Any] = {"preset": "public_chat"}
    if guest_access is not None:
        body["initial_state"] = [{"type": "m.room.guest_access", "state_key": "", "content": {"guest_access": guest_access}}]
    created = await client.request("POST", "createRoom", body, token=token)
    assert created.status == 200, created
    room_id: str = created.body["room_id"]
    return room_id


async def test_guest_registration_is_off_unless_configured(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        refused = await client.request("POST", "register?kind=guest", {})
        assert refused.status == 403 and refused.errcode == "M_GUEST_ACCESS_FORBIDDEN"
        bad_kind = await client.request("POST", "register?kind=robot", {})
        assert bad_kind.status == 400 and bad_kind.errcode == "M_INVALID_PARAM"


async def test_guest_registration_makes_a_guest_account(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, allow_guest_access=True) as (hs, client):
        # The spec: every field but initial_device_display_name is ignored; the server picks the device.
        guest = await _guest(
            client,
            {"username": "mallory", "password": "pw", "device_id": "CHOSEN", "initial_device_display_name": "Guest tab"},
        )
        assert set(guest) >= {"user_id", "access_token", "device_id"}
        assert guest["user_id"] != f"@mallory:{SERVER_NAME}" and guest["user_id"].endswith(f":{SERVER_NAME}")
        assert guest["device_id"] != "CHOSEN"
        token = guest["access_token"]
        whoami = await client.request("GET", "account/whoami", token=token)
        assert whoami.status == 200
        assert whoami.body == {"user_id": guest["user_id"], "device_id": guest["device_id"], "is_guest": True}
        device = await client.request("GET", f"devices/{guest['device_id']}", token=token)
        assert device.status == 200 and device.body["display_name"] == "Guest tab"
        # Marked in the accounts store, with no password: logging in with one fails.
        row = await AccountStore(hs.process.db).get_user(guest["user_id"])
        assert row is not None and row.is_guest and row.password_hash is None
        localpart = guest["user_id"][1:].partition(":")[0]
        login = await client.login(localpart, "pw")
        assert login.status == 403 and login.errcode == "M_FORBIDDEN"
        # A second guest is a different account.
        other = await _guest(client)
        assert other["user_id"] != guest["user_id"]
        # A wrongly typed display name is bad input, not a 500.
        bad = await client.request("POST", "register?kind=guest", {"initial_device_display_name": 5})
        assert bad.status == 400 and bad.errcode == "M_BAD_JSON"


async def test_guests_may_use_only_the_guest_endpoints(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, allow_guest_access=True) as (_, client):
        alice = await client.register_ok("alice")
        room_id = await _room(client, alice["access_token"], "can_join")
        guest = await _guest(client)
        token = guest["access_token"]
        room = quote(room_id)
        joined = await client.request("POST", f"rooms/{room}/join", {}, token=token)
        assert joined.status == 200, joined
        allowed = [
            ("GET", "sync?timeout=0", None),
            ("GET", f"rooms/{room}/state", None),
            ("GET", f"rooms/{room}/state/m.room.create/", None),
            ("GET", f"rooms/{room}/messages?dir=b", None),
            ("GET", f"rooms/{room}/members", None),
            ("GET", f"profile/{quote(guest['user_id'])}", None),
            ("PUT", f"rooms/{room}/typing/{quote(guest['user_id'])}", {"typing": True, "timeout": 1000}),
            ("GET", "devices", None),
            ("PUT", f"rooms/{room}/send/m.room.message/t1", {"msgtype": "m.text", "body": "hi"}),
        ]
        for method, path, body in allowed:
            response = await client.request(method, path, body, token=token)
            assert response.status == 200, (method, path, response)
        forbidden = [
            ("POST", "createRoom", {}),
            ("PUT", f"rooms/{room}/send/m.room.custom/t2", {"x": 1}),
            ("PUT", f"rooms/{room}/state/m.room.topic/", {"topic": "guest topic"}),
            ("POST", f"rooms/{room}/invite", {"user_id": alice["user_id"]}),
            ("PUT", f"user/{quote(guest['user_id'])}/account_data/m.x", {}),
            ("POST", "account/password", {"new_password": "x"}),
        ]
        for method, path, body in forbidden:
            response = await client.request(method, path, body, token=token)
            assert response.status == 403 and response.errcode == "M_GUEST_ACCESS_FORBIDDEN", (method, path, response)
        # Nothing the refused requests asked for happened.
        state = await client.request("GET", f"rooms/{room}/state", token=alice["access_token"])
        types = {event["type"] for event in state.body}
        assert "m.room.topic" not in types
        messages = await client.request("GET", f"rooms/{room}/messages?dir=b&limit=50", token=alice["access_token"])
        sent = [event["type"] for event in messages.body["chunk"] if event["sender"] == guest["user_id"]]
        assert "m.room.custom" not in sent and "m.room.message" in sent
        # A user account is not restricted by the guest list.
        custom = await client.request(
            "PUT", f"rooms/{room}/send/m.room.custom/t3", {"x": 1}, token=alice["access_token"]
        )
        assert custom.status == 200, custom
        left = await client.request("POST", f"rooms/{room}/leave", {}, token=token)
        assert left.status == 200, left


async def test_guests_join_only_can_join_rooms(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, allow_guest_access=True) as (_, client):
        alice = await client.register_ok("alice")
        open_room = await _room(client, alice["access_token"], "can_join")
        closed_room = await _room(client, alice["access_token"], "forbidden")
        guest = await _guest(client)
        token = guest["access_token"]
        for room_id in (closed_room,):
            for path in (f"rooms/{quote(room_id)}/join", f"join/{quote(room_id)}"):
                refused = await client.request("POST", path, {}, token=token)
                assert refused.status == 403 and refused.errcode == "M_FORBIDDEN", (path, refused)
            members = await client.request("GET", f"rooms/{quote(room_id)}/members", token=alice["access_token"])
            assert guest["user_id"] not in {event["state_key"] for event in members.body["chunk"]}
        joined = await client.request("POST", f"join/{quote(open_room)}", {}, token=token)
        assert joined.status == 200 and joined.body == {"room_id": open_room}
        members = await client.request("GET", f"rooms/{quote(open_room)}/joined_members", token=alice["access_token"])
        assert guest["user_id"] in members.body["joined"]
        # Users are not held to the room's guest setting.
        bob = await client.register_ok("bob")
        bob_join = await client.request("POST", f"join/{quote(closed_room)}", {}, token=bob["access_token"])
        assert bob_join.status == 200, bob_join


async def test_guest_upgrades_with_its_access_token(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, allow_guest_access=True) as (hs, client):
        guest = await _guest(client)
        guest_token = guest["access_token"]
        localpart = guest["user_id"][1:].partition(":")[0]
        alice = await client.register_ok("alice")
        # Only a guest's token upgrades, and only to the guest's own user ID.
        not_guest = await client.register("bob", guest_access_token=alice["access_token"])
        assert not_guest.status == 403 and not_guest.errcode == "M_FORBIDDEN"
        unknown = await client.register(localpart, guest_access_token="trb_nonsense")
        assert unknown.status == 401 and unknown.errcode == "M_UNKNOWN_TOKEN"
        other_name = await client.register("carol", guest_access_token=guest_token)
        assert other_name.status == 400 and other_name.errcode == "M_INVALID_PARAM"
        wrong_type = await client.register(localpart, guest_access_token=5)
        assert wrong_type.status == 400 and wrong_type.errcode == "M_BAD_JSON"
        assert (await client.login("carol")).status == 403
        row = await AccountStore(hs.process.db).get_user(guest["user_id"])
        assert row is not None and row.is_guest
        # With its own localpart (or none), the guest becomes a full account.
        upgraded = await client.register(localpart, "newpass", guest_access_token=guest_token, device_id="LAPTOP")
        assert upgraded.status == 200, upgraded
        assert upgraded.body["user_id"] == guest["user_id"] and upgraded.body["device_id"] == "LAPTOP"
        row = await AccountStore(hs.process.db).get_user(guest["user_id"])
        assert row is not None and not row.is_guest and row.password_hash is not None
        # The old token now belongs to a full account (its cached guest flag is gone), as does the new one.
        for token in (guest_token, upgraded.body["access_token"]):
            whoami = await client.request("GET", "account/whoami", token=token)
            assert whoami.status == 200 and whoami.body["is_guest"] is False, whoami
            created = await client.request("POST", "createRoom", {}, token=token)
            assert created.status == 200, created
        assert (await client.login(localpart, "newpass")).status == 200
        # A second upgrade finds no guest left.
        again = await client.register(None, "pw2", guest_access_token=guest_token)
        assert again.status == 403 and again.errcode == "M_FORBIDDEN"
