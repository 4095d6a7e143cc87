"""Application services end to end: real PostgreSQL, a real application service on loopback.

The service is a small Twisted web server in the test speaking the application service API:
it checks the ``hs_token``, takes transactions (deduplicating by transaction ID, as the spec
asks of services), answers user and alias queries by creating the user or room through the
client API with its ``as_token``, answers third-party lookups and pings. It can be stopped
(its port closed) and started again on the same port.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import yaml
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from homeserver.app import HomeServer
from homeserver.config import HomeserverConfig, parse_config
from tests.harness import free_port
from tests.integration.test_client_support import GENEROUS, SERVER_NAME, Client, server_config
from tests.integration.test_push import _sleep, wait_for
from tests.twisted_plugin import reactor

AS_TOKEN = "as-token-for-the-irc-bridge"
HS_TOKEN = "hs-token-for-the-irc-bridge"
IRC_ALICE = f"@irc_alice:{SERVER_NAME}"
SENDER = f"@ircbot:{SERVER_NAME}"


def _ageless(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` without ``unsigned.age``: the time since the event was sent, as of the moment
    the transaction goes out, so larger when the same transaction goes out again."""
    return [{**e, "unsigned": {k: v for k, v in e.get("unsigned", {}).items() if k != "age"}} for e in events]


class FakeService(Resource):
    """An application service: records transactions (first copy of each ID), queries and pings."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.txns: dict[str, list[dict[str, Any]]] = {}
        self.order: list[str] = []
        self.repeats = 0
        self.bad_auth = 0
        self.user_queries: list[str] = []
        self.alias_queries: list[str] = []
        self.pings: list[Any] = []
        self.ephemeral: list[dict[str, Any]] = []
        self.to_device: list[dict[str, Any]] = []
        self.lookups: list[tuple[str, dict[str, list[str]]]] = []
        # Called for a user or alias query: returns whether the service made it.
        self.make: Callable[[str], Deferred[bool]] | None = None

    def events(self, event_type: str | None = None) -> list[dict[str, Any]]:
        every = [e for txn_id in self.order for e in self.txns[txn_id]]
        return [e for e in every if event_type is None or e["type"] == event_type]

    def render(self, request: Request) -> Any:
        if request.getHeader("authorization") != f"Bearer {HS_TOKEN}":
            self.bad_auth += 1
            request.setResponseCode(403)
            return json.dumps({"errcode": "M_FORBIDDEN"}).encode()
        path = request.path.decode()
        assert request.content is not None
        body = json.loads(request.content.read() or b"null")
        if request.method == b"PUT" and path.startswith("/_matrix/app/v1/transactions/"):
            txn_id = path.rsplit("/", 1)[1]
            if txn_id in self.txns:
                # A transaction sent again (its answer was lost, or the sender stopped before it
                # recorded it) holds the same events; their ``unsigned.age`` is counted afresh.
                self.repeats += 1
                assert _ageless(self.txns[txn_id]) == _ageless(body["events"]), \
                    "a transaction ID was reused for other events"
            else:
                self.txns[txn_id] = body["events"]
                self.order.append(txn_id)
                assert body.get("ephemeral") == body.get("de.sorunome.msc2409.ephemeral")
                self.ephemeral.extend(body.get("ephemeral", []))
                self.to_device.extend(body.get("de.sorunome.msc2409.to_device", []))
            return b"{}"
        if path.startswith(("/_matrix/app/v1/users/", "/_matrix/app/v1/rooms/")):
            name = unquote(path.rsplit("/", 1)[1])
            (self.user_queries if "/users/" in path else self.alias_queries).append(name)
            return self._answer_query(request, name)
        if path == "/_matrix/app/v1/ping":
            self.pings.append(body)
            return b"{}"
        if path.startswith("/_matrix/app/v1/thirdparty/"):
            self.lookups.append((path, {k.decode(): [v.decode() for v in vs] for k, vs in (request.args or {}).items()}))
            if path.endswith("/protocol/irc"):
                return json.dumps({"user_fields": ["nick"], "location_fields": ["channel"], "icon": "mxc://x/y",
                                   "field_types": {}, "instances": [{"desc": "Libera", "fields": {},
                                                                     "network_id": "libera"}]}).encode()
            if "/location" in path:
                return json.dumps([{"alias": "#irc_chan:test.local", "protocol": "irc", "fields": {}},
                                   {"not": "a location"}]).encode()
            return json.dumps([{"userid": "@irc_bob:test.local", "protocol": "irc", "fields": {}}]).encode()
        request.setResponseCode(404)
        return b'{"errcode": "M_UNRECOGNIZED"}'

    def _answer_query(self, request: Request, name: str) -> Any:
        if self.make is None:
            request.setResponseCode(404)
            return b"{}"

        def answer(made: bool) -> None:
            request.setResponseCode(200 if made else 404)
            request.write(b"{}")
            request.finish()

        self.make(name).addCallback(answer)
        return NOT_DONE_YET


class ServicePort:
    """The service's listener, which a test stops and starts again on the same port."""

    def __init__(self, resource: FakeService) -> None:
        self.resource = resource
        self.port_number = free_port()
        self._port: IListeningPort | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port_number}"

    def start(self) -> None:
        self._port = reactor.listenTCP(self.port_number, Site(self.resource), interface="127.0.0.1")

    async def stop(self) -> None:
        if self._port is not None:
            await self._port.stopListening()
            self._port = None


def write_registration(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "irc.yaml"
    path.write_text(yaml.safe_dump({
        "id": "irc", "url": url, "as_token": AS_TOKEN, "hs_token": HS_TOKEN, "sender_localpart": "ircbot",
        "namespaces": {"users": [{"exclusive": True, "regex": "@irc_.*"}],
                       "aliases": [{"exclusive": True, "regex": "#irc_.*"}], "rooms": []},
        "rate_limited": False, "protocols": ["irc"], "receive_ephemeral": True,
        "org.matrix.msc2409.receive_to_device": True,
    }))
    return path


def appservice_config(dsn: str, tmp_path: Path, url: str) -> HomeserverConfig:
    raw = server_config(
        dsn, tmp_path, rc_joins={"local": GENEROUS, "remote": GENEROUS},
        rc_message={"per_second": 0.1, "burst_count": 12},
        app_service_config_files=[str(write_registration(tmp_path, url))],
        app_service_sender={"backoff": {"initial": "100ms", "max": "400ms"}},
    )
    return parse_config(raw, config_path=tmp_path / "homeserver.yaml")


async def ok(client: Client, method: str, path: str, body: Any = None, *, token: str) -> Any:
    response = await client.request(method, path, body, token=token)
    assert response.status == 200, (method, path, response)
    return response.body


async def refused(client: Client, method: str, path: str, body: Any, token: str | None, status: int,
                  errcode: str) -> None:
    response = await client.request(method, path, body, token=token)
    assert (response.status, response.errcode) == (status, errcode), (method, path, response)


def metric(hs: HomeServer, name: str) -> float:
    return hs.registry.get_sample_value(name, {"service": "irc"}) or 0.0


async def test_a_bridge_acts_in_its_namespace_and_gets_every_event_once_in_order(
    database_dsn: str, tmp_path: Path
) -> None:
    """The bridge acts as its sender and as registered users of its namespace, never outside
    it; its exclusive namespaces are refused to others; it is not rate limited. Messages in a
    room with one of its users reach it in order; while it is down they wait, and when it is
    back every one arrives once, in order, also when Tributary restarted meanwhile."""
    service = FakeService()
    listener = ServicePort(service)
    listener.start()
    config = appservice_config(database_dsn, tmp_path, listener.url)
    hs = HomeServer(config, reactor, registry=CollectorRegistry())
    await hs.start()
    try:
        client = Client(f"http://127.0.0.1:{config.listeners[0].port}")
        # --- identity assertion -------------------------------------------------------------
        assert (await ok(client, "GET", "account/whoami", token=AS_TOKEN))["user_id"] == SENDER
        await refused(client, "GET", f"account/whoami?user_id={quote(IRC_ALICE)}", None, AS_TOKEN,
                      403, "M_FORBIDDEN")  # not registered yet
        registered = await ok(client, "POST", "register", {"type": "m.login.application_service",
                                                           "username": "irc_alice", "inhibit_login": True},
                              token=AS_TOKEN)
        assert registered == {"user_id": IRC_ALICE, "home_server": SERVER_NAME}
        await refused(client, "POST", "register", {"type": "m.login.application_service", "username": "bob"},
                      AS_TOKEN, 400, "M_EXCLUSIVE")
        await refused(client, "POST", "register", {"type": "m.login.application_service", "username": "irc_x"},
                      None, 401, "M_MISSING_TOKEN")
        await refused(client, "POST", "register", {"username": "irc_mallory", "password": "pw",
                                                   "auth": {"type": "m.login.dummy"}}, None, 400, "M_EXCLUSIVE")
        await refused(client, "GET", "register/available?username=irc_x", None, None, 400, "M_EXCLUSIVE")
        alice = (await client.register_ok("alice"))["access_token"]
        dave = (await client.register_ok("dave"))["access_token"]
        await refused(client, "GET", f"account/whoami?user_id={quote('@alice:' + SERVER_NAME)}", None, AS_TOKEN,
                      403, "M_FORBIDDEN")
        await refused(client, "GET", f"account/whoami?user_id={quote(IRC_ALICE)}&device_id=NOPE", None, AS_TOKEN,
                      400, "M_UNKNOWN_DEVICE")
        assert await ok(client, "GET", f"account/whoami?user_id={quote(IRC_ALICE)}", token=AS_TOKEN) == {
            "user_id": IRC_ALICE, "is_guest": False}
        as_alice = f"user_id={quote(IRC_ALICE)}"

        # --- exclusive aliases ----------------------------------------------------------------
        await refused(client, "POST", "createRoom", {"room_alias_name": "irc_chan"}, alice, 400, "M_EXCLUSIVE")
        room_id = (await ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        alias = quote(f"#irc_chan:{SERVER_NAME}")
        await refused(client, "PUT", f"directory/room/{alias}", {"room_id": room_id}, alice, 400, "M_EXCLUSIVE")
        await ok(client, "PUT", f"directory/room/{alias}", {"room_id": room_id}, token=AS_TOKEN)

        # --- the bridge's user joins; rate limits are not the bridge's ------------------------
        await ok(client, "POST", f"rooms/{room_id}/invite", {"user_id": IRC_ALICE}, token=alice)
        await ok(client, "POST", f"rooms/{room_id}/join?{as_alice}", {}, token=AS_TOKEN)
        await ok(client, "POST", f"rooms/{room_id}/join", {}, token=dave)
        sent: list[str] = []

        async def say(token: str, text: str, query: str = "") -> str:
            path = f"rooms/{room_id}/send/m.room.message/{quote(text)}" + (f"?{query}" if query else "")
            event_id = str((await ok(client, "PUT", path, {"msgtype": "m.text", "body": text}, token=token))["event_id"])
            sent.append(event_id)
            return event_id

        for i in range(14):  # the first with timestamp massaging: when it was said on IRC
            await say(AS_TOKEN, f"from irc {i}", as_alice + ("&ts=1500000000000" if i == 0 else ""))
        await refused(client, "PUT", f"rooms/{room_id}/send/m.room.message/bad-ts?{as_alice}&ts=soon",
                      {"msgtype": "m.text", "body": "x"}, AS_TOKEN, 400, "M_INVALID_PARAM")
        for i in range(12):
            await say(dave, f"dave {i}", "ts=1500000000000" if i == 0 else "")  # not a service's: ignored
        await refused(client, "PUT", f"rooms/{room_id}/send/m.room.message/dave-too-many",
                      {"msgtype": "m.text", "body": "x"}, dave, 429, "M_LIMIT_EXCEEDED")
        await say(alice, "hello bridge")
        await wait_for(lambda: len(service.events("m.room.message")) >= len(sent), "the first messages")
        members = [e for e in service.events("m.room.member") if e["state_key"] == IRC_ALICE]
        assert [m["content"]["membership"] for m in members] == ["invite", "join"]
        assert service.events("m.room.message")[0]["sender"] == IRC_ALICE
        assert service.events("m.room.message")[0]["room_id"] == room_id
        assert service.events("m.room.message")[0]["origin_server_ts"] == 1500000000000
        assert service.events("m.room.message")[14]["origin_server_ts"] > 1600000000000  # dave's

        # --- typing and read receipts ride along (receive_ephemeral) ----------------------------
        alice_id = f"@alice:{SERVER_NAME}"
        await ok(client, "PUT", f"rooms/{room_id}/typing/{quote(alice_id)}", {"typing": True, "timeout": 30000},
                 token=alice)
        await ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(sent[-1])}", {}, token=alice)
        await wait_for(lambda: {e["type"] for e in service.ephemeral} >= {"m.typing", "m.receipt"}, "ephemeral")
        typing = next(e for e in service.ephemeral if e["type"] == "m.typing")
        assert typing["room_id"] == room_id and typing["content"]["user_ids"] == [alice_id]
        receipt = next(e for e in service.ephemeral if e["type"] == "m.receipt")
        assert alice_id in receipt["content"][sent[-1]]["m.read"]
        # Presence of a user sharing a room with the bridge's users (receive_ephemeral too), not
        # of one who shares none (set first, so that it would have arrived by then).
        zed = (await client.register_ok("zed"))["access_token"]
        await ok(client, "PUT", f"presence/{quote('@zed:' + SERVER_NAME)}/status", {"presence": "online"}, token=zed)
        await ok(client, "PUT", f"presence/{quote(alice_id)}/status", {"presence": "unavailable",
                                                                       "status_msg": "away from IRC"}, token=alice)
        await wait_for(lambda: any(e["type"] == "m.presence" for e in service.ephemeral), "presence")
        presence = [e for e in service.ephemeral if e["type"] == "m.presence"]
        assert {e["sender"] for e in presence} == {alice_id}, presence
        assert presence[-1]["sender"] == alice_id
        assert presence[-1]["content"]["presence"] == "unavailable"
        assert presence[-1]["content"]["status_msg"] == "away from IRC"

        # --- to-device messages for its users' devices (receive_to_device) ---------------------
        device = (await ok(client, "POST", "login", {"type": "m.login.application_service", "identifier": {
            "type": "m.id.user", "user": "irc_alice"}}, token=AS_TOKEN))["device_id"]
        assert (await ok(client, "GET", f"account/whoami?{as_alice}&device_id={device}", token=AS_TOKEN))[
            "device_id"] == device  # masquerading as that device
        await ok(client, "PUT", "sendToDevice/m.test/td1", {"messages": {IRC_ALICE: {device: {"n": 1}},
                                                                         alice_id: {"*": {"n": 2}}}}, token=alice)
        await wait_for(lambda: len(service.to_device) >= 1, "the to-device message")
        assert service.to_device == [{"type": "m.test", "sender": alice_id, "content": {"n": 1},
                                      "to_user_id": IRC_ALICE, "to_device_id": device}]

        # --- the bridge goes down: messages wait; it comes back: every one, once, in order -----
        await listener.stop()
        failed = metric(hs, "tributary_appservice_transactions_failed_total")
        for i in range(3):
            await say(alice, f"while down {i}")
        await wait_for(lambda: metric(hs, "tributary_appservice_transactions_failed_total") > failed,
                       "a failed transaction")
        assert metric(hs, "tributary_appservice_events_pending") > 0
        listener.start()
        await wait_for(lambda: len(service.events("m.room.message")) >= len(sent), "the messages sent while down")
        assert [e["event_id"] for e in service.events("m.room.message")] == sent

        # --- and again, with Tributary restarted while it is down --------------------------------
        await listener.stop()
        for i in range(2):
            await say(alice, f"before restart {i}")
        # A to-device message for the bridge's device too: it outlives the restart (it is read
        # from the to_device stream above the service's position, not held in memory).
        await ok(client, "PUT", "sendToDevice/m.test/td2", {"messages": {IRC_ALICE: {device: {"n": 3}}}},
                 token=alice)
        failed = metric(hs, "tributary_appservice_transactions_failed_total")
        await wait_for(lambda: metric(hs, "tributary_appservice_transactions_failed_total") > failed,
                       "a failed transaction before the restart")
        assert metric(hs, "tributary_appservice_transactions_sent_total") > 0
    finally:
        await hs.stop()
    hs = HomeServer(config, reactor, registry=CollectorRegistry())
    await hs.start()
    try:
        client = Client(f"http://127.0.0.1:{config.listeners[0].port}")
        await say(alice, "after restart")
        await _sleep(0.2)
        listener.start()
        await wait_for(lambda: len(service.events("m.room.message")) >= len(sent), "the messages of the restart")
        await wait_for(lambda: len(service.to_device) >= 2, "the to-device message of the restart")
        await _sleep(0.3)  # time for anything sent twice to arrive
        assert [e["event_id"] for e in service.events("m.room.message")] == sent
        assert [m["content"] for m in service.to_device] == [{"n": 1}, {"n": 3}], "each once, in order"
        assert service.bad_auth == 0
        assert len(set(service.order)) == len(service.order)
    finally:
        await hs.stop()
        await listener.stop()


async def test_queries_thirdparty_and_ping(database_dsn: str, tmp_path: Path) -> None:
    """Unknown users and aliases of the bridge's namespaces are asked of it (it makes them, or
    not); /thirdparty lookups are its answers; a ping reaches it, and says when it cannot."""
    service = FakeService()
    listener = ServicePort(service)
    listener.start()
    config = appservice_config(database_dsn, tmp_path, listener.url)
    hs = HomeServer(config, reactor, registry=CollectorRegistry())
    await hs.start()
    client = Client(f"http://127.0.0.1:{config.listeners[0].port}")

    async def make(name: str) -> bool:
        if name == f"@irc_new:{SERVER_NAME}":
            await ok(client, "POST", "register", {"type": "m.login.application_service", "username": "irc_new"},
                     token=AS_TOKEN)
            return True
        if name == f"#irc_lobby:{SERVER_NAME}":
            await ok(client, "POST", "createRoom", {"room_alias_name": "irc_lobby"}, token=AS_TOKEN)
            return True
        return False

    service.make = lambda name: Deferred.fromCoroutine(make(name))
    try:
        bob = (await client.register_ok("bob"))["access_token"]
        profile = await ok(client, "GET", f"profile/{quote('@irc_new:' + SERVER_NAME)}", token=bob)
        assert profile["displayname"] == "irc_new"
        await refused(client, "GET", f"profile/{quote('@irc_ghost:' + SERVER_NAME)}", None, bob, 404, "M_NOT_FOUND")
        await refused(client, "GET", f"profile/{quote('@nobody:' + SERVER_NAME)}", None, bob, 404, "M_NOT_FOUND")
        assert service.user_queries == [f"@irc_new:{SERVER_NAME}", f"@irc_ghost:{SERVER_NAME}"]
        # An invite of an unknown user of its namespace asks it too (and goes ahead either way).
        room_id = (await ok(client, "POST", "createRoom", {}, token=bob))["room_id"]
        await ok(client, "POST", f"rooms/{room_id}/invite", {"user_id": f"@irc_invitee:{SERVER_NAME}"}, token=bob)
        assert service.user_queries[-1] == f"@irc_invitee:{SERVER_NAME}"

        # Logging in as one of its users (m.login.application_service).
        flows = (await ok(client, "GET", "login", token=bob))["flows"]
        assert {"type": "m.login.application_service"} in flows
        as_login = {"type": "m.login.application_service", "identifier": {"type": "m.id.user", "user": "irc_new"}}
        logged_in = await ok(client, "POST", "login", as_login, token=AS_TOKEN)
        assert logged_in["user_id"] == f"@irc_new:{SERVER_NAME}"
        whoami = await ok(client, "GET", "account/whoami", token=logged_in["access_token"])
        assert whoami["device_id"] == logged_in["device_id"]
        await refused(client, "POST", "login", as_login, None, 401, "M_MISSING_TOKEN")
        await refused(client, "POST", "login", {**as_login, "identifier": {"type": "m.id.user", "user": "bob"}},
                      AS_TOKEN, 400, "M_EXCLUSIVE")
        found = await ok(client, "GET", f"directory/room/{quote('#irc_lobby:' + SERVER_NAME)}", token=bob)
        assert found["room_id"].startswith("!")
        await refused(client, "GET", f"directory/room/{quote('#elsewhere:' + SERVER_NAME)}", None, bob, 404,
                      "M_NOT_FOUND")
        assert service.alias_queries == [f"#irc_lobby:{SERVER_NAME}"]

        protocols = await ok(client, "GET", "thirdparty/protocols", token=bob)
        assert list(protocols) == ["irc"] and protocols["irc"]["instances"][0]["network_id"] == "libera"
        assert (await ok(client, "GET", "thirdparty/protocol/irc", token=bob))["user_fields"] == ["nick"]
        await refused(client, "GET", "thirdparty/protocol/xmpp", None, bob, 404, "M_NOT_FOUND")
        locations = await ok(client, "GET", "thirdparty/location/irc?channel=%23chat", token=bob)
        assert locations == [{"alias": "#irc_chan:test.local", "protocol": "irc", "fields": {}}]  # the bad entry left out
        assert service.lookups[-1] == ("/_matrix/app/v1/thirdparty/location/irc", {"channel": ["#chat"]})
        users = await ok(client, "GET", "thirdparty/user?userid=%40irc_bob%3Atest.local", token=bob)
        assert users == [{"userid": "@irc_bob:test.local", "protocol": "irc", "fields": {}}]
        await refused(client, "GET", "thirdparty/protocols", None, None, 401, "M_MISSING_TOKEN")

        ping = "/_matrix/client/v1/appservice/irc/ping"
        answer = await ok(client, "POST", ping, {"transaction_id": "p1"}, token=AS_TOKEN)
        assert isinstance(answer["duration_ms"], int) and service.pings == [{"transaction_id": "p1"}]
        await refused(client, "POST", ping, {}, bob, 403, "M_FORBIDDEN")
        await refused(client, "POST", "/_matrix/client/v1/appservice/other/ping", {}, AS_TOKEN, 403, "M_FORBIDDEN")
        await refused(client, "POST", ping, {"transaction_id": 5}, AS_TOKEN, 400, "M_BAD_JSON")
        await listener.stop()
        await refused(client, "POST", ping, {}, AS_TOKEN, 502, "M_CONNECTION_FAILED")
        assert service.bad_auth == 0
    finally:
        await hs.stop()
        await listener.stop()


async def test_an_appservice_worker_pushes_and_the_main_process_does_not(
    database_dsn: str, tmp_path: Path, redis_url: str
) -> None:
    """The main process and an ``appservice`` worker over Redis: the worker follows the events
    stream by replication and pushes; stopped while messages are sent and started again, it
    sends each of them once, in order; the main process has no sender of its own."""
    service = FakeService()
    listener = ServicePort(service)
    listener.start()
    internal, health = free_port(), free_port()
    raw = server_config(
        database_dsn, tmp_path, rc_joins={"local": GENEROUS, "remote": GENEROUS}, rc_message=GENEROUS,
        app_service_config_files=[str(write_registration(tmp_path, listener.url))],
        app_service_sender={"backoff": {"initial": "100ms", "max": "400ms"}},
        redis={"enabled": True, "url": redis_url}, worker_replication_secret="a shared secret",
        instance_map={"master": {"host": "127.0.0.1", "port": internal}},
        workers={"appservice1": {"app": "appservice",
                                 "listeners": [{"type": "http", "port": health, "resources": ["health"]}]}},
    )
    raw["listeners"] = [*raw["listeners"], {"type": "http", "port": internal, "resources": ["replication"]}]
    config = parse_config(raw, config_path=tmp_path / "homeserver.yaml")
    assert [s.id for s in config.app_services] == ["irc"]
    main = HomeServer(config, reactor, registry=CollectorRegistry())

    def new_worker() -> HomeServer:
        return HomeServer(config, reactor, registry=CollectorRegistry(), instance_name="appservice1")

    await main.start()
    worker = new_worker()
    try:
        await worker.start()
        client = Client(f"http://127.0.0.1:{config.listeners[0].port}")
        await ok(client, "POST", "register", {"type": "m.login.application_service", "username": "irc_alice"},
                 token=AS_TOKEN)
        alice = (await client.register_ok("alice"))["access_token"]
        room_id = (await ok(client, "POST", "createRoom", {"preset": "public_chat", "invite": [IRC_ALICE]},
                            token=alice))["room_id"]
        sent: list[str] = []

        async def say(text: str) -> None:
            path = f"rooms/{room_id}/send/m.room.message/{quote(text)}"
            sent.append((await ok(client, "PUT", path, {"msgtype": "m.text", "body": text}, token=alice))["event_id"])

        await say("first")
        await wait_for(lambda: len(service.events("m.room.message")) == 1, "the first message")
        await worker.stop()
        for i in range(3):
            await say(f"while the worker is down {i}")
        await _sleep(0.3)
        assert len(service.events("m.room.message")) == 1  # nobody pushes while the worker is down
        assert main.registry.get_sample_value("tributary_appservice_transactions_sent_total",
                                              {"service": "irc"}) is None
        worker = new_worker()
        await worker.start()
        await wait_for(lambda: len(service.events("m.room.message")) == len(sent), "the messages sent meanwhile")
        await say("last")
        await wait_for(lambda: len(service.events("m.room.message")) == len(sent), "the last message")
        assert [e["event_id"] for e in service.events("m.room.message")] == sent
        assert metric(worker, "tributary_appservice_transactions_sent_total") > 0
    finally:
        await worker.stop()
        await main.stop()
        await listener.stop()
