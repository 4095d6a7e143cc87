"""matrix-nio's AsyncClient against a real ``tributary`` process: the account side of the API, unmodified.

nio runs on asyncio; our tests run on Twisted's asyncio reactor over the same
(uvloop) loop, so each nio coroutine is awaited as a Deferred of its future.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import nio
from nio import responses
import pytest
import yaml
from twisted.internet.defer import Deferred

from tests.harness import TributaryProcess

pytestmark = pytest.mark.e2e

T = TypeVar("T")


async def run(coro: Coroutine[Any, Any, T]) -> T:
    result: T = await Deferred.fromFuture(asyncio.ensure_future(coro))
    return result


@pytest.fixture
def server(tmp_path: Path, database_dsn: str) -> Iterator[TributaryProcess]:
    # The harness's config already sets cheap bcrypt and generous rate limits.
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn)
    config = yaml.safe_load(hs.config_path.read_text())
    config["public_baseurl"] = hs.base_url
    hs.config_path.write_text(yaml.safe_dump(config))
    hs.start()
    try:
        yield hs
    finally:
        code = hs.stop()
        assert code == 0, hs.output
        assert "Traceback" not in hs.output, hs.output


async def test_register_login_devices_profile_account_data_filters(server: TributaryProcess) -> None:
    alice = nio.AsyncClient(server.base_url, "alice")
    second = nio.AsyncClient(server.base_url, "alice")
    try:
        discovery = await run(alice.discovery_info())
        assert isinstance(discovery, responses.DiscoveryInfoResponse), discovery
        assert discovery.homeserver_url == server.base_url

        registered = await run(alice.register("alice", "correct horse", device_name="nio test"))
        assert isinstance(registered, responses.RegisterResponse), registered
        assert registered.user_id == "@alice:localhost" and alice.access_token == registered.access_token
        taken = await run(nio.AsyncClient(server.base_url, "x").register("alice", "pw"))
        assert isinstance(taken, responses.RegisterErrorResponse) and taken.status_code == "M_USER_IN_USE"

        flows = await run(alice.login_info())
        assert isinstance(flows, responses.LoginInfoResponse) and "m.login.password" in flows.flows
        wrong = await run(second.login("wrong password"))
        assert isinstance(wrong, responses.LoginError) and wrong.status_code == "M_FORBIDDEN"
        login = await run(second.login("correct horse", device_name="second"))
        assert isinstance(login, responses.LoginResponse), login
        assert login.device_id != registered.device_id

        whoami = await run(second.whoami())
        assert isinstance(whoami, responses.WhoamiResponse)
        assert (whoami.user_id, whoami.device_id, whoami.is_guest) == ("@alice:localhost", login.device_id, False)

        devices = await run(alice.devices())
        assert isinstance(devices, responses.DevicesResponse)
        assert sorted(d.id for d in devices.devices) == sorted([registered.device_id, login.device_id])
        renamed = await run(alice.update_device(login.device_id, {"display_name": "renamed"}))
        assert isinstance(renamed, responses.UpdateDeviceResponse), renamed
        names = {d.id: d.display_name for d in (await run(alice.devices())).devices}
        assert names[login.device_id] == "renamed" and names[registered.device_id] == "nio test"

        needs_auth = await run(alice.delete_devices([login.device_id]))
        assert isinstance(needs_auth, responses.DeleteDevicesAuthResponse), needs_auth
        auth = {"type": "m.login.password", "user": "alice", "password": "correct horse", "session": needs_auth.session}
        deleted = await run(alice.delete_devices([login.device_id], auth))
        assert isinstance(deleted, responses.DeleteDevicesResponse), deleted
        assert isinstance(await run(second.whoami()), responses.WhoamiError)

        assert isinstance(await run(alice.set_displayname("Alice ✓")), responses.ProfileSetDisplayNameResponse)
        assert isinstance(await run(alice.set_avatar("mxc://localhost/avatar")), responses.ProfileSetAvatarResponse)
        displayname = await run(alice.get_displayname())
        assert isinstance(displayname, responses.ProfileGetDisplayNameResponse) and displayname.displayname == "Alice ✓"
        avatar = await run(alice.get_avatar())
        assert isinstance(avatar, responses.ProfileGetAvatarResponse) and avatar.avatar_url == "mxc://localhost/avatar"
        profile = await run(alice.get_profile())
        assert isinstance(profile, responses.ProfileGetResponse)
        assert (profile.displayname, profile.avatar_url) == ("Alice ✓", "mxc://localhost/avatar")
        unknown = await run(alice.get_profile("@nobody:localhost"))
        assert isinstance(unknown, responses.ProfileGetError) and unknown.status_code == "M_NOT_FOUND"

        no_direct = await run(alice.list_direct_rooms())
        assert isinstance(no_direct, responses.DirectRoomsErrorResponse) and no_direct.status_code == "M_NOT_FOUND"
        direct = {"@bob:localhost": ["!abc:localhost"]}
        path = nio.Api._build_path(
            ["user", "@alice:localhost", "account_data", "m.direct"], {"access_token": alice.access_token}
        )
        put = await run(alice.send("PUT", path, json.dumps(direct), headers={"Content-Type": "application/json"}))
        assert put.status == 200
        rooms = await run(alice.list_direct_rooms())
        assert isinstance(rooms, responses.DirectRoomsResponse) and rooms.rooms == direct

        uploaded = await run(alice.upload_filter(room={"timeline": {"limit": 5}}, presence={"types": []}))
        assert isinstance(uploaded, responses.UploadFilterResponse) and uploaded.filter_id
        fetch_path = nio.Api._build_path(
            ["user", "@alice:localhost", "filter", uploaded.filter_id], {"access_token": alice.access_token}
        )
        fetched = await run(alice.send("GET", fetch_path))
        assert fetched.status == 200
        assert await run(fetched.json()) == {"room": {"timeline": {"limit": 5}}, "presence": {"types": []}, "event_format": "client"}

        token = alice.access_token
        logout = await run(alice.logout())
        assert isinstance(logout, responses.LogoutResponse), logout
        stale = nio.AsyncClient(server.base_url, "alice")
        stale.access_token = token
        gone = await run(stale.whoami())
        assert isinstance(gone, responses.WhoamiError) and gone.status_code == "M_UNKNOWN_TOKEN"
        await run(stale.close())
    finally:
        await run(alice.close())
        await run(second.close())


async def test_logout_all_and_token_errors(server: TributaryProcess) -> None:
    clients = [nio.AsyncClient(server.base_url, "bob") for _ in range(3)]
    try:
        assert isinstance(await run(clients[0].register("bob", "pw")), responses.RegisterResponse)
        for client in clients[1:]:
            assert isinstance(await run(client.login("pw")), responses.LoginResponse)
        assert isinstance(await run(clients[1].logout(all_devices=True)), responses.LogoutResponse)
        for client in clients:
            response = await run(client.whoami())
            assert isinstance(response, responses.WhoamiError) and response.status_code == "M_UNKNOWN_TOKEN"
        unknown = nio.AsyncClient(server.base_url, "bob")
        unknown.access_token = "trb_not_a_token"
        response = await run(unknown.whoami())
        assert isinstance(response, responses.WhoamiError) and response.status_code == "M_UNKNOWN_TOKEN"
        await run(unknown.close())
    finally:
        for client in clients:
            await run(client.close())
