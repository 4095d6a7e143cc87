"""Push notifications end to end: real PostgreSQL, a real push gateway on loopback.

The gateway is a small Twisted web server in the test speaking the push gateway API
(``POST /_matrix/push/v1/notify``, answering ``{"rejected": [...]}``); it records every
notification it accepts. The homeserver runs in-process: alone (the pusher in the main
process), and as a main process plus a ``pusher`` worker over Redis, whose worker is
stopped and started again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg2
import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from homeserver.app import HomeServer
from homeserver.config import parse_config
from storage.database import Database, Transaction
from storage.stores.events import STALE_ROOM_SQLSTATE
from storage.stores.push import PushStore
from tests.harness import free_port
from tests.integration.test_client_support import GENEROUS, SERVER_NAME, Client, running_server, server_config
from tests.twisted_plugin import reactor

ALICE = f"@alice:{SERVER_NAME}"
BOB = f"@bob:{SERVER_NAME}"
LIMITS: dict[str, Any] = {"rc_message": GENEROUS, "rc_joins": {"local": GENEROUS, "remote": GENEROUS},
                          # The test's gateway listens on loopback, refused by default.
                          "push": {"ip_range_whitelist": ["127.0.0.0/8"]}}


class Gateway(Resource):
    """A push gateway: records what it accepts; rejects ``reject``ed pushkeys; fails ``fail_next`` times."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.received: list[dict[str, Any]] = []
        self.reject: set[str] = set()
        self.fail_next = 0
        self.failed = 0

    def render_POST(self, request: Request) -> bytes:
        assert request.content is not None
        if request.path != b"/_matrix/push/v1/notify":
            request.setResponseCode(404)
            return b"{}"
        body = json.loads(request.content.read())
        if self.fail_next:
            self.fail_next -= 1
            self.failed += 1
            request.setResponseCode(502)
            return b"{}"
        self.received.append(body["notification"])
        pushkeys = [d["pushkey"] for d in body["notification"]["devices"]]
        return json.dumps({"rejected": [k for k in pushkeys if k in self.reject]}).encode()

    def events(self) -> list[str]:
        return [n["event_id"] for n in self.received if "event_id" in n]


@asynccontextmanager
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    resource = Gateway()
    port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
    try:
        yield resource, f"http://127.0.0.1:{port.getHost().port}/_matrix/push/v1/notify"
    finally:
        await port.stopListening()


def _sleep(seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d


async def wait_for(condition: Any, what: str, timeout: float = 15.0) -> None:
    deadline = reactor.seconds() + timeout
    while not condition():
        assert reactor.seconds() < deadline, f"timed out waiting for {what}"
        await _sleep(0.02)


async def _ok(client: Client, method: str, path: str, body: Any = None, *, token: str) -> Any:
    response = await client.request(method, path, body, token=token)
    assert response.status == 200, (method, path, response)
    return response.body


async def _send(client: Client, room_id: str, txn: str, content: dict[str, Any], token: str) -> str:
    path = f"rooms/{room_id}/send/m.room.message/{txn}"
    return str((await _ok(client, "PUT", path, content, token=token))["event_id"])


def _pusher(url: str, pushkey: str, **data: Any) -> dict[str, Any]:
    return {"kind": "http", "app_id": "org.example.app", "pushkey": pushkey, "app_display_name": "App",
            "device_display_name": "Phone", "lang": "en", "data": {"url": url, **data}}


async def test_pushes_counts_badges_mutes_mentions_and_rejected_pushkeys(database_dsn: str, tmp_path: Path) -> None:
    """Bob registers a pusher; Alice's messages reach the gateway once each with Bob's unread
    count (a notice does not); a failing gateway is retried; Bob's read receipt sends a badge
    update of 0; Bob mutes the room with a room rule: a plain message no longer pushes but a
    mention of him does; /notifications lists what was pushed; a rejected pushkey removes
    the pusher."""
    async with gateway() as (gw, url), running_server(database_dsn, tmp_path, **LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        await _ok(client, "POST", "pushers/set", _pusher(url, "bob-phone"), token=bob)
        pushers = (await _ok(client, "GET", "pushers", token=bob))["pushers"]
        assert [(p["pushkey"], p["kind"], p["data"]["url"]) for p in pushers] == [("bob-phone", "http", url)]

        first = await _send(client, room_id, "m1", {"msgtype": "m.text", "body": "hello"}, alice)
        await wait_for(lambda: len(gw.received) >= 1, "the first push")
        await _send(client, room_id, "m2", {"msgtype": "m.notice", "body": "a bot"}, alice)
        gw.fail_next = 1  # the next push fails once, then is retried after a backoff
        second = await _send(client, room_id, "m3", {"msgtype": "m.text", "body": "bob, lunch?"}, alice)
        await wait_for(lambda: len(gw.received) >= 2, "two pushes")
        assert gw.failed == 1
        assert gw.events() == [first, second]
        assert [n["counts"]["unread"] for n in gw.received] == [1, 2]
        assert gw.received[0]["devices"][0]["pushkey"] == "bob-phone"
        assert gw.received[0]["devices"][0]["data"] == {}  # the url is not sent to the gateway
        assert gw.received[0]["type"] == "m.room.message" and gw.received[0]["sender"] == ALICE
        assert gw.received[1]["devices"][0]["tweaks"] == {"sound": "default", "highlight": True}  # his name
        synced = await _ok(client, "GET", "sync", token=bob)
        assert synced["rooms"]["join"][room_id]["unread_notifications"] == {
            "notification_count": 2, "highlight_count": 1}
        # An initial sync carries the push rules, the defaults while Bob has changed none.
        pushed_rules = [e for e in synced["account_data"]["events"] if e["type"] == "m.push_rules"]
        assert pushed_rules[0]["content"]["global"]["override"][0]["rule_id"] == ".m.rule.master"
        listed = await _ok(client, "GET", "notifications", token=bob)
        assert [n["event"]["event_id"] for n in listed["notifications"]] == [second, first]
        assert all(n["room_id"] == room_id and n["read"] is False for n in listed["notifications"])
        only = await _ok(client, "GET", "notifications?only=highlight", token=bob)
        assert [n["event"]["event_id"] for n in only["notifications"]] == [second]
        page = await _ok(client, "GET", "notifications?limit=1", token=bob)
        rest = await _ok(client, "GET", f"notifications?limit=1&from={page['next_token']}", token=bob)
        assert [n["event"]["event_id"] for n in page["notifications"] + rest["notifications"]] == [second, first]

        # A read receipt: a badge-only update with the new count.
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(second)}", {}, token=bob)
        await wait_for(lambda: len(gw.received) >= 3, "the badge update")
        assert "event_id" not in gw.received[2] and gw.received[2]["counts"] == {"unread": 0}
        # Once read, only the highlight is still listed (read, now).
        listed = await _ok(client, "GET", "notifications", token=bob)
        assert [(n["event"]["event_id"], n["read"]) for n in listed["notifications"]] == [(second, True)]

        # Mute the room (a room rule without notify); a mention still pushes (override rule).
        await _ok(client, "PUT", f"pushrules/global/room/{quote(room_id)}", {"actions": []}, token=bob)
        await _send(client, room_id, "m4", {"msgtype": "m.text", "body": "muted"}, alice)
        mention = await _send(client, room_id, "m5", {"msgtype": "m.text", "body": "hey you",
                                                      "m.mentions": {"user_ids": [BOB]}}, alice)
        await wait_for(lambda: len(gw.received) >= 4, "the mention")
        assert gw.events() == [first, second, mention]
        assert gw.received[3]["counts"]["unread"] == 1

        # The gateway rejects the pushkey: the pusher is removed and nothing more is sent.
        gw.reject.add("bob-phone")
        await _send(client, room_id, "m6", {"msgtype": "m.text", "body": "@bob? ping",
                                            "m.mentions": {"user_ids": [BOB]}}, alice)
        await wait_for(lambda: len(gw.received) >= 5, "the rejected push")
        for _ in range(50):
            if not (await _ok(client, "GET", "pushers", token=bob))["pushers"]:
                break
            await _sleep(0.02)
        assert (await _ok(client, "GET", "pushers", token=bob))["pushers"] == []


async def test_a_kept_push_context_is_not_used_once_rules_or_pushers_change(
    database_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A local send evaluates push rules on the room's push context as the room's last send read
    it (docs/push.md). Bob's new pusher, his muting of the room and a change written by
    another process straight into the database each make the next send read the room again, so
    each notifies as it must; the last shows the kept copy was in use (the send is built again)."""
    caplog.set_level(logging.INFO, logger="homeserver.handlers.rooms.room_events")
    async with gateway() as (gw, url), running_server(database_dsn, tmp_path, **LIMITS) as (hs, client):
        alice = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        first = await _send(client, room_id, "m1", {"msgtype": "m.text", "body": "one"}, alice)
        second = await _send(client, room_id, "m2", {"msgtype": "m.text", "body": "two"}, alice)

        # A pusher after the room was read: the next message must reach it (it is noted as
        # notifying a user with an http pusher only if the room is read again).
        await _ok(client, "POST", "pushers/set", _pusher(url, "bob-phone"), token=bob)
        third = await _send(client, room_id, "m3", {"msgtype": "m.text", "body": "three"}, alice)
        await wait_for(lambda: gw.events() == [third], "the push of the message after the pusher was set")

        # Bob mutes the room: the next message notifies nobody, a mention still does.
        await _ok(client, "PUT", f"pushrules/global/room/{quote(room_id)}", {"actions": []}, token=bob)
        quiet = await _send(client, room_id, "m4", {"msgtype": "m.text", "body": "four"}, alice)
        mention = await _send(client, room_id, "m5", {"msgtype": "m.text", "body": "five",
                                                      "m.mentions": {"user_ids": [BOB]}}, alice)
        await wait_for(lambda: len(gw.received) >= 2, "the mention's push")
        assert gw.events() == [third, mention]
        listed = await _ok(client, "GET", "notifications", token=bob)
        assert [n["event"]["event_id"] for n in listed["notifications"]] == [mention, third, second, first]
        assert quiet not in gw.events()

        # Another process changes a pusher (here: straight in the database): the send that finds
        # the version moved is built again on a fresh read, and succeeds.
        caplog.clear()
        await hs.process.db.run_interaction(
            "test_touch_pusher", lambda txn: txn.execute("UPDATE pushers SET kind = kind WHERE user_id = %s", (BOB,)))
        sixth = await _send(client, room_id, "m6", {"msgtype": "m.text", "body": "six",
                                                    "m.mentions": {"user_ids": [BOB]}}, alice)
        assert any("push rules or pushers changed" in r.getMessage() for r in caplog.records), caplog.records
        await wait_for(lambda: gw.events() == [third, mention, sixth], "the push after the rebuilt send")


async def test_push_context_version_moves_with_push_rules_and_pushers_only(database: Database) -> None:
    """``push_context_version`` (0028) moves when a user's m.push_rules or a pusher's owner or
    kind changes, however written, and not for other account data, room-level push rules or a
    pusher's delivery progress; ``push_context_as_expected`` raises TQ001 once it moved."""

    def version() -> Any:
        def read(txn: Transaction) -> int:
            txn.execute("SELECT version FROM push_context_version")
            row = txn.fetchone()
            assert row is not None
            return int(row[0])
        return database.run_interaction("test_version", read)

    async def moves(sql: str, *params: object) -> int:
        before = await version()
        await database.run_interaction("test_write", lambda txn: txn.execute(sql, params))
        return int(await version()) - int(before)

    data = ("INSERT INTO account_data (stream_id, instance_name, user_id, room_id, account_data_type, content) "
            "VALUES (%s, 'master', %s, %s, %s, '{}') ON CONFLICT (user_id, room_id, account_data_type) "
            "DO UPDATE SET stream_id = EXCLUDED.stream_id, content = EXCLUDED.content")
    assert await moves(data, 1, BOB, None, "m.push_rules") == 1  # added
    assert await moves(data, 2, BOB, None, "m.push_rules") == 1  # replaced (the upsert's update)
    assert await moves(data, 3, BOB, None, "m.direct") == 0
    assert await moves(data, 4, BOB, "!room:test", "m.push_rules") == 0
    assert await moves("DELETE FROM account_data WHERE user_id = %s AND account_data_type = 'm.push_rules' "
                       "AND room_id IS NULL", BOB) == 1

    pusher = ("INSERT INTO pushers (user_id, kind, app_id, pushkey, app_display_name, device_display_name, lang, "
              "data, created_ts, last_stream_ordering) VALUES (%s, %s, 'app', %s, 'App', 'Phone', 'en', '{}', 0, 0)")
    assert await moves(pusher, BOB, "http", "k1") == 1
    assert await moves(pusher, ALICE, "email", "k2") == 1
    assert await moves("UPDATE pushers SET last_stream_ordering = 5, failing_since = 7") == 0
    assert await moves("UPDATE pushers SET kind = 'http' WHERE pushkey = 'k2'") == 1
    assert await moves("DELETE FROM pushers WHERE pushkey = 'nothing'") == 0
    assert await moves("DELETE FROM pushers") == 2

    now = await version()
    check = "SELECT push_context_as_expected(%s, %s, (SELECT version FROM push_context_version))"
    for expected in (now, None):  # None: no kept copy to check
        await database.run_interaction("test_check", lambda txn: txn.execute(check, ("!room:test", expected)))
    with pytest.raises(psycopg2.Error) as raised:
        await database.run_interaction("test_check", lambda txn: txn.execute(check, ("!room:test", now - 1)))
    assert raised.value.pgcode == STALE_ROOM_SQLSTATE
    assert "push rules or pushers changed" in str(raised.value)


async def test_push_rules_api(database_dsn: str, tmp_path: Path) -> None:
    """Rules are read, added in order (before/after), enabled, given actions and deleted; the
    defaults are there and cannot be replaced or deleted; bad rules are 400, unknown ones 404;
    the result is the m.push_rules account data event."""
    async with running_server(database_dsn, tmp_path, **LIMITS) as (hs, client):
        bob = (await client.register_ok("bob"))["access_token"]
        everything = await _ok(client, "GET", "pushrules/", token=bob)
        assert everything["device"] == {}
        rules = everything["global"]
        assert rules["override"][0]["rule_id"] == ".m.rule.master"
        assert ".m.rule.is_user_mention" in [r["rule_id"] for r in rules["override"]]
        base = "pushrules/global"
        await _ok(client, "PUT", f"{base}/override/a", {"actions": ["notify"], "conditions": [
            {"kind": "event_match", "key": "type", "pattern": "m.x"}]}, token=bob)
        await _ok(client, "PUT", f"{base}/override/b?before=a", {"actions": [], "conditions": []}, token=bob)
        await _ok(client, "PUT", f"{base}/override/c?after=a", {"actions": [], "conditions": []}, token=bob)
        ids = [r["rule_id"] for r in (await _ok(client, "GET", f"{base}/", token=bob))["override"]]
        assert ids[:4] == [".m.rule.master", "b", "a", "c"]
        assert (await _ok(client, "GET", f"{base}/override/a", token=bob))["conditions"] == [
            {"kind": "event_match", "key": "type", "pattern": "m.x"}]
        await _ok(client, "PUT", f"{base}/override/a/enabled", {"enabled": False}, token=bob)
        assert await _ok(client, "GET", f"{base}/override/a/enabled", token=bob) == {"enabled": False}
        await _ok(client, "PUT", f"{base}/underride/.m.rule.message/actions", {"actions": []}, token=bob)
        assert await _ok(client, "GET", f"{base}/underride/.m.rule.message/actions", token=bob) == {"actions": []}
        await _ok(client, "PUT", f"{base}/override/.m.rule.master/enabled", {"enabled": True}, token=bob)
        await _ok(client, "PUT", f"{base}/content/lunch", {"actions": ["notify"], "pattern": "lunch"}, token=bob)
        await _ok(client, "DELETE", f"{base}/override/c", token=bob)
        # Room and sender rules are named by what they match (any ID; an alias simply never matches).
        await _ok(client, "PUT", f"{base}/room/{quote('#spam:example.com')}", {"actions": ["notify"]}, token=bob)
        await _ok(client, "PUT", f"{base}/sender/{quote('@bob:example.com')}", {"actions": []}, token=bob)
        assert [r["rule_id"] for r in await _ok(client, "GET", f"{base}/room/", token=bob)] == ["#spam:example.com"]

        bad = [
            ("PUT", f"{base}/override/x", {"actions": ["explode"]}, 400),
            ("PUT", f"{base}/override/x", {"conditions": []}, 400),
            ("PUT", f"{base}/override/x", {"actions": [], "conditions": [{"kind": "room_member_count", "is": "x"}]}, 400),
            ("PUT", f"{base}/content/x", {"actions": []}, 400),
            ("PUT", f"{base}/override/x", {"actions": []}, 400),  # no conditions
            ("PUT", f"{base}/room/", {"actions": []}, 400),
            ("PUT", f"{base}/room", {"actions": []}, 400),
            ("PUT", "pushrules/", {"actions": []}, 400),
            ("PUT", "pushrules/device/room/x", {"actions": []}, 400),
            ("PUT", f"{base}/room/%23fo%5Co:example.com", {"actions": []}, 400),
            ("PUT", f"{base}/room/a%2Fb", {"actions": []}, 400),
            ("PUT", f"{base}/override/.m.rule.master/colour", {"enabled": True}, 400),
            ("PUT", f"{base}/nonsense/x", {"actions": []}, 400),
            ("PUT", f"{base}/override/.m.rule.mine", {"actions": [], "conditions": []}, 400),
            ("PUT", f"{base}/override/x?before=missing", {"actions": [], "conditions": []}, 404),
            ("PUT", f"{base}/override/x?before=.m.rule.master", {"actions": [], "conditions": []}, 400),
            ("GET", "pushrules", None, 400),
            ("GET", "pushrules/global", None, 400),
            ("GET", f"{base}/room", None, 400),
            ("GET", "pushrules/not_a_scope/", None, 400),
            ("GET", f"{base}/not_a_template/", None, 400),
            ("GET", f"{base}/override/.m.rule.master/colour", None, 400),
            ("DELETE", f"{base}/override/a/enabled", None, 400),
            ("PUT", f"{base}/override/a/enabled", {"enabled": "yes"}, 400),
            ("PUT", f"{base}/override/missing/actions", {"actions": []}, 404),
            ("GET", f"{base}/override/missing", None, 404),
            ("DELETE", f"{base}/override/.m.rule.master", None, 400),
            ("DELETE", f"{base}/override/missing", None, 404),
            ("PUT", f"{base}/override/x", [1, 2], 400),
        ]
        for method, path, body, status in bad:
            response = await client.request(method, path, body, token=bob)
            assert response.status == status and response.errcode, (method, path, body, response)

        stored = await _ok(client, "GET", f"user/{quote(BOB)}/account_data/m.push_rules", token=bob)
        assert stored["global"] == await _ok(client, "GET", f"{base}/", token=bob)
        assert [r["rule_id"] for r in stored["global"]["content"]] == ["lunch", ".m.rule.contains_user_name"]
        master = next(r for r in stored["global"]["override"] if r["rule_id"] == ".m.rule.master")
        assert master["enabled"] is True and master["default"] is True

        # Pushers: validated as the spec says.
        for body, status in [
            ({**_pusher("http://gw.example/notify", "k")}, 400),
            ({**_pusher("http://gw.example/_matrix/push/v1/notify", "k"), "kind": "carrier-pigeon"}, 400),
            ({"app_id": "a", "pushkey": "k"}, 400),
            ({**_pusher("http://gw.example/_matrix/push/v1/notify", "k"), "data": "x"}, 400),
            ({**_pusher("http://gw.example/_matrix/push/v1/notify", "k"), "append": "yes"}, 400),
            ({"kind": "email", "app_id": "m.email", "pushkey": "not-an-address", "app_display_name": "E",
              "device_display_name": "E", "lang": "en", "data": {}}, 400),
        ]:
            response = await client.request("POST", "pushers/set", body, token=bob)
            assert response.status == status and response.errcode, (body, response)
        email = {"kind": "email", "app_id": "m.email", "pushkey": "bob@example.org", "app_display_name": "E",
                 "device_display_name": "E", "lang": "en", "data": {}}
        await _ok(client, "POST", "pushers/set", email, token=bob)
        await _ok(client, "POST", "pushers/set",
                  _pusher("https://gw.example/_matrix/push/v1/notify", "k", format="event_id_only"), token=bob)
        assert {p["kind"] for p in (await _ok(client, "GET", "pushers", token=bob))["pushers"]} == {"email", "http"}
        await _ok(client, "POST", "pushers/set", {**email, "kind": None}, token=bob)
        assert [p["kind"] for p in (await _ok(client, "GET", "pushers", token=bob))["pushers"]] == ["http"]

        # A deactivated account's pushers go with it.
        auth = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": "bob"}, "password": "password"}
        await _ok(client, "POST", "account/deactivate", {"auth": auth}, token=bob)
        assert await PushStore(hs.process.db).get_pushers(BOB) == []


def _worker_layout(dsn: str, tmp_path: Path, redis_url: str) -> tuple[dict[str, Any], int]:
    internal, health = free_port(), free_port()
    config = server_config(dsn, tmp_path, **LIMITS)
    config["listeners"].append({"type": "http", "port": internal, "resources": ["replication"]})
    config.update({
        "redis": {"enabled": True, "url": redis_url},
        "worker_replication_secret": "a shared secret",
        "instance_map": {"master": {"host": "127.0.0.1", "port": internal}},
        "workers": {"pusher1": {"app": "pusher",
                                "listeners": [{"type": "http", "port": health, "resources": ["health"]}]}},
    })
    return config, health


async def test_a_pusher_worker_restarted_sends_every_push_once(
    database_dsn: str, tmp_path: Path, redis_url: str
) -> None:
    """The main process and a ``pusher`` worker over Redis: the main process sends no pushes
    itself; the worker pushes, is stopped while Alice sends three messages, and once started
    again pushes those three: every message exactly once, in order."""
    raw, _ = _worker_layout(database_dsn, tmp_path, redis_url)
    config = parse_config(raw, config_path=tmp_path / "homeserver.yaml")
    main = HomeServer(config, reactor, registry=CollectorRegistry())

    def new_worker() -> HomeServer:
        return HomeServer(config, reactor, registry=CollectorRegistry(), instance_name="pusher1")

    async with gateway() as (gw, url):
        await main.start()
        worker = new_worker()
        try:
            await worker.start()
            client = Client(f"http://127.0.0.1:{config.listeners[0].port}")
            alice = (await client.register_ok("alice"))["access_token"]
            bob = (await client.register_ok("bob"))["access_token"]
            room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
            await _ok(client, "POST", "pushers/set", _pusher(url, "bob-phone", format="event_id_only"), token=bob)
            sent = [await _send(client, room_id, "w0", {"msgtype": "m.text", "body": "before"}, alice)]
            await wait_for(lambda: len(gw.received) == 1, "the first push")
            assert gw.received[0] == {"event_id": sent[0], "room_id": room_id, "counts": {"unread": 1}, "prio": "high",
                                      "devices": gw.received[0]["devices"]}  # event_id_only: no content (1:1 room: sound, high)
            await worker.stop()
            for i in range(1, 4):
                sent.append(await _send(client, room_id, f"w{i}", {"msgtype": "m.text", "body": str(i)}, alice))
            await _sleep(0.2)
            assert gw.events() == sent[:1]  # nobody pushes while the worker is down
            worker = new_worker()
            await worker.start()
            await wait_for(lambda: len(gw.received) >= 4, "the pushes sent while the worker was down")
            sent.append(await _send(client, room_id, "w4", {"msgtype": "m.text", "body": "after"}, alice))
            await wait_for(lambda: len(gw.received) >= 5, "the push after the restart")
            assert gw.events() == sent
            # A push carries the unread count as it is when sent: the late three all say 4.
            assert [n["counts"]["unread"] for n in gw.received] == [1, 4, 4, 4, 5]
            sample = worker.registry.get_sample_value("tributary_push_notifications_sent_total")
            assert sample == 4.0
        finally:
            await worker.stop()
            await main.stop()


async def test_threaded_read_receipts_split_unread_counts(database_dsn: str, tmp_path: Path) -> None:
    """Alice writes a thread root and a later main-timeline message, and two replies in the thread.
    Bob's /sync counts all four; asked for ``unread_thread_notifications``, two in the main
    timeline and two in the thread. A receipt in the thread reads only thread events, one for
    ``main`` only main-timeline ones, an unthreaded one everything before it. A bad thread_id is
    a 400."""
    split = quote(json.dumps({"room": {"timeline": {"unread_thread_notifications": True}}}))
    async with running_server(database_dsn, tmp_path, **LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)

        def reply(body: str) -> dict[str, Any]:
            return {"msgtype": "m.text", "body": body,
                    "m.relates_to": {"rel_type": "m.thread", "event_id": root}}

        root = await _send(client, room_id, "t0", {"msgtype": "m.text", "body": "a thread"}, alice)
        first = await _send(client, room_id, "t1", reply("one"), alice)
        await _send(client, room_id, "t2", reply("two"), alice)
        main = await _send(client, room_id, "t3", {"msgtype": "m.text", "body": "meanwhile"}, alice)

        async def counts() -> tuple[dict[str, Any], dict[str, Any]]:
            whole = (await _ok(client, "GET", "sync", token=bob))["rooms"]["join"][room_id]
            assert "unread_thread_notifications" not in whole
            parts = (await _ok(client, "GET", f"sync?filter={split}", token=bob))["rooms"]["join"][room_id]
            return whole["unread_notifications"], {
                key: parts[key] for key in ("unread_notifications", "unread_thread_notifications") if key in parts}

        def n(count: int) -> dict[str, int]:
            return {"notification_count": count, "highlight_count": 0}

        assert await counts() == (n(4), {"unread_notifications": n(2), "unread_thread_notifications": {root: n(2)}})
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(first)}", {"thread_id": root}, token=bob)
        assert await counts() == (n(3), {"unread_notifications": n(2), "unread_thread_notifications": {root: n(1)}})
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read.private/{quote(root)}", {"thread_id": "main"},
                  token=bob)
        assert await counts() == (n(2), {"unread_notifications": n(1), "unread_thread_notifications": {root: n(1)}})
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(main)}", {}, token=bob)
        assert await counts() == (n(0), {"unread_notifications": n(0)})
        # The receipt is shared with its thread.
        synced = await _ok(client, "GET", "sync", token=alice)
        receipts = [e for e in synced["rooms"]["join"][room_id]["ephemeral"]["events"] if e["type"] == "m.receipt"]
        assert receipts[0]["content"][first]["m.read"][BOB]["thread_id"] == root

        for body, receipt_type in (({"thread_id": ""}, "m.read"), ({"thread_id": "elsewhere"}, "m.read"),
                                   ({"thread_id": root}, "m.fully_read"), ({"thread_id": 5}, "m.read")):
            bad = await client.request("POST", f"rooms/{room_id}/receipt/{receipt_type}/{quote(main)}", body,
                                       token=bob)
            assert (bad.status, bad.errcode) in ((400, "M_INVALID_PARAM"), (400, "M_BAD_JSON")), (body, bad)
