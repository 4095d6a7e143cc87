"""The admin API (homeserver/admin/), driven as the reference server's tools drive it: the paths,
request bodies and response shapes of its admin API documentation, against a real
``tributary run`` process whose first admin was made with ``tributary register-user``."""

# tests: homeserver/admin/servlets.py, homeserver/admin/accounts.py, homeserver/admin/tasks.py, storage/stores/admin.py

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg2
import pytest
import yaml

from homeserver.admin.servlets import shared_secret_mac
from tests.federation_peer import Behaviour, FederationPeer
from tests.harness import REPO_ROOT
from tests.integration.test_client_support import Client, running_server
from tests.integration.test_federation_peer import Tributary, running_tributary
from twisted.internet import task

from tests.twisted_plugin import reactor

SECRET = "a shared secret for the tests"
# The tests poll the admin API (deletion status, backoff) faster than an operator would.
GENEROUS = {"per_second": 1000, "burst_count": 1000}
ADMIN_PASSWORD = "the admin's passphrase"


@pytest.fixture(scope="module")
def tributary(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tributary]:
    with running_tributary(postgres_template, tmp_path_factory.mktemp("admin"),
                           registration_shared_secret=SECRET, log_level="INFO", rc_admin=GENEROUS,
                           server_notices={"system_mxid_localpart": "notices",
                                           "system_mxid_display_name": "Server Notices"}) as running:
        yield running


@pytest.fixture(scope="module")
def admin_token(tributary: Tributary) -> str:
    """The first admin, made with the CLI (the documented way), then logged in over the client API."""
    created = subprocess.run(
        [sys.executable, "-m", "homeserver.cli", "register-user", "--config", str(tributary.process.config_path),
         "--user", "root", "--admin"], input=ADMIN_PASSWORD + "\n", capture_output=True, text=True, cwd=REPO_ROOT,
        timeout=60)
    assert created.returncode == 0, created.stderr
    from tests.twisted_plugin import run_sync

    login = run_sync(tributary.client.login("root", ADMIN_PASSWORD))
    assert login.status == 200, login
    token: str = login.body["access_token"]
    return token


async def pause() -> None:
    await task.deferLater(reactor, 0.05, lambda: None)


def admin_path(path: str) -> str:
    return "/_synapse/admin" + path


async def test_admin_only_audited_and_hostile_input_answered(tributary: Tributary, admin_token: str) -> None:
    """Only admins get in (401 without a token, 403 for a user); bad sort orders, directions,
    paging and remote users get Matrix errors, never a 500; a malformed body is audited as its
    400 whether the handler or the gate parsed it."""
    client = tributary.client
    user = await client.register_ok("plainuser")
    no_token = await client.request("GET", admin_path("/v2/users"))
    assert no_token.status == 401 and no_token.errcode == "M_MISSING_TOKEN"
    refused = await client.request("GET", admin_path("/v2/users"), token=user["access_token"])
    assert refused.status == 403 and refused.errcode == "M_FORBIDDEN"
    for path in ("/v2/users?order_by=password_hash", "/v2/users?dir=sideways", "/v2/users?from=abc",
                 "/v1/rooms?order_by=1;DROP", "/v1/federation/destinations?order_by=x",
                 "/v2/users?guests=maybe", "/v1/rooms?search_term=" + "x" * 300):
        answer = await client.request("GET", admin_path(path), token=admin_token)
        assert answer.status == 400 and answer.errcode == "M_INVALID_PARAM", (path, answer)
    remote = await client.request("GET", admin_path("/v2/users/@someone:elsewhere.example"), token=admin_token)
    assert remote.status == 400 and remote.errcode == "M_UNKNOWN"
    missing = await client.request("GET", admin_path(f"/v2/users/@nobody:{tributary.server_name}"),
                                   token=admin_token)
    assert missing.status == 404 and missing.errcode == "M_NOT_FOUND"
    bad_id = await client.request("GET", admin_path("/v2/users/not-a-user-id"), token=admin_token)
    assert bad_id.status == 400
    not_json = await client.request("PUT", admin_path(f"/v1/users/{quote(user['user_id'])}/admin"),
                                    raw=b"{nope", token=admin_token)
    assert not_json.status == 400 and not_json.errcode == "M_NOT_JSON"
    # The gate parses this route's body (Body.OBJECT): its 400 is audited all the same.
    gate_not_json = await client.request("PUT", admin_path("/v1/rooms/!someroom:hs.example/block"), raw=b"{nope",
                                         token=admin_token)
    assert gate_not_json.status == 400 and gate_not_json.errcode == "M_NOT_JSON"
    demote = await client.request("PUT", admin_path(f"/v1/users/@root:{quote(tributary.server_name)}/admin"),
                                  {"admin": False}, token=admin_token)
    assert demote.status == 400
    log = tributary.process.log_path.read_text()
    assert f"[@root:{tributary.server_name}] GET /_synapse/admin/v2/users" in log
    assert f"[{user['user_id']}] refused (not an admin)" in log
    assert f"[@root:{tributary.server_name}] PUT /_synapse/admin/v1/rooms/!someroom:hs.example/block -> 400" in log


async def test_users_list_query_modify_deactivate(tributary: Tributary, admin_token: str) -> None:
    """List users (the reference shape, paged with next_token), create one with PUT v2 (201),
    modify it (200), reset a password, grant admin, list devices and joined rooms, whois. Then
    deactivate a user: their token stops working and they leave their rooms."""
    client = tributary.client
    server = tributary.server_name
    alice = await client.register_ok("alice")
    bob = await client.register_ok("bob")
    room = await client.request("POST", "createRoom", {"preset": "public_chat", "name": "Lobby"},
                                token=alice["access_token"])
    room_id = room.body["room_id"]
    joined = await client.request("POST", f"rooms/{quote(room_id)}/join", {}, token=bob["access_token"])
    assert joined.status == 200, joined

    page = await client.request("GET", admin_path("/v2/users?limit=2&order_by=name"), token=admin_token)
    assert page.status == 200, page
    assert len(page.body["users"]) == 2 and page.body["total"] >= 3 and page.body["next_token"] == "2"
    first = page.body["users"][0]
    assert set(first) >= {"name", "is_guest", "admin", "deactivated", "displayname", "avatar_url", "creation_ts",
                          "user_type", "shadow_banned"}
    everyone = await client.request("GET", admin_path("/v2/users?limit=100"), token=admin_token)
    names = [u["name"] for u in everyone.body["users"]]
    assert names == sorted(names) and f"@root:{server}" in names and bob["user_id"] in names
    searched = await client.request("GET", admin_path("/v2/users?name=ali"), token=admin_token)
    assert [u["name"] for u in searched.body["users"]] == [alice["user_id"]]
    admins = await client.request("GET", admin_path("/v2/users?admins=true"), token=admin_token)
    assert [u["name"] for u in admins.body["users"]] == [f"@root:{server}"]

    carol_id = f"@carol:{server}"
    created = await client.request("PUT", admin_path(f"/v2/users/{quote(carol_id)}"),
                                   {"password": "carol-pw", "displayname": "Carol", "admin": False},
                                   token=admin_token)
    assert created.status == 201, created
    assert created.body["name"] == carol_id and created.body["displayname"] == "Carol"
    login = await client.login("carol", "carol-pw")
    assert login.status == 200
    modified = await client.request("PUT", admin_path(f"/v2/users/{quote(carol_id)}"),
                                    {"displayname": "Carol C."}, token=admin_token)
    assert modified.status == 200 and modified.body["displayname"] == "Carol C."
    reset = await client.request("POST", admin_path(f"/v1/reset_password/{quote(carol_id)}"),
                                 {"new_password": "new-carol-pw", "logout_devices": True}, token=admin_token)
    assert reset.status == 200 and reset.body == {}
    old_token = await client.request("GET", "account/whoami", token=login.body["access_token"])
    assert old_token.status == 401
    assert (await client.login("carol", "new-carol-pw")).status == 200
    granted = await client.request("PUT", admin_path(f"/v1/users/{quote(carol_id)}/admin"), {"admin": True},
                                   token=admin_token)
    assert granted.status == 200
    flag = await client.request("GET", admin_path(f"/v1/users/{quote(carol_id)}/admin"), token=admin_token)
    assert flag.body == {"admin": True}

    devices = await client.request("GET", admin_path(f"/v2/users/{quote(bob['user_id'])}/devices"),
                                   token=admin_token)
    assert devices.body["total"] == 1 and devices.body["devices"][0]["device_id"] == bob["device_id"]
    rooms = await client.request("GET", admin_path(f"/v1/users/{quote(bob['user_id'])}/joined_rooms"),
                                 token=admin_token)
    assert rooms.body == {"joined_rooms": [room_id], "total": 1}
    whois = await client.request("GET", f"admin/whois/{quote(bob['user_id'])}", token=admin_token)
    assert whois.status == 200 and whois.body["user_id"] == bob["user_id"]
    assert bob["device_id"] in whois.body["devices"]

    deactivated = await client.request("POST", admin_path(f"/v1/deactivate/{quote(bob['user_id'])}"),
                                       {"erase": True}, token=admin_token)
    assert deactivated.status == 200 and deactivated.body == {"id_server_unbind_result": "success"}
    gone = await client.request("GET", "account/whoami", token=bob["access_token"])
    assert gone.status == 401 and gone.errcode == "M_UNKNOWN_TOKEN"
    members = await client.request("GET", admin_path(f"/v1/rooms/{quote(room_id)}/members"), token=admin_token)
    assert members.body == {"members": [alice["user_id"]], "total": 1}
    shown = await client.request("GET", admin_path(f"/v2/users/{quote(bob['user_id'])}"), token=admin_token)
    assert shown.body["deactivated"] is True and shown.body["erased"] is True
    hidden = await client.request("GET", admin_path("/v2/users?limit=100"), token=admin_token)
    assert bob["user_id"] not in [u["name"] for u in hidden.body["users"]]


async def test_rooms_list_details_state_and_delete_with_purge_and_block(tributary: Tributary,
                                                                         admin_token: str) -> None:
    """List rooms (search, order), details, state; delete one (v2, with purge and block): its
    local members are made to leave, it disappears from the list, nobody can join it again."""
    client = tributary.client
    dave = await client.register_ok("dave")
    erin = await client.register_ok("erin")
    created = await client.request("POST", "createRoom", {"preset": "public_chat", "name": "Doomed room"},
                                   token=dave["access_token"])
    room_id = created.body["room_id"]
    await client.request("POST", f"rooms/{quote(room_id)}/join", {}, token=erin["access_token"])
    other = await client.request("POST", "createRoom", {"name": "Another"}, token=dave["access_token"])

    found = await client.request("GET", admin_path("/v1/rooms?search_term=doomed"), token=admin_token)
    assert found.status == 200, found
    assert [r["room_id"] for r in found.body["rooms"]] == [room_id] and found.body["total_rooms"] == 1
    summary = found.body["rooms"][0]
    assert summary["name"] == "Doomed room" and summary["joined_members"] == 2
    assert summary["joined_local_members"] == 2 and summary["public"] is False
    assert summary["join_rules"] == "public" and summary["creator"] == dave["user_id"]
    by_members = await client.request("GET", admin_path("/v1/rooms?order_by=joined_members&dir=b&limit=100"),
                                      token=admin_token)
    counts = [r["joined_members"] for r in by_members.body["rooms"]]
    assert counts == sorted(counts, reverse=True)
    details = await client.request("GET", admin_path(f"/v1/rooms/{quote(room_id)}"), token=admin_token)
    assert details.status == 200 and details.body["room_id"] == room_id and "topic" in details.body
    state = await client.request("GET", admin_path(f"/v1/rooms/{quote(room_id)}/state"), token=admin_token)
    assert {e["type"] for e in state.body["state"]} >= {"m.room.create", "m.room.member", "m.room.name"}

    deleting = await client.request("DELETE", admin_path(f"/v2/rooms/{quote(room_id)}"),
                                    {"block": True, "purge": True}, token=admin_token)
    assert deleting.status == 200, deleting
    delete_id = deleting.body["delete_id"]

    async def finished() -> Any:
        status = await client.request("GET", admin_path(f"/v2/rooms/delete_status/{delete_id}"), token=admin_token)
        return status.body if status.body.get("status") == "complete" else None

    status = None
    for _ in range(200):
        status = await finished()
        if status:
            break
        await pause()
    assert status is not None, "the room deletion did not complete"
    assert sorted(status["shutdown_room"]["kicked_users"]) == sorted([dave["user_id"], erin["user_id"]])
    by_room = await client.request("GET", admin_path(f"/v2/rooms/{quote(room_id)}/delete_status"), token=admin_token)
    assert by_room.body["results"][0]["delete_id"] == delete_id
    tasks = await client.request("GET", admin_path("/v1/scheduled_tasks"), token=admin_token)
    assert any(t["id"] == delete_id and t["status"] == "complete" for t in tasks.body["scheduled_tasks"])

    listed = await client.request("GET", admin_path("/v1/rooms?limit=100"), token=admin_token)
    assert room_id not in [r["room_id"] for r in listed.body["rooms"]]
    assert other.body["room_id"] in [r["room_id"] for r in listed.body["rooms"]]
    gone = await client.request("GET", admin_path(f"/v1/rooms/{quote(room_id)}"), token=admin_token)
    assert gone.status == 404
    blocked = await client.request("GET", admin_path(f"/v1/rooms/{quote(room_id)}/block"), token=admin_token)
    assert blocked.body["block"] is True
    rejoin = await client.request("POST", f"join/{quote(room_id)}", {}, token=erin["access_token"])
    assert rejoin.status == 403, rejoin
    joined = await client.request("GET", "joined_rooms", token=erin["access_token"])
    assert room_id not in joined.body["joined_rooms"]


async def test_destination_backoff_reset_makes_the_sender_retry_at_once(tributary: Tributary,
                                                                        admin_token: str) -> None:
    """A remote server joins a room; it then fails a transaction (500), so Tributary backs off
    from it (minutes). The admin API lists the destination in backoff; after a reset the sender
    sends the waiting event at once, without waiting out the backoff."""
    client = tributary.client
    peer = FederationPeer(reactor, request_timeout_seconds=10)
    try:
        (remote,) = await peer.start(1)
        frank = await client.register_ok("frank")
        room = await client.request("POST", "createRoom", {"preset": "public_chat"}, token=frank["access_token"])
        room_id = room.body["room_id"]
        await peer.join(remote, f"@visitor:{remote}", room_id, via=tributary.server_name)
        await peer.set_behaviour(remote, Behaviour.ERROR_500)
        sent = await client.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/t1",
                                    {"msgtype": "m.text", "body": "are you there?"}, token=frank["access_token"])
        event_id = sent.body["event_id"]
        path = admin_path(f"/v1/federation/destinations/{quote(remote)}")

        async def backing_off() -> bool:
            answer = await client.request("GET", path, token=admin_token)
            return answer.status == 200 and answer.body["retry_interval"] > 0

        for _ in range(200):
            if await backing_off():
                break
            await pause()
        details = await client.request("GET", path, token=admin_token)
        assert details.body["retry_interval"] >= 60_000, details
        assert details.body["failure_ts"] is not None
        listed = await client.request("GET", admin_path("/v1/federation/destinations"), token=admin_token)
        assert remote in [d["destination"] for d in listed.body["destinations"]]
        rooms = await client.request("GET", path + "/rooms", token=admin_token)
        assert room_id in [r["room_id"] for r in rooms.body["rooms"]]

        await peer.set_behaviour(remote, Behaviour.OK)
        assert event_id not in peer.received_pdu_ids(remote)
        reset = await client.request("POST", path + "/reset_connection", {}, token=admin_token)
        assert reset.status == 200 and reset.body == {}
        await peer.wait_for_pdus(remote, [event_id], timeout=10)
        after = await client.request("GET", path, token=admin_token)
        assert after.body["retry_interval"] == 0
        unknown = await client.request("POST", admin_path("/v1/federation/destinations/unknown.example/reset_connection"),
                                       {}, token=admin_token)
        assert unknown.status == 404
    finally:
        await peer.stop()


async def test_server_notices_reach_the_user_in_one_room(tributary: Tributary, admin_token: str) -> None:
    """The first notice makes the notices room and invites the user; the user joins and reads it;
    the next notice lands in the same room. Remote and unknown users are refused."""
    client = tributary.client
    gina = await client.register_ok("gina")
    token = gina["access_token"]
    first = await client.request("POST", admin_path("/v1/send_server_notice"), {
        "user_id": gina["user_id"], "content": {"msgtype": "m.text", "body": "maintenance at noon"}},
        token=admin_token)
    assert first.status == 200, first
    synced = await client.request("GET", "sync", token=token)
    invited = list(synced.body["rooms"]["invite"])
    assert len(invited) == 1
    room_id = invited[0]
    assert (await client.request("POST", f"join/{quote(room_id)}", {}, token=token)).status == 200
    event = await client.request("GET", f"rooms/{quote(room_id)}/event/{quote(first.body['event_id'])}", token=token)
    assert event.body["content"]["body"] == "maintenance at noon"
    assert event.body["sender"] == f"@notices:{tributary.server_name}"
    second = await client.request("PUT", admin_path("/v1/send_server_notice/txn1"), {
        "user_id": gina["user_id"], "content": {"msgtype": "m.text", "body": "done"}}, token=admin_token)
    again = await client.request("GET", f"rooms/{quote(room_id)}/event/{quote(second.body['event_id'])}", token=token)
    assert again.status == 200 and again.body["room_id"] == room_id
    speak = await client.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/t1",
                                 {"msgtype": "m.text", "body": "hi"}, token=token)
    assert speak.status == 403
    remote = await client.request("POST", admin_path("/v1/send_server_notice"), {
        "user_id": "@x:elsewhere.example", "content": {}}, token=admin_token)
    assert remote.status == 400
    unknown = await client.request("POST", admin_path("/v1/send_server_notice"), {
        "user_id": f"@nobody:{tributary.server_name}", "content": {}}, token=admin_token)
    assert unknown.status == 404


async def test_shared_secret_registration_as_the_reference_tools_do_it(tributary: Tributary) -> None:
    """GET a nonce, POST with the HMAC-SHA1 of nonce, username, password and admin flag: the
    account exists and can log in; a wrong MAC is 403, a reused nonce 400."""
    client = tributary.client
    nonce = (await client.request("GET", admin_path("/v1/register"))).body["nonce"]
    body = {"nonce": nonce, "username": "scripted", "password": "scripted-pw", "admin": True,
            "mac": shared_secret_mac(SECRET, nonce, "scripted", "scripted-pw", True)}
    made = await client.request("POST", admin_path("/v1/register"), body)
    assert made.status == 200, made
    assert made.body["user_id"] == f"@scripted:{tributary.server_name}" and made.body["access_token"]
    reused = await client.request("POST", admin_path("/v1/register"), body)
    assert reused.status == 400
    nonce = (await client.request("GET", admin_path("/v1/register"))).body["nonce"]
    forged = await client.request("POST", admin_path("/v1/register"), {
        **body, "nonce": nonce, "username": "forged", "mac": shared_secret_mac("wrong", nonce, "forged", "x", True)})
    assert forged.status == 403 and forged.errcode == "M_FORBIDDEN"
    junk = await client.request("POST", admin_path("/v1/register"), {"nonce": 5})
    assert junk.status == 400


async def test_registration_tokens_gate_registration(database_dsn: str, tmp_path: Path) -> None:
    """With ``registration_requires_token`` /register offers only the m.login.registration_token
    stage; a token made with the admin API lets exactly ``uses_allowed`` accounts in."""
    async with running_server(database_dsn, tmp_path, registration_requires_token=True,
                              rc_admin={"per_second": 0.001, "burst_count": 20}) as (hs, client):
        from homeserver.admin.accounts import create_account

        await create_account(hs.process.db, reactor, hs.config, "boss", "boss-pw", admin=True)
        token = (await client.login("boss", "boss-pw")).body["access_token"]
        made = await client.request("POST", admin_path("/v1/registration_tokens/new"), {"uses_allowed": 1},
                                    token=token)
        assert made.status == 200, made
        code = made.body["token"]
        assert made.body == {"token": code, "uses_allowed": 1, "pending": 0, "completed": 0, "expiry_time": None}
        valid = await client.request("GET", f"/_matrix/client/v1/register/m.login.registration_token/validity"
                                            f"?token={code}")
        assert valid.body == {"valid": True}

        first = await client.request("POST", "register", {"username": "newbie", "password": "pw"})
        assert first.status == 401 and first.body["flows"] == [{"stages": ["m.login.registration_token"]}]
        session = first.body["session"]
        dummy = await client.request("POST", "register", {"username": "newbie", "password": "pw",
                                                          "auth": {"type": "m.login.dummy", "session": session}})
        assert dummy.status == 401
        wrong = await client.request("POST", "register", {"username": "newbie", "password": "pw", "auth": {
            "type": "m.login.registration_token", "token": "nope", "session": session}})
        assert wrong.status == 401 and wrong.body["errcode"] == "M_UNAUTHORIZED"
        done = await client.request("POST", "register", {"username": "newbie", "password": "pw", "auth": {
            "type": "m.login.registration_token", "token": code, "session": session}})
        assert done.status == 200, done
        used = await client.request("GET", admin_path(f"/v1/registration_tokens/{code}"), token=token)
        assert used.body["completed"] == 1
        second = await client.request("POST", "register", {"username": "latecomer", "password": "pw"})
        again = await client.request("POST", "register", {"username": "latecomer", "password": "pw", "auth": {
            "type": "m.login.registration_token", "token": code, "session": second.body["session"]}})
        assert again.status == 401 and again.body["errcode"] == "M_UNAUTHORIZED"
        assert (await client.request("GET", "/_matrix/client/v1/register/m.login.registration_token/validity"
                                            f"?token={code}")).body == {"valid": False}

        listed = await client.request("GET", admin_path("/v1/registration_tokens?valid=false"), token=token)
        assert [t["token"] for t in listed.body["registration_tokens"]] == [code]
        changed = await client.request("PUT", admin_path(f"/v1/registration_tokens/{code}"), {"uses_allowed": None},
                                       token=token)
        assert changed.body["uses_allowed"] is None
        bad = await client.request("POST", admin_path("/v1/registration_tokens/new"), {"token": "has space"},
                                   token=token)
        assert bad.status == 400
        deleted = await client.request("DELETE", admin_path(f"/v1/registration_tokens/{code}"), token=token)
        assert deleted.status == 200
        assert (await client.request("GET", admin_path(f"/v1/registration_tokens/{code}"), token=token)).status == 404
        # rc_admin: this admin made about 12 requests of its burst of 20.
        for _ in range(20):
            last = await client.request("GET", admin_path("/v1/registration_tokens"), token=token)
            if last.status == 429:
                break
        assert last.status == 429 and last.errcode == "M_LIMIT_EXCEEDED" and last.body["retry_after_ms"] > 0


async def test_make_room_admin_raises_the_admin_and_invites_them(tributary: Tributary, admin_token: str) -> None:
    """In a private room of someone else, make_room_admin gives the admin power level 100 (its
    creator ranks above every level, so 100 is the top a level can be) through that creator, and
    invites the admin, who can then join and change the room's name."""
    client = tributary.client
    hank = await client.register_ok("hank")
    room = await client.request("POST", "createRoom", {"preset": "private_chat", "name": "Hank's"},
                                token=hank["access_token"])
    room_id = room.body["room_id"]
    made = await client.request("POST", admin_path(f"/v1/rooms/{quote(room_id)}/make_room_admin"), {},
                                token=admin_token)
    assert made.status == 200, made
    root = f"@root:{tributary.server_name}"
    levels = await client.request("GET", f"rooms/{quote(room_id)}/state/m.room.power_levels",
                                  token=hank["access_token"])
    assert levels.body["users"][root] == 100
    assert (await client.request("POST", f"join/{quote(room_id)}", {}, token=admin_token)).status == 200
    renamed = await client.request("PUT", f"rooms/{quote(room_id)}/state/m.room.name", {"name": "Taken over"},
                                   token=admin_token)
    assert renamed.status == 200, renamed
    unknown = await client.request("POST", admin_path("/v1/rooms/!nope:elsewhere.example/make_room_admin"), {},
                                   token=admin_token)
    assert unknown.status in (400, 404)


async def test_purge_history_removes_older_messages_but_keeps_state(tributary: Tributary, admin_token: str) -> None:
    """Five messages; purging up to the fourth (local events included) leaves the fourth and
    fifth in /messages, and the room's state intact; without delete_local_events nothing local
    goes."""
    client = tributary.client
    ivan = await client.register_ok("ivan")
    token = ivan["access_token"]
    room_id = (await client.request("POST", "createRoom", {"name": "History"}, token=token)).body["room_id"]
    sent = []
    for i in range(5):
        answer = await client.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/h{i}",
                                      {"msgtype": "m.text", "body": f"m{i}"}, token=token)
        sent.append(answer.body["event_id"])

    async def bodies() -> list[str]:
        page = await client.request("GET", f"rooms/{quote(room_id)}/messages?dir=b&limit=50", token=token)
        return [e["content"]["body"] for e in page.body["chunk"] if e["type"] == "m.room.message"]

    async def finished(purge_id: str) -> dict[str, Any]:
        for _ in range(200):
            status = await client.request("GET", admin_path(f"/v1/purge_history_status/{purge_id}"),
                                          token=admin_token)
            if status.body["status"] != "active":
                return dict(status.body)
            await pause()
        raise AssertionError("the purge did not finish")

    kept = await client.request("POST", admin_path(f"/v1/purge_history/{quote(room_id)}"),
                                {"purge_up_to_event_id": sent[3]}, token=admin_token)
    assert kept.status == 200, kept
    assert await finished(kept.body["purge_id"]) == {"status": "complete"}
    assert await bodies() == ["m4", "m3", "m2", "m1", "m0"]
    purged = await client.request("POST", admin_path(f"/v1/purge_history/{quote(room_id)}/{quote(sent[3])}"),
                                  {"delete_local_events": True}, token=admin_token)
    assert await finished(purged.body["purge_id"]) == {"status": "complete"}
    assert await bodies() == ["m4", "m3"]
    state = await client.request("GET", f"rooms/{quote(room_id)}/state/m.room.name", token=token)
    assert state.body == {"name": "History"}
    missing = await client.request("POST", admin_path(f"/v1/purge_history/{quote(room_id)}"), {}, token=admin_token)
    assert missing.status == 400 and missing.errcode == "M_MISSING_PARAM"
    elsewhere = await client.request("POST", admin_path(f"/v1/purge_history/{quote(room_id)}"),
                                     {"purge_up_to_event_id": "$notinthisroom"}, token=admin_token)
    assert elsewhere.status == 404


ADMIN_ROUTES = [
    ("GET", "/v2/users"), ("GET", "/v2/users/{user}"), ("PUT", "/v2/users/{user}"),
    ("POST", "/v1/deactivate/{user}"), ("POST", "/v1/reset_password/{user}"), ("GET", "/v1/users/{user}/admin"),
    ("PUT", "/v1/users/{user}/admin"), ("GET", "/v2/users/{user}/devices"), ("GET", "/v2/users/{user}/devices/D"),
    ("PUT", "/v2/users/{user}/devices/D"), ("DELETE", "/v2/users/{user}/devices/D"),
    ("POST", "/v2/users/{user}/delete_devices"), ("GET", "/v1/users/{user}/joined_rooms"), ("GET", "/v1/whois/{user}"),
    ("GET", "/v1/rooms"), ("GET", "/v1/rooms/{room}"), ("DELETE", "/v1/rooms/{room}"), ("DELETE", "/v2/rooms/{room}"),
    ("GET", "/v1/rooms/{room}/members"), ("GET", "/v1/rooms/{room}/state"), ("PUT", "/v1/rooms/{room}/block"),
    ("POST", "/v1/rooms/{room}/make_room_admin"), ("POST", "/v1/purge_history/{room}"),
    ("GET", "/v1/purge_history_status/x"), ("GET", "/v2/rooms/delete_status/x"),
    ("GET", "/v1/federation/destinations"), ("GET", "/v1/federation/destinations/{server}"),
    ("GET", "/v1/federation/destinations/{server}/rooms"),
    ("POST", "/v1/federation/destinations/{server}/reset_connection"),
    ("GET", "/v1/registration_tokens"), ("POST", "/v1/registration_tokens/new"),
    ("GET", "/v1/registration_tokens/{token}"), ("PUT", "/v1/registration_tokens/{token}"),
    ("DELETE", "/v1/registration_tokens/{token}"), ("POST", "/v1/send_server_notice"), ("POST", "/v1/register"),
    ("GET", "/v1/scheduled_tasks"),
]
FIELDS = ["user_id", "password", "new_password", "admin", "deactivated", "displayname", "avatar_url", "devices",
          "display_name", "block", "purge", "force_purge", "new_room_user_id", "erase", "logout_devices", "token",
          "uses_allowed", "expiry_time", "length", "content", "type", "purge_up_to_event_id", "purge_up_to_ts",
          "delete_local_events", "nonce", "username", "mac"]
ODD_VALUES: list[Any] = [None, True, -1, 2**70, 1.5, "", "\x00", "x" * 5000, [], [1, "a"], {}, {"a": {"b": []}}]


async def test_hostile_bodies_and_paths_never_get_a_server_error(tributary: Tributary, admin_token: str) -> None:
    """Every admin route with broken bodies, odd field values and odd path parameters: a Matrix
    error or a success, never a 5xx. (Destructive ones run against rooms and users made here.)"""
    import random

    rng = random.Random(24)
    client = tributary.client
    victim = await client.register_ok("fuzzvictim")
    room = (await client.request("POST", "createRoom", {}, token=victim["access_token"])).body["room_id"]
    odd_params = {"user": [victim["user_id"], "@%00:x", "%F0%28%8C%28", "@" + "u" * 300 + ":x"],
                  "room": [room, "!%00", "not-a-room", "!" + "r" * 300 + ":x"],
                  "server": ["a.example", "%00", "bad server", "x" * 300],
                  "token": ["abc", "%00", "y" * 300]}
    failures = []
    for method, template in ADMIN_ROUTES:
        for attempt in range(4):
            path = template
            for name, values in odd_params.items():
                path = path.replace("{" + name + "}", quote(values[attempt % len(values)], safe="%"))
            bodies: list[Any] = [b"", b"[]", b"{\"a\":", b"\xff\xfe", b"{}"]
            bodies += [{key: rng.choice(ODD_VALUES) for key in rng.sample(FIELDS, 4)} for _ in range(3)]
            for body in bodies:
                raw = body if isinstance(body, bytes) else None
                answer = await client.request(method, admin_path(path), None if raw is not None else body, raw=raw,
                                              token=admin_token)
                if answer.status >= 500 or not isinstance(answer.body, dict):
                    failures.append((method, path, body if raw is None else raw, answer))
    assert failures == []
    # Nor an error in the server's log (a background deletion that failed on a bug, say).
    errors = [line for line in tributary.process.log_path.read_text().splitlines() if " ERROR " in line]
    assert errors == []


async def test_a_deletion_the_process_stopped_under_is_run_again_at_start(tributary: Tributary,
                                                                          admin_token: str) -> None:
    """Tasks are rows of admin_tasks: a room deletion left 'active' by a process that stopped
    mid-way (written here as such a process leaves it) is run again when the server starts, and
    its status is then served as for any other task."""
    client = tributary.client
    judy = await client.register_ok("judy")
    room_id = (await client.request("POST", "createRoom", {"name": "Half deleted"},
                                    token=judy["access_token"])).body["room_id"]
    dsn = yaml.safe_load(tributary.process.config_path.read_text())["database"]["url"]
    params = {"by": "@root:x", "room_id": room_id, "options": {"block": False, "purge": True, "force_purge": False}}
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO admin_tasks (id, action, resource_id, params, status, timestamp_ms) "
                    "VALUES ('left-active', 'shutdown_and_purge_room', %s, %s, 'active', %s)",
                    (room_id, json.dumps(params), int(time.time() * 1000)))
    conn.close()
    assert tributary.process.stop() == 0, tributary.process.output[-3000:]
    tributary.process.start()

    status: dict[str, Any] = {}
    for _ in range(200):
        answer = await client.request("GET", admin_path("/v2/rooms/delete_status/left-active"), token=admin_token)
        assert answer.status == 200, answer
        status = dict(answer.body)
        if status["status"] == "complete":
            break
        await pause()
    assert status["status"] == "complete", status
    assert status["shutdown_room"]["kicked_users"] == [judy["user_id"]]
    gone = await client.request("GET", admin_path(f"/v1/rooms/{quote(room_id)}"), token=admin_token)
    assert gone.status == 404
    listed = await client.request("GET", admin_path("/v1/scheduled_tasks?action_name=shutdown_and_purge_room"),
                                  token=admin_token)
    assert [t["id"] for t in listed.body["scheduled_tasks"]][0] == "left-active", "newest first"
