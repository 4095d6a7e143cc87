"""Room upgrades end to end (issue 19, item 6): ``POST /rooms/{roomId}/upgrade`` between two
Tributary servers.

Alice (A) has a room of an old version, with an alias and a name, shared with Carol (A) and
Bob (B, over federation). Carol, without the power, cannot upgrade it; nobody can upgrade
to an unknown version. Alice upgrades it (1 -> 12 invite-only, 9 -> 11 and 11 -> 12
public): the old room gets the tombstone and its power levels lock Carol out; the new room
has the version, ``predecessor``, the name, the canonical alias and the old room's bans; the
alias points at it, and it replaces the old room in the room directory.
Carol and Bob follow the tombstone (invited where the room is invite-only) and chat there;
/sync and /messages show the tombstone in the old room and the predecessor in the new one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_client_support import Client
from tests.integration.test_federation import eventually, name, stored
from tests.integration.test_room_versions import _ok, quote, two_servers

CASES = [("1", "12", "private_chat"), ("9", "11", "public_chat"), ("11", "12", "public_chat")]


async def _state(client: Client, room_id: str, event_type: str, token: str) -> Any:
    return await _ok(client, "GET", f"rooms/{quote(room_id)}/state/{event_type}/", token=token)


@pytest.mark.timeout(180)
async def test_upgrades_between_versions_with_a_remote_member(
    database_dsn: str, second_database_dsn: str, tmp_path: Path
) -> None:
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        cb = Client(f"http://127.0.0.1:{b.config.listeners[0].port}")
        alice = (await ca.register_ok("alice"))["access_token"]
        carol = (await ca.register_ok("carol"))["access_token"]
        bob = (await cb.register_ok("bob"))["access_token"]
        await ca.register_ok("mallory")
        carol_id, bob_id, mallory_id = f"@carol:{name(a)}", f"@bob:{name(b)}", f"@mallory:{name(a)}"
        via = f"?server_name={quote(name(a))}"

        for old, new, preset in CASES:
            alias = f"#up{old}to{new}:{name(a)}"
            body = {"preset": preset, "room_version": old, "room_alias_name": f"up{old}to{new}", "name": f"v{old}",
                    "visibility": "public" if preset == "public_chat" else "private"}
            room = (await _ok(ca, "POST", "createRoom", body, token=alice))["room_id"]
            if preset == "private_chat":
                await _ok(ca, "POST", f"rooms/{quote(room)}/invite", {"user_id": carol_id}, token=alice)
                await _ok(ca, "POST", f"rooms/{quote(room)}/invite", {"user_id": bob_id}, token=alice)
            await _ok(ca, "POST", f"join/{quote(room)}", {}, token=carol)
            await _ok(cb, "POST", f"join/{quote(room)}{via}", {}, token=bob)
            await _ok(ca, "POST", f"rooms/{quote(room)}/ban", {"user_id": mallory_id, "reason": "spam"}, token=alice)

            # Carol (power 0) may not send a tombstone; an unknown version is refused first.
            refused = await ca.request("POST", f"rooms/{quote(room)}/upgrade", {"new_version": new}, token=carol)
            assert (refused.status, refused.errcode) == (403, "M_FORBIDDEN"), refused
            unknown = await ca.request("POST", f"rooms/{quote(room)}/upgrade", {"new_version": "99"}, token=alice)
            assert (unknown.status, unknown.errcode) == (400, "M_UNSUPPORTED_ROOM_VERSION"), unknown
            missing = await ca.request("POST", f"rooms/{quote('!nope:' + name(a))}/upgrade", {"new_version": new},
                                       token=alice)
            assert (missing.status, missing.errcode) == (404, "M_NOT_FOUND"), missing
            bad = await ca.request("POST", f"rooms/{quote(room)}/upgrade", {"new_version": 12}, token=alice)
            assert (bad.status, bad.errcode) == (400, "M_BAD_JSON"), bad

            upgraded = await _ok(ca, "POST", f"rooms/{quote(room)}/upgrade", {"new_version": new}, token=alice)
            new_room = upgraded["replacement_room"]
            assert new_room != room
            # A retry answers the same room.
            again = await _ok(ca, "POST", f"rooms/{quote(room)}/upgrade", {"new_version": new}, token=alice)
            assert again["replacement_room"] == new_room

            tombstone = await _state(ca, room, "m.room.tombstone", alice)
            assert tombstone["replacement_room"] == new_room
            create = await _state(ca, new_room, "m.room.create", alice)
            assert create["room_version"] == new and create["predecessor"]["room_id"] == room
            assert ("event_id" in create["predecessor"]) is (new != "12")
            if new == "12":
                assert ":" not in new_room  # the create event's hash
            assert (await _state(ca, new_room, "m.room.name", alice))["name"] == f"v{old}"
            assert (await _state(ca, new_room, "m.room.canonical_alias", alice))["alias"] == alias
            assert "alias" not in await _state(ca, room, "m.room.canonical_alias", alice)
            assert (await _ok(ca, "GET", f"directory/room/{quote(alias)}", token=alice))["room_id"] == new_room
            mallory = await _ok(ca, "GET", f"rooms/{quote(new_room)}/state/m.room.member/{quote(mallory_id)}",
                                token=alice)
            assert mallory == {"membership": "ban", "reason": "spam"}
            # A room published in the directory is replaced there by the new room.
            for room_id, listed in ((room, "private"), (new_room, "public" if preset == "public_chat" else "private")):
                visibility = await _ok(ca, "GET", f"directory/list/room/{quote(room_id)}", token=alice)
                assert visibility["visibility"] == listed, (room_id, visibility)
            join_rule = (await _state(ca, new_room, "m.room.join_rules", alice))["join_rule"]
            assert join_rule == ("invite" if preset == "private_chat" else "public")

            # The old room is locked: Carol can no longer send or invite there.
            old_pl = await _state(ca, room, "m.room.power_levels", alice)
            assert old_pl["events_default"] >= 50 and old_pl["invite"] >= 50
            locked = await ca.request("PUT", f"rooms/{quote(room)}/send/m.room.message/t1",
                                      {"msgtype": "m.text", "body": "too late"}, token=carol)
            assert (locked.status, locked.errcode) == (403, "M_FORBIDDEN"), locked

            # Carol follows the tombstone: her /sync shows it, and the invite where one is needed.
            sync = await _ok(ca, "GET", "sync?timeout=0", token=carol)
            old_timeline = sync["rooms"]["join"][room]["timeline"]["events"]
            assert any(e["type"] == "m.room.tombstone" for e in old_timeline)
            if preset == "private_chat":
                assert new_room in sync["rooms"]["invite"]
            await _ok(ca, "POST", f"join/{quote(new_room)}", {}, token=carol)

            # Bob (B) sees the tombstone arrive, then joins the new room over federation.
            async def bobs_tombstone() -> Any:
                response = await cb.request("GET", f"rooms/{quote(room)}/state/m.room.tombstone/", token=bob)
                return response.body if response.status == 200 else None

            assert (await eventually(bobs_tombstone))["replacement_room"] == new_room
            if preset == "private_chat":
                async def bob_invited() -> bool:
                    sync = await _ok(cb, "GET", "sync?timeout=0", token=bob)
                    return new_room in sync.get("rooms", {}).get("invite", {})

                await eventually(bob_invited)
            await _ok(cb, "POST", f"join/{quote(new_room)}{via}", {}, token=bob)
            sent = (await _ok(cb, "PUT", f"rooms/{quote(new_room)}/send/m.room.message/u{old}",
                              {"msgtype": "m.text", "body": "bob upgraded"}, token=bob))["event_id"]
            await eventually(lambda: stored(a, sent))

            # /messages: the old room ends with the tombstone, the new room starts with its create event.
            old_chunk = (await _ok(ca, "GET", f"rooms/{quote(room)}/messages?dir=b&limit=5", token=carol))["chunk"]
            assert old_chunk[0]["type"] in ("m.room.tombstone", "m.room.power_levels", "m.room.canonical_alias")
            assert any(e["type"] == "m.room.tombstone" for e in old_chunk)
            new_chunk = (await _ok(ca, "GET", f"rooms/{quote(new_room)}/messages?dir=f&limit=50",
                                   token=carol))["chunk"]
            assert new_chunk[0]["type"] == "m.room.create"
            assert new_chunk[0]["content"]["predecessor"]["room_id"] == room
            assert any(e["event_id"] == sent for e in new_chunk)


@pytest.mark.timeout(60)
async def test_v12_upgrade_with_additional_creators(
    database_dsn: str, second_database_dsn: str, tmp_path: Path
) -> None:
    """``additional_creators`` go into the v12 create event and out of the power levels."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, _b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        alice = (await ca.register_ok("alice"))["access_token"]
        await ca.register_ok("dave")
        dave_id = f"@dave:{name(a)}"
        room = (await _ok(ca, "POST", "createRoom", {"room_version": "10", "preset": "trusted_private_chat",
                                                     "invite": [dave_id]}, token=alice))["room_id"]
        upgraded = await _ok(ca, "POST", f"rooms/{quote(room)}/upgrade",
                             {"new_version": "12", "additional_creators": [dave_id]}, token=alice)
        new_room = upgraded["replacement_room"]
        create = await _state(ca, new_room, "m.room.create", alice)
        assert create["additional_creators"] == [dave_id]
        users = (await _state(ca, new_room, "m.room.power_levels", alice))["users"]
        assert f"@alice:{name(a)}" not in users and dave_id not in users
