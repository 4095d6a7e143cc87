"""The account stores against a real, migrated PostgreSQL: users, tokens, devices, profiles, filters, account data."""

from __future__ import annotations

import json

from storage.database import Database
from storage.streams import STREAMS, AccountDataStreamRow, StreamName
from storage.stores.account_data import AccountDataStore
from storage.stores.accounts import AccountStore, NewLogin, TokenOwner
from storage.stores.devices import DeviceStore
from storage.stores.filters import FilterStore
from storage.stores.profiles import ProfileRow, ProfileStore


def _login(device_id: str, token: bytes, name: str | None = None) -> NewLogin:
    return NewLogin(device_id, name, token, "127.0.0.1")


async def test_registration_writes_user_profile_device_and_token_together(database: Database) -> None:
    accounts, devices, profiles = AccountStore(database), DeviceStore(database), ProfileStore(database)
    created = await accounts.register_user(
        "@alice:hs", password_hash="$2b$hash", displayname="alice", login=_login("DEV1", b"t" * 32, "Phone"), now_ms=5
    )
    assert created
    user = await accounts.get_user("@alice:hs")
    assert user is not None and user.password_hash == "$2b$hash" and user.created_ts == 5 and not user.deactivated
    assert await profiles.get_profile("@alice:hs") == ProfileRow("@alice:hs", "alice", None)
    device = await devices.get_device("@alice:hs", "DEV1")
    assert device is not None and device.display_name == "Phone" and device.last_seen_ip == "127.0.0.1"
    owner = await accounts.get_token_owner(b"t" * 32)
    assert owner is not None and (owner.user_id, owner.device_id, owner.is_guest) == ("@alice:hs", "DEV1", False)

    again = await accounts.register_user(
        "@alice:hs", password_hash=None, displayname="x", login=_login("DEV2", b"u" * 32), now_ms=6
    )
    assert not again
    assert await accounts.get_token_owner(b"u" * 32) is None
    assert await devices.get_device("@alice:hs", "DEV2") is None


async def test_registration_without_login(database: Database) -> None:
    accounts = AccountStore(database)
    assert await accounts.register_user("@bob:hs", password_hash=None, displayname="bob", login=None, now_ms=1)
    assert await DeviceStore(database).get_devices("@bob:hs") == []
    assert await accounts.get_user("@nobody:hs") is None


async def test_deactivation_keeps_the_user_id_and_stops_its_tokens(database: Database) -> None:
    accounts = AccountStore(database)
    await accounts.register_user("@d:hs", password_hash="$2b$h", displayname="d", login=_login("D", b"d" * 32), now_ms=1)
    await accounts.register_user("@e:hs", password_hash=None, displayname="e", login=_login("E", b"e" * 32), now_ms=1)
    await accounts.deactivate_user("@d:hs")
    user = await accounts.get_user("@d:hs")
    assert user is not None and user.deactivated and user.password_hash == "$2b$h"
    assert await accounts.get_token_owner(b"d" * 32) is None
    assert not await accounts.register_user("@d:hs", password_hash=None, displayname=None, login=None, now_ms=2)
    other = await accounts.get_user("@e:hs")
    assert other is not None and not other.deactivated
    assert await accounts.get_token_owner(b"e" * 32) is not None


async def test_login_on_a_known_device_replaces_its_token(database: Database) -> None:
    accounts, devices = AccountStore(database), DeviceStore(database)
    await accounts.register_user("@a:hs", password_hash=None, displayname=None, login=_login("D", b"1" * 32, "Old"), now_ms=1)
    replaced = await accounts.add_login("@a:hs", _login("D", b"2" * 32, "New name ignored"), now_ms=2)
    assert replaced == [b"1" * 32]
    assert await accounts.get_token_owner(b"1" * 32) is None
    owner = await accounts.get_token_owner(b"2" * 32)
    assert isinstance(owner, TokenOwner) and owner.device_id == "D"
    device = await devices.get_device("@a:hs", "D")
    assert device is not None and device.display_name == "Old"
    assert await accounts.add_login("@a:hs", _login("E", b"3" * 32), now_ms=3) == []
    assert [d.device_id for d in await devices.get_devices("@a:hs")] == ["D", "E"]


async def test_deleting_devices_deletes_their_tokens(database: Database) -> None:
    accounts, devices = AccountStore(database), DeviceStore(database)
    await accounts.register_user("@a:hs", password_hash=None, displayname=None, login=_login("D1", b"1" * 32), now_ms=1)
    await accounts.add_login("@a:hs", _login("D2", b"2" * 32), now_ms=1)
    await accounts.add_login("@a:hs", _login("D3", b"3" * 32), now_ms=1)
    deleted = await devices.delete_devices("@a:hs", ["D1", "D2", "NOPE"])
    assert deleted.device_ids == ("D1", "D2")
    assert sorted(deleted.token_hashes) == [b"1" * 32, b"2" * 32]
    assert await accounts.get_token_owner(b"1" * 32) is None
    assert await accounts.get_token_owner(b"3" * 32) is not None
    everything = await devices.delete_all_devices("@a:hs")
    assert everything.device_ids == ("D3",) and everything.token_hashes == (b"3" * 32,)
    assert await devices.get_devices("@a:hs") == []


async def test_password_change_logs_out_every_other_device(database: Database) -> None:
    accounts, devices = AccountStore(database), DeviceStore(database)
    await accounts.register_user("@a:hs", password_hash="old", displayname=None, login=_login("KEEP", b"k" * 32), now_ms=1)
    await accounts.add_login("@a:hs", _login("OTHER", b"o" * 32), now_ms=1)
    kept = await accounts.set_password_hash("@a:hs", "new1", keep_device_id="KEEP", logout_devices=False)
    assert kept.device_ids == ()
    deleted = await accounts.set_password_hash("@a:hs", "new2", keep_device_id="KEEP", logout_devices=True)
    assert deleted.device_ids == ("OTHER",) and deleted.token_hashes == (b"o" * 32,)
    user = await accounts.get_user("@a:hs")
    assert user is not None and user.password_hash == "new2"
    assert [d.device_id for d in await devices.get_devices("@a:hs")] == ["KEEP"]


async def test_device_names_and_last_seen(database: Database) -> None:
    accounts, devices = AccountStore(database), DeviceStore(database)
    await accounts.register_user("@a:hs", password_hash=None, displayname=None, login=_login("D", b"1" * 32), now_ms=1)
    assert await devices.set_display_name("@a:hs", "D", "Laptop")
    assert not await devices.set_display_name("@a:hs", "NOPE", "x")
    await devices.update_last_seen("@a:hs", "D", 999, "::1")
    device = await devices.get_device("@a:hs", "D")
    assert device is not None and (device.display_name, device.last_seen_ts, device.last_seen_ip) == ("Laptop", 999, "::1")


async def test_profiles(database: Database) -> None:
    accounts, profiles = AccountStore(database), ProfileStore(database)
    await accounts.register_user("@a:hs", password_hash=None, displayname="a", login=None, now_ms=1)
    assert await profiles.set_displayname("@a:hs", "Alice ✓") == ProfileRow("@a:hs", "Alice ✓", None)
    assert await profiles.set_avatar_url("@a:hs", "mxc://hs/abc") == ProfileRow("@a:hs", "Alice ✓", "mxc://hs/abc")
    assert await profiles.set_displayname("@a:hs", None) == ProfileRow("@a:hs", None, "mxc://hs/abc")
    assert await profiles.set_displayname("@ghost:hs", "x") is None
    assert await profiles.get_profile("@ghost:hs") is None


async def test_filters_are_per_user_and_deduplicated(database: Database) -> None:
    filters = FilterStore(database)
    first = await filters.add_filter("@a:hs", '{"room":{}}')
    assert await filters.add_filter("@a:hs", '{"room":{}}') == first
    other = await filters.add_filter("@a:hs", "{}")
    assert other != first
    assert await filters.add_filter("@b:hs", '{"room":{}}') != first
    assert await filters.get_filter("@a:hs", first) == '{"room":{}}'
    assert await filters.get_filter("@b:hs", other) is None
    assert await filters.get_filter("@a:hs", 10**15) is None


async def test_account_data_global_and_per_room_on_the_stream_table(database: Database) -> None:
    """Writes land in the account_data stream's table, so the stream's own reader sees them."""
    store = AccountDataStore(database)
    ids = [await store.next_stream_id_from_sequence() for _ in range(4)]
    assert ids == sorted(ids) and len(set(ids)) == 4
    await store.put("@a:hs", None, "m.direct", '{"@b:hs":["!r:hs"]}', stream_id=ids[0], instance_name="master")
    await store.put("@a:hs", "!r:hs", "m.tag", '{"tags":{}}', stream_id=ids[1], instance_name="master")
    await store.put("@a:hs", None, "m.direct", '{"v":2}', stream_id=ids[2], instance_name="master")
    await store.put("@b:hs", None, "m.direct", "{}", stream_id=ids[3], instance_name="master")

    assert await store.get("@a:hs", None, "m.direct") == '{"v":2}'
    assert await store.get("@a:hs", "!r:hs", "m.tag") == '{"tags":{}}'
    assert await store.get("@a:hs", "!other:hs", "m.tag") is None
    assert await store.get("@a:hs", None, "m.tag") is None

    everything = await store.get_for_user("@a:hs")
    assert everything.global_data == {"m.direct": '{"v":2}'}
    assert everything.rooms == {"!r:hs": {"m.tag": '{"tags":{}}'}}
    since = await store.get_for_user("@a:hs", after=ids[1])
    assert since.global_data == {"m.direct": '{"v":2}'} and since.rooms == {}
    assert json.loads((await store.get_for_user("@b:hs", upto=ids[3])).global_data["m.direct"]) == {}

    rows, upto, limited = await STREAMS[StreamName.ACCOUNT_DATA].get_updates_between(
        database, "master", 0, ids[3], 100
    )
    assert not limited and upto == ids[3]
    assert rows == [
        (ids[1], AccountDataStreamRow("@a:hs", "!r:hs", "m.tag")),
        (ids[2], AccountDataStreamRow("@a:hs", None, "m.direct")),
        (ids[3], AccountDataStreamRow("@b:hs", None, "m.direct")),
    ]


async def test_account_data_handler_with_the_real_stream_generator(database: Database) -> None:
    """What the composition root will wire: the account_data stream's generator as the allocator.
    Each write's stream ID completes when the write is done, so the stream's position covers it."""
    from homeserver.handlers.accounts.account_data import AccountDataHandler
    from homeserver.handlers.accounts.auth import Requester
    from storage.streams import create_id_generator
    from tests.twisted_plugin import reactor

    generator = await create_id_generator(
        database, reactor, STREAMS[StreamName.ACCOUNT_DATA], instance_name="master", writers=["master"]
    )
    moves: list[tuple[int, int]] = []
    generator.add_position_listener(lambda stream, instance, old, new: moves.append((old, new)))
    handler = AccountDataHandler(AccountDataStore(database), generator.get_next, instance_name="master")
    alice = Requester("@a:hs", "DEV", 1)
    first = await handler.set_global(alice, "@a:hs", "m.direct", {"x": 1})
    second = await handler.set_room(alice, "@a:hs", "!r:hs", "m.tag", {"tags": {}})
    assert first < second == generator.get_current_token()
    assert moves[-1][1] == second
    assert await handler.get_global(alice, "@a:hs", "m.direct") == {"x": 1}
    rows, _, _ = await STREAMS[StreamName.ACCOUNT_DATA].get_updates_between(database, "master", 0, second, 10)
    assert [stream_id for stream_id, _ in rows] == [first, second]
