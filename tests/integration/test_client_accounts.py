"""The account endpoints over HTTP against an in-process server and real PostgreSQL.

Registration with user-interactive auth, login and logout, access tokens and
their cache, password changes, devices, profiles, account data, filters, push
rules, capabilities, discovery and rate limits: status codes and bodies as the
client-server spec gives them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from homeserver.handlers.accounts.auth import Requester
from storage.stores.profiles import ProfileRow
from tests.integration.test_client_support import SERVER_NAME, Client, running_server

ALICE = f"@alice:{SERVER_NAME}"
BOB = f"@bob:{SERVER_NAME}"


def _password_auth(password: str = "password", session: str | None = None, user: str = "alice") -> dict[str, Any]:
    auth: dict[str, Any] = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": user}, "password": password}
    if session is not None:
        auth["session"] = session
    return auth


async def test_registration_with_user_interactive_auth(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        first = await client.request("POST", "register", {"username": "alice", "password": "pw"})
        assert first.status == 401
        assert first.body["flows"] == [{"stages": ["m.login.dummy"]}] and first.body["params"] == {}
        session = first.body["session"]
        done = await client.request(
            "POST",
            "register",
            {
                "username": "alice",
                "password": "pw",
                "device_id": "MYPHONE",
                "initial_device_display_name": "Alice's phone",
                "auth": {"type": "m.login.dummy", "session": session},
            },
        )
        assert done.status == 200, done
        assert done.body["user_id"] == ALICE and done.body["device_id"] == "MYPHONE"
        assert done.body["home_server"] == SERVER_NAME and done.body["access_token"].startswith("trb_")
        # Retrying the completed session gives the same answer, not a second account.
        replay = await client.request("POST", "register", {"auth": {"type": "m.login.dummy", "session": session}})
        assert replay.status == 200 and replay.body == done.body

        token = done.body["access_token"]
        whoami = await client.request("GET", "account/whoami", token=token)
        assert whoami.body == {"user_id": ALICE, "device_id": "MYPHONE", "is_guest": False}
        device = await client.request("GET", "devices/MYPHONE", token=token)
        assert device.body["display_name"] == "Alice's phone" and device.body["last_seen_ip"] == "127.0.0.1"

        inhibited = await client.register("bob", inhibit_login=True, device_id="NOTMADE")
        assert inhibited.status == 200 and inhibited.body == {"user_id": BOB, "home_server": SERVER_NAME}
        bob_login = await client.login("bob")
        assert bob_login.status == 200
        # inhibit_login made no device: the login's is Bob's only one.
        bob_devices = await client.request("GET", "devices", token=bob_login.body["access_token"])
        assert [d["device_id"] for d in bob_devices.body["devices"]] == [bob_login.body["device_id"]]

        r0 = await client.request("POST", "/_matrix/client/r0/register", {"username": "Carol", "password": "pw", "auth": {"type": "m.login.dummy"}})
        assert r0.status == 200 and r0.body["user_id"] == f"@carol:{SERVER_NAME}"

        anonymous = await client.register(None)
        assert anonymous.status == 200 and anonymous.body["user_id"].endswith(f":{SERVER_NAME}")
        assert anonymous.body["user_id"] not in (ALICE, BOB)


async def test_registration_session_remembers_its_first_parameters(database_dsn: str, tmp_path: Path) -> None:
    """A UIA session keeps the parameters of its first request and registers once (as Synapse)."""
    async with running_server(database_dsn, tmp_path) as (_, client):
        first = await client.request(
            "POST",
            "register",
            {"username": "alice", "password": "first-pw", "device_id": "FIRSTDEV", "initial_device_display_name": "One"},
        )
        assert first.status == 401
        session = first.body["session"]
        # The completing request omits or changes the parameters: the first request's are used.
        done = await client.request(
            "POST",
            "register",
            {"username": "mallory", "device_id": "OTHER", "auth": {"type": "m.login.dummy", "session": session}},
        )
        assert done.status == 200, done
        assert (done.body["user_id"], done.body["device_id"]) == (ALICE, "FIRSTDEV")
        assert (await client.request("GET", "register/available?username=mallory")).body == {"available": True}
        device = await client.request("GET", "devices/FIRSTDEV", token=done.body["access_token"])
        assert device.body["display_name"] == "One"
        assert (await client.login("alice", "first-pw")).status == 200
        # Completing the same session again, username and all, is the same registration, not M_USER_IN_USE.
        again = await client.request(
            "POST",
            "register",
            {"username": "alice", "password": "first-pw", "auth": {"type": "m.login.dummy", "session": session}},
        )
        assert again.status == 200 and again.body == done.body
        # A different session asking for the same name is refused.
        taken = await client.register("alice")
        assert (taken.status, taken.errcode) == (400, "M_USER_IN_USE")
        # The parameters of one session are not another's.
        other = await client.request("POST", "register", {"username": "bob", "password": "pw"})
        stranger = await client.request(
            "POST", "register", {"username": "carol", "password": "pw",
                                 "auth": {"type": "m.login.dummy", "session": other.body["session"]}}
        )
        assert stranger.status == 200 and stranger.body["user_id"] == BOB


async def test_registration_needs_a_password(database_dsn: str, tmp_path: Path) -> None:
    """Like Synapse, a normal registration without a password is 400 M_MISSING_PARAM once auth is done."""
    async with running_server(database_dsn, tmp_path) as (_, client):
        first = await client.request("POST", "register", {"username": "alice"})
        assert first.status == 401
        session = first.body["session"]
        missing = await client.request(
            "POST", "register", {"username": "alice", "auth": {"type": "m.login.dummy", "session": session}}
        )
        assert (missing.status, missing.errcode) == (400, "M_MISSING_PARAM")
        assert (await client.request("GET", "register/available?username=alice")).body == {"available": True}
        inhibited = await client.request(
            "POST", "register", {"username": "bob", "inhibit_login": True, "auth": {"type": "m.login.dummy"}}
        )
        assert (inhibited.status, inhibited.errcode) == (400, "M_MISSING_PARAM")
        # The same session, now with the password, registers.
        fixed = await client.request(
            "POST", "register", {"password": "pw", "auth": {"type": "m.login.dummy", "session": session}}
        )
        assert fixed.status == 200 and fixed.body["user_id"] == ALICE
        assert (await client.login("alice", "pw")).status == 200


async def test_username_rules_come_before_auth(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        await client.register_ok("alice")
        for username, errcode in [
            ("alice", "M_USER_IN_USE"),
            ("ALICE", "M_USER_IN_USE"),
            ("al ice", "M_INVALID_USERNAME"),
            ("al:ice", "M_INVALID_USERNAME"),
            ("", "M_INVALID_USERNAME"),
            ("é", "M_INVALID_USERNAME"),
            ("x" * 250, "M_INVALID_USERNAME"),
        ]:
            response = await client.request("POST", "register", {"username": username})  # no auth at all
            assert (response.status, response.errcode) == (400, errcode), username
        available = await client.request("GET", "register/available?username=newname")
        assert available.status == 200 and available.body == {"available": True}
        taken = await client.request("GET", "register/available?username=Alice")
        assert (taken.status, taken.errcode) == (400, "M_USER_IN_USE")
        invalid = await client.request("GET", "register/available?username=%3A")
        assert (invalid.status, invalid.errcode) == (400, "M_INVALID_USERNAME")
        missing = await client.request("GET", "register/available")
        assert (missing.status, missing.errcode) == (400, "M_MISSING_PARAM")


async def test_closed_registration_and_guests(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, enable_registration=False) as (_, client):
        closed = await client.register("alice")
        assert (closed.status, closed.errcode) == (403, "M_FORBIDDEN")
        check = await client.request("GET", "register/available?username=alice")
        assert (check.status, check.errcode) == (403, "M_FORBIDDEN")
    async with running_server(database_dsn, tmp_path) as (_, client):
        guest = await client.request("POST", "register?kind=guest", {})
        assert (guest.status, guest.errcode) == (403, "M_GUEST_ACCESS_FORBIDDEN")
        odd = await client.request("POST", "register?kind=admin", {})
        assert (odd.status, odd.errcode) == (400, "M_INVALID_PARAM")


async def test_login_logout_and_tokens(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        flows = await client.request("GET", "login")
        assert flows.body == {"flows": [{"type": "m.login.password"}]}
        await client.register_ok("alice", "s3cret")

        login = await client.login("alice", "s3cret", device_id="LAPTOP")
        assert login.status == 200
        assert set(login.body) == {"user_id", "access_token", "device_id", "home_server"}
        assert (login.body["user_id"], login.body["device_id"]) == (ALICE, "LAPTOP")
        for user in (ALICE, "ALICE", f"@Alice:{SERVER_NAME}"):
            assert (await client.login(user, "s3cret")).status == 200, user
        legacy = await client.request("POST", "login", {"type": "m.login.password", "user": "alice", "password": "s3cret"})
        assert legacy.status == 200

        for response in [
            await client.login("alice", "wrong"),
            await client.login("nobody", "s3cret"),
            await client.login("@alice:elsewhere.example", "s3cret"),
        ]:
            assert (response.status, response.errcode) == (403, "M_FORBIDDEN")
        bad_type = await client.request("POST", "login", {"type": "m.login.token", "token": "x"})
        assert (bad_type.status, bad_type.errcode) == (400, "M_UNKNOWN")
        no_user = await client.request("POST", "login", {"type": "m.login.password", "password": "x"})
        assert (no_user.status, no_user.errcode) == (400, "M_MISSING_PARAM")
        third_party = {"type": "m.id.thirdparty", "medium": "email", "address": "a@b.c"}
        email = await client.request("POST", "login", {"type": "m.login.password", "identifier": third_party, "password": "x"})
        assert (email.status, email.errcode) == (403, "M_FORBIDDEN")

        token = login.body["access_token"]
        assert (await client.request("GET", "account/whoami", token=token)).status == 200  # now cached
        query = await client.request("GET", f"account/whoami?access_token={token}")
        assert query.status == 200 and query.body["device_id"] == "LAPTOP"

        # Logging in again on the same device replaces its token.
        relogin = await client.login("alice", "s3cret", device_id="LAPTOP")
        stale = await client.request("GET", "account/whoami", token=token)
        assert (stale.status, stale.errcode) == (401, "M_UNKNOWN_TOKEN") and stale.body["soft_logout"] is False
        token = relogin.body["access_token"]

        assert (await client.request("POST", "logout", token=token)).body == {}
        gone = await client.request("GET", "account/whoami", token=token)
        assert (gone.status, gone.errcode) == (401, "M_UNKNOWN_TOKEN")
        devices = await client.request("GET", "devices", token=(await client.login("alice", "s3cret")).body["access_token"])
        assert "LAPTOP" not in [d["device_id"] for d in devices.body["devices"]]

        missing = await client.request("GET", "account/whoami")
        assert (missing.status, missing.errcode) == (401, "M_MISSING_TOKEN")
        garbage = await client.request("GET", "account/whoami", token="trb_nonsense")
        assert (garbage.status, garbage.errcode) == (401, "M_UNKNOWN_TOKEN")

        tokens = [(await client.login("alice", "s3cret")).body["access_token"] for _ in range(3)]
        for t in tokens:
            assert (await client.request("GET", "account/whoami", token=t)).status == 200
        assert (await client.request("POST", "logout/all", token=tokens[0])).status == 200
        for t in tokens:
            assert (await client.request("GET", "account/whoami", token=t)).status == 401


async def test_login_well_known_with_public_baseurl(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        missing = await client.request("GET", "/.well-known/matrix/client")
        assert (missing.status, missing.errcode) == (404, "M_NOT_FOUND")
    async with running_server(database_dsn, tmp_path, public_baseurl="https://matrix.test.local/") as (_, client):
        await client.register_ok("alice")
        login = await client.login("alice")
        assert login.body["well_known"] == {"m.homeserver": {"base_url": "https://matrix.test.local"}}
        document = await client.request("GET", "/.well-known/matrix/client")
        assert document.status == 200 and document.body == login.body["well_known"]


async def test_password_change(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        current = (await client.register_ok("alice", "old-pw", device_id="CURRENT"))["access_token"]
        other = (await client.login("alice", "old-pw", device_id="OTHER")).body["access_token"]

        first = await client.request("POST", "account/password", {"new_password": "new-pw"}, token=current)
        assert first.status == 401 and first.body["flows"] == [{"stages": ["m.login.password"]}]
        session = first.body["session"]
        wrong = await client.request(
            "POST", "account/password", {"new_password": "new-pw", "auth": _password_auth("nope", session)}, token=current
        )
        assert (wrong.status, wrong.errcode, wrong.body["session"]) == (401, "M_FORBIDDEN", session)
        someone_else = await client.request(
            "POST", "account/password", {"new_password": "x", "auth": _password_auth("old-pw", session, user="bob")}, token=current
        )
        assert (someone_else.status, someone_else.errcode) == (403, "M_FORBIDDEN")  # another user: refused outright
        done = await client.request(
            "POST", "account/password", {"new_password": "new-pw", "auth": _password_auth("old-pw", session)}, token=current
        )
        assert done.status == 200 and done.body == {}

        assert (await client.request("GET", "account/whoami", token=current)).status == 200
        assert (await client.request("GET", "account/whoami", token=other)).status == 401
        assert (await client.login("alice", "old-pw")).status == 403
        kept = (await client.login("alice", "new-pw", device_id="KEPT")).body["access_token"]

        keep = await client.request(
            "POST",
            "account/password",
            {"new_password": "newer", "logout_devices": False, "auth": _password_auth("new-pw")},
            token=current,
        )
        assert keep.status == 200
        assert (await client.request("GET", "account/whoami", token=kept)).status == 200

        no_token = await client.request("POST", "account/password", {"new_password": "x"})
        assert (no_token.status, no_token.errcode) == (401, "M_MISSING_TOKEN")
        no_password = await client.request("POST", "account/password", {"auth": _password_auth("newer")}, token=current)
        assert (no_password.status, no_password.errcode) == (400, "M_MISSING_PARAM")


async def test_devices(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        token = (await client.register_ok("alice", device_id="ONE"))["access_token"]
        two = (await client.login("alice", device_id="TWO")).body["access_token"]
        three = (await client.login("alice", device_id="THREE")).body["access_token"]
        listed = await client.request("GET", "devices", token=token)
        assert sorted(d["device_id"] for d in listed.body["devices"]) == ["ONE", "THREE", "TWO"]
        assert set(listed.body["devices"][0]) == {"device_id", "display_name", "last_seen_ip", "last_seen_ts"}

        assert (await client.request("PUT", "devices/TWO", {"display_name": "Tablet"}, token=token)).status == 200
        assert (await client.request("GET", "devices/TWO", token=token)).body["display_name"] == "Tablet"
        assert (await client.request("PUT", "devices/TWO", {}, token=token)).status == 200
        for method, body in [("GET", None), ("PUT", {"display_name": "x"}), ("PUT", {})]:
            unknown = await client.request(method, "devices/NOPE", body, token=token)
            assert (unknown.status, unknown.errcode) == (404, "M_NOT_FOUND")
        long_name = await client.request("PUT", "devices/TWO", {"display_name": "x" * 101}, token=token)
        assert (long_name.status, long_name.errcode) == (400, "M_INVALID_PARAM")

        # Another user's device is not Alice's to delete: 404 before any UIA, and it stays.
        bob = (await client.register_ok("bob", device_id="BOBDEV"))["access_token"]
        for body in (None, {"auth": _password_auth()}):
            theirs = await client.request("DELETE", "devices/BOBDEV", body, token=token)
            assert (theirs.status, theirs.errcode) == (404, "M_NOT_FOUND")
        assert (await client.request("DELETE", "devices/NOPE", token=token)).status == 404
        # UIA as the device's owner: Bob's (right) password does not delete Alice's device; the
        # request is refused with 403, as SyTest's "DELETE /device/{deviceId} requires UI auth
        # user to match device owner" and Synapse have it.
        as_bob = await client.request("DELETE", "devices/TWO", {"auth": _password_auth(user="bob")}, token=token)
        assert as_bob.status == 403 and as_bob.errcode == "M_FORBIDDEN"
        assert (await client.request("GET", "devices/TWO", token=token)).status == 200
        assert (await client.request("GET", "account/whoami", token=two)).status == 200
        assert (await client.request("GET", "account/whoami", token=bob)).status == 200

        first = await client.request("DELETE", "devices/TWO", token=token)  # no body at all
        assert first.status == 401 and first.body["flows"] == [{"stages": ["m.login.password"]}]
        session = first.body["session"]
        # The approval for TWO cannot delete THREE.
        elsewhere = await client.request("DELETE", "devices/THREE", {"auth": _password_auth(session=session)}, token=token)
        assert (elsewhere.status, elsewhere.errcode) == (403, "M_FORBIDDEN")
        deleted = await client.request("DELETE", "devices/TWO", {"auth": _password_auth(session=session)}, token=token)
        assert deleted.status == 200
        assert (await client.request("GET", "account/whoami", token=two)).status == 401
        assert (await client.request("GET", "devices/TWO", token=token)).status == 404

        bulk_first = await client.request("POST", "delete_devices", {"devices": ["THREE", "GHOST"]}, token=token)
        assert bulk_first.status == 401
        bulk = await client.request(
            "POST", "delete_devices", {"devices": ["THREE", "GHOST"], "auth": _password_auth()}, token=token
        )
        assert bulk.status == 200
        assert (await client.request("GET", "account/whoami", token=three)).status == 401
        remaining = await client.request("GET", "devices", token=token)
        assert [d["device_id"] for d in remaining.body["devices"]] == ["ONE"]
        bad = await client.request("POST", "delete_devices", {"devices": "THREE"}, token=token)
        assert (bad.status, bad.errcode) == (400, "M_BAD_JSON")


async def test_profiles(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (hs, client):
        assert hs.process.accounts is not None
        changes: list[tuple[str, ProfileRow]] = []

        async def hook(requester: Requester, profile: ProfileRow) -> None:
            changes.append((requester.user_id, profile))

        hs.process.accounts.profiles.profile_changed_hooks.append(hook)
        token = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]

        assert (await client.request("GET", f"profile/{ALICE}")).body == {"displayname": "alice"}
        assert (await client.request("PUT", f"profile/{ALICE}/displayname", {"displayname": "Alice ✓"}, token=token)).status == 200
        assert (await client.request("PUT", f"profile/{ALICE}/avatar_url", {"avatar_url": "mxc://hs/abc"}, token=token)).status == 200
        assert (await client.request("GET", f"profile/{ALICE}")).body == {"displayname": "Alice ✓", "avatar_url": "mxc://hs/abc"}
        assert (await client.request("GET", f"profile/{ALICE}/displayname")).body == {"displayname": "Alice ✓"}
        assert (await client.request("GET", f"/_matrix/client/r0/profile/{ALICE}/avatar_url")).body == {"avatar_url": "mxc://hs/abc"}
        assert [user for user, _ in changes] == [ALICE, ALICE]
        assert changes[-1][1] == ProfileRow(ALICE, "Alice ✓", "mxc://hs/abc")

        assert (await client.request("PUT", f"profile/{ALICE}/displayname", {"displayname": ""}, token=token)).status == 200
        # The spec does not require mxc:// (as Synapse, any string within the length limit).
        assert (await client.request("PUT", f"profile/{ALICE}/avatar_url", {"avatar_url": "https://example.org/a.png"}, token=token)).status == 200
        assert (await client.request("GET", f"profile/{ALICE}/avatar_url")).body == {"avatar_url": "https://example.org/a.png"}
        assert (await client.request("GET", f"profile/{ALICE}/displayname")).body == {}

        cases = [
            ("PUT", f"profile/{ALICE}/displayname", {"displayname": "Mallory"}, bob, 403, "M_FORBIDDEN"),
            ("PUT", f"profile/{ALICE}/displayname", {"displayname": "x"}, None, 401, "M_MISSING_TOKEN"),
            ("PUT", f"profile/{ALICE}/displayname", {"displayname": 5}, token, 400, "M_BAD_JSON"),
            ("PUT", f"profile/{ALICE}/displayname", {}, token, 400, "M_MISSING_PARAM"),
            ("PUT", f"profile/{ALICE}/displayname", {"displayname": "x" * 300}, token, 400, "M_INVALID_PARAM"),
            ("PUT", f"profile/{ALICE}/avatar_url", {"avatar_url": "x" * 1001}, token, 400, "M_INVALID_PARAM"),
            ("PUT", f"profile/{ALICE}/avatar_url", {"avatar_url": 5}, token, 400, "M_BAD_JSON"),
            ("GET", f"profile/@nobody:{SERVER_NAME}", None, None, 404, "M_NOT_FOUND"),
            # A remote user's profile is asked of its server, which cannot be reached here (the
            # address is in the outbound IP blacklist): 502, as Synapse answers.
            ("GET", "profile/@someone:203.0.113.1/displayname", None, None, 502, "M_UNKNOWN"),
            ("GET", "profile/not-a-user-id", None, None, 400, "M_INVALID_PARAM"),
            ("GET", f"profile/{ALICE}/email", None, None, 404, "M_UNRECOGNIZED"),
        ]
        for method, path, body, who, status, errcode in cases:
            response = await client.request(method, path, body, token=who)
            assert (response.status, response.errcode) == (status, errcode), (method, path, body)


async def test_account_data(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (hs, client):
        assert hs.process.accounts is not None
        writes: list[tuple[str, str | None, str, int]] = []

        async def hook(user_id: str, room_id: str | None, data_type: str, stream_id: int) -> None:
            writes.append((user_id, room_id, data_type, stream_id))

        hs.process.accounts.account_data.account_data_changed_hooks.append(hook)
        token = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        direct = {f"@bob:{SERVER_NAME}": ["!room:test.local"], "nested": {"ü": [1, 2.5, None]}}
        path = f"user/{ALICE}/account_data/m.direct"
        room_path = f"user/{ALICE}/rooms/!room:test.local/account_data/m.tag"

        assert (await client.request("GET", path, token=token)).status == 404
        assert (await client.request("PUT", path, direct, token=token)).status == 200
        assert (await client.request("GET", path, token=token)).body == direct
        assert (await client.request("PUT", path, {"v": 2}, token=token)).status == 200
        assert (await client.request("GET", path, token=token)).body == {"v": 2}
        assert (await client.request("PUT", room_path, {"tags": {"u.work": {}}}, token=token)).status == 200
        assert (await client.request("GET", room_path, token=token)).body == {"tags": {"u.work": {}}}
        assert (await client.request("GET", f"user/{ALICE}/rooms/!other:test.local/account_data/m.tag", token=token)).status == 404
        assert [w[:3] for w in writes] == [(ALICE, None, "m.direct"), (ALICE, None, "m.direct"), (ALICE, "!room:test.local", "m.tag")]
        assert [w[3] for w in writes] == sorted({w[3] for w in writes})

        cases = [
            ("GET", path, None, bob, 403, "M_FORBIDDEN"),
            ("PUT", path, {"a": 1}, bob, 403, "M_FORBIDDEN"),
            ("PUT", f"user/{ALICE}/account_data/m.push_rules", {}, token, 405, "M_BAD_JSON"),
            ("PUT", f"user/{ALICE}/rooms/!room:test.local/account_data/m.fully_read", {}, token, 405, "M_BAD_JSON"),
            ("PUT", f"user/{ALICE}/rooms/not-a-room/account_data/m.tag", {}, token, 400, "M_INVALID_PARAM"),
            ("GET", f"user/{ALICE}/rooms/not-a-room/account_data/m.tag", None, token, 400, "M_INVALID_PARAM"),
            ("PUT", path, [1, 2], token, 400, "M_BAD_JSON"),
            ("PUT", path, None, token, 400, "M_NOT_JSON"),
            ("GET", path, None, None, 401, "M_MISSING_TOKEN"),
        ]
        for method, p, body, who, status, errcode in cases:
            response = await client.request(method, p, body, token=who)
            assert (response.status, response.errcode) == (status, errcode), (method, p, body)
        surrogate = await client.request("PUT", path, raw=b'{"s": "\\ud800"}', token=token)
        assert (surrogate.status, surrogate.errcode) == (400, "M_BAD_JSON")


async def test_filters(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path) as (_, client):
        token = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        definition = {"room": {"timeline": {"limit": 10}, "state": {"lazy_load_members": True}}, "presence": {"types": []}}
        created = await client.request("POST", f"user/{ALICE}/filter", definition, token=token)
        assert created.status == 200 and isinstance(created.body["filter_id"], str)
        assert not created.body["filter_id"].startswith("{")
        filter_id = created.body["filter_id"]
        again = await client.request("POST", f"user/{ALICE}/filter", definition, token=token)
        assert again.body["filter_id"] == filter_id
        fetched = await client.request("GET", f"user/{ALICE}/filter/{filter_id}", token=token)
        assert fetched.status == 200 and fetched.body == definition

        cases = [
            ("GET", f"user/{ALICE}/filter/{filter_id}", None, bob, 403, "M_FORBIDDEN"),
            ("GET", f"user/{BOB}/filter/{filter_id}", None, bob, 404, "M_NOT_FOUND"),
            ("GET", f"user/{ALICE}/filter/999999", None, token, 404, "M_NOT_FOUND"),
            ("GET", f"user/{ALICE}/filter/abc", None, token, 404, "M_NOT_FOUND"),
            ("POST", f"user/{BOB}/filter", {}, token, 403, "M_FORBIDDEN"),
            ("POST", f"user/{ALICE}/filter", ["not", "an", "object"], token, 400, "M_BAD_JSON"),
            ("POST", f"user/{ALICE}/filter", {"room": {"timeline": {"limit": "ten"}}}, token, 400, "M_BAD_JSON"),
        ]
        for method, p, body, who, status, errcode in cases:
            response = await client.request(method, p, body, token=who)
            assert (response.status, response.errcode) == (status, errcode), (method, p, body)


async def test_push_rules_and_capabilities(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, default_room_version=11) as (_, client):
        token = (await client.register_ok("alice"))["access_token"]
        rules = await client.request("GET", "pushrules/", token=token)
        # "device": {} as Synapse (SyTest expects the key; the spec has only global rules).
        assert rules.status == 200 and list(rules.body) == ["global", "device"] and rules.body["device"] == {}
        assert rules.body["global"]["content"][0]["pattern"] == "alice"
        assert (await client.request("GET", "/_matrix/client/r0/pushrules/global/", token=token)).body == rules.body["global"]
        assert (await client.request("GET", "pushrules/")).status == 401
        caps = await client.request("GET", "capabilities", token=token)
        assert caps.body["capabilities"]["m.room_versions"]["default"] == "11"
        assert caps.body["capabilities"]["m.change_password"] == {"enabled": True}


async def test_rate_limits(database_dsn: str, tmp_path: Path) -> None:
    limits = {
        "rc_registration": {"per_second": 0.001, "burst_count": 2},
        "rc_login": {
            "address": {"per_second": 1000, "burst_count": 1000},
            "account": {"per_second": 0.001, "burst_count": 4},
            "failed_attempts": {"per_second": 0.001, "burst_count": 2},
        },
    }
    async with running_server(database_dsn, tmp_path, **limits) as (_, client):
        # The 401 round of user-interactive auth is not counted; registrations are.
        assert (await client.request("POST", "register", {"username": "x1"})).status == 401
        await client.register_ok("alice")
        await client.register_ok("bob")
        limited = await client.register("carol")
        assert (limited.status, limited.errcode) == (429, "M_LIMIT_EXCEEDED")
        assert limited.body["retry_after_ms"] > 0

        assert (await client.login("alice")).status == 200
        assert (await client.login("alice", "wrong")).status == 403
        assert (await client.login("alice", "wrong")).status == 403
        # Two failures used the failed-attempts burst: even the right password waits now.
        locked = await client.login("alice")
        assert (locked.status, locked.errcode) == (429, "M_LIMIT_EXCEEDED")
        assert (await client.login("bob")).status == 200  # other accounts are not affected
        # The per-account limit counts every attempt (alice has made 4).
        assert (await client.login("alice")).status == 429


async def test_account_deactivation(database_dsn: str, tmp_path: Path) -> None:
    """POST /account/deactivate (UIA as the user): tokens and devices go, the user leaves the
    rooms they are joined or invited to, the profile is erased, login answers 403
    M_USER_DEACTIVATED and the user ID cannot be registered again."""
    async with running_server(database_dsn, tmp_path) as (_, client):
        alice = (await client.register_ok("alice", device_id="ONE"))["access_token"]
        other_device = (await client.login("alice", device_id="TWO")).body["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        avatar = await client.request("PUT", f"profile/{quote(ALICE)}/avatar_url", {"avatar_url": "mxc://x/y"}, token=alice)
        assert avatar.status == 200
        joined = (await client.request("POST", "createRoom", {"preset": "public_chat"}, token=bob)).body["room_id"]
        assert (await client.request("POST", f"join/{quote(joined)}", {}, token=alice)).status == 200
        invited = (await client.request("POST", "createRoom", {"invite": [ALICE]}, token=bob)).body["room_id"]

        # Bad input and incomplete auth change nothing.
        bad = await client.request("POST", "account/deactivate", {"erase": "yes", "auth": _password_auth()}, token=alice)
        assert (bad.status, bad.errcode) == (400, "M_BAD_JSON")
        first = await client.request("POST", "account/deactivate", {}, token=alice)
        assert first.status == 401 and first.body["flows"] == [{"stages": ["m.login.password"]}]
        as_bob = await client.request("POST", "account/deactivate", {"auth": _password_auth(user="bob")}, token=alice)
        assert as_bob.status == 403 and as_bob.errcode == "M_FORBIDDEN"
        wrong = await client.request("POST", "account/deactivate", {"auth": _password_auth("nope")}, token=alice)
        assert wrong.status == 401 and wrong.errcode == "M_FORBIDDEN"
        assert (await client.request("GET", "account/whoami", token=alice)).status == 200
        unauthenticated = await client.request("POST", "account/deactivate", {"auth": _password_auth()})
        assert (unauthenticated.status, unauthenticated.errcode) == (401, "M_MISSING_TOKEN")

        done = await client.request(
            "POST", "account/deactivate", {"auth": _password_auth(session=first.body["session"]), "erase": True}, token=alice
        )
        assert done.status == 200 and done.body == {"id_server_unbind_result": "no-support"}, done

        for token in (alice, other_device):
            gone = await client.request("GET", "account/whoami", token=token)
            assert (gone.status, gone.errcode) == (401, "M_UNKNOWN_TOKEN")
        for room_id in (joined, invited):
            member = await client.request("GET", f"rooms/{quote(room_id)}/state/m.room.member/{quote(ALICE)}", token=bob)
            assert member.status == 200 and member.body["membership"] == "leave", (room_id, member)
        profile = await client.request("GET", f"profile/{quote(ALICE)}", token=bob)
        assert profile.status == 200 and "displayname" not in profile.body and "avatar_url" not in profile.body

        login = await client.login("alice")
        assert (login.status, login.errcode) == (403, "M_USER_DEACTIVATED")
        wrong_login = await client.login("alice", "nope")
        assert (wrong_login.status, wrong_login.errcode) == (403, "M_FORBIDDEN")
        again = await client.register("alice")
        assert (again.status, again.errcode) == (400, "M_USER_IN_USE")
        # Bob is untouched.
        assert (await client.request("GET", "account/whoami", token=bob)).status == 200
