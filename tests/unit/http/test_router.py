"""The JSON router over real loopback HTTP: routing, error JSON, CORS, limits, metrics."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from twisted.web.server import Request

from storage.kernel.errors import MatrixError, Unavailable
from homeserver.http.metrics import HttpMetrics
from homeserver.events.canonical import EncodedJson
from homeserver.http.server import JsonRouter, make_site, parse_json_object
from tests.twisted_plugin import reactor, run_sync


LARGE_ANSWER = 8 * 1024 * 1024  # more than loopback's socket buffers take at once


class Server:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        metrics = HttpMetrics.create(self.registry)
        self.router = JsonRouter(metrics)
        site = make_site(self.router, clock=reactor, metrics=metrics, max_body_bytes=1000)
        self.port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.agent = Agent(reactor)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port.getHost().port}"

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any, Headers]:
        from twisted.web.client import FileBodyProducer
        from io import BytesIO

        producer = FileBodyProducer(BytesIO(body)) if body is not None else None
        response: IResponse = await self.agent.request(method.encode(), (self.url + path).encode(), None, producer)
        raw = await readBody(response)
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw
        return response.code, parsed, response.headers


@pytest.fixture
def server() -> Any:
    s = Server()

    async def echo(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, {"params": dict(params), "body": parse_json_object(request)}

    async def hello(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, {"hello": params["name"]}

    async def hello_ids(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, dict(params)

    async def forbidden(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        raise MatrixError(403, "M_FORBIDDEN", "not you", extra_field=1)

    async def broken(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        raise KeyError("a bug")

    s.router.register(["PUT"], r"/echo/(?P<thing>[^/]+)", echo, "echo")
    s.router.register(["GET"], r"/hello/(?P<name>[^/]+)", hello, "hello")
    s.router.register(["GET"], r"/forbidden", forbidden, "forbidden")
    s.router.register(["GET"], r"/ids/(?P<room_id>[^/]+)/(?P<user_id>[^/]+)/(?P<event_id>[^/]+)/(?P<server>[^/]+)",
                      hello_ids, "ids")
    async def encoded(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, EncodedJson(b'{"big":"answer"}')

    async def media(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        request.setHeader(b"Content-Type", b"image/png")
        return 200, b"\x89PNG"

    async def large(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, EncodedJson(b'{"big":"' + b"x" * LARGE_ANSWER + b'"}')

    async def outage(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        raise Unavailable("cannot connect to the database: connection refused", retry_after=3)

    s.router.register(["GET"], r"/outage", outage, "outage")
    s.router.register(["GET"], r"/large", large, "large")
    s.router.register(["GET"], r"/broken", broken, "broken")
    s.router.register(["GET"], r"/encoded", encoded, "encoded")
    s.router.register(["GET"], r"/media", media, "media")
    yield s
    run_sync(s.port.stopListening())


async def test_routes_and_decodes_path_parameters(server: Server) -> None:
    status, body, headers = await server.request("GET", "/hello/%40alice%3Aexample.org")
    assert status == 200
    assert body == {"hello": "@alice:example.org"}
    assert headers.getRawHeaders(b"access-control-allow-origin") == [b"*"]
    assert headers.getRawHeaders(b"content-type") == [b"application/json"]


async def test_unknown_path_and_method(server: Server) -> None:
    assert (await server.request("GET", "/nowhere"))[:2] == (404, {"errcode": "M_UNRECOGNIZED", "error": "Unrecognized request"})
    status, body, _ = await server.request("POST", "/hello/x")
    assert status == 405 and body["errcode"] == "M_UNRECOGNIZED"


async def test_options_preflight_gets_cors(server: Server) -> None:
    status, body, headers = await server.request("OPTIONS", "/anything/at/all")
    assert status == 200 and body == {}
    assert b"PUT" in headers.getRawHeaders(b"access-control-allow-methods")[0]


async def test_matrix_errors_and_bugs_become_error_json(server: Server) -> None:
    assert (await server.request("GET", "/forbidden"))[:2] == (
        403, {"errcode": "M_FORBIDDEN", "error": "not you", "extra_field": 1}
    )
    status, body, _ = await server.request("GET", "/broken")
    assert status == 500 and body == {"errcode": "M_UNKNOWN", "error": "Internal server error"}


async def test_an_unreachable_database_is_a_503_with_retry_after_and_no_traceback(
        server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """An outage is not our bug: 503 (the spec's M_UNKNOWN, saying what happened) with the
    storage layer's Retry-After, and nothing logged by the router for it."""
    with caplog.at_level("DEBUG", logger="homeserver.http.server"):
        status, body, headers = await server.request("GET", "/outage")
    assert status == 503
    assert body["errcode"] == "M_UNKNOWN" and "database" in body["error"]
    assert headers.getRawHeaders(b"retry-after") == [b"3"]
    assert [r for r in caplog.records if r.name == "homeserver.http.server"] == []


@pytest.mark.parametrize(
    ("body", "status", "errcode"),
    [
        (b"", 400, "M_NOT_JSON"),
        (b"{not json", 400, "M_NOT_JSON"),
        (b"\xff\xfe{}", 400, "M_NOT_JSON"),
        (b"NaN", 400, "M_NOT_JSON"),
        (b"[1, 2]", 400, "M_BAD_JSON"),
        (b'{"a": 1e400}', 400, "M_BAD_JSON"),
        (b'{"a": "\\ud800"}', 400, "M_BAD_JSON"),
        (b"[" * 200 + b"]" * 200, 400, "M_NOT_JSON"),
        (b'{"a": "' + b"x" * 2000 + b'"}', 413, "M_TOO_LARGE"),
    ],
)
async def test_bad_bodies(server: Server, body: bytes, status: int, errcode: str) -> None:
    got_status, got_body, _ = await server.request("PUT", "/echo/x", body)
    assert (got_status, got_body["errcode"]) == (status, errcode)


@pytest.mark.parametrize(
    "path",
    [
        "/hello/a%00b",
        "/ids/!r%00:hs/@u:hs/$e/hs",
        "/ids/r:hs/@u:hs/$e/hs",
        "/ids/!r:hs/@u:hs:port/$e/hs",
        "/ids/!r:hs/@u:hs/e/hs",
        "/ids/!r:hs/@u:hs/$e/" + "x" * 64 + ".org",
        "/ids/!r:hs/@u:hs/$e%0A/hs",
        "/ids/!" + "r" * 300 + "/@u:hs/$e/hs",
    ],
)
async def test_identifier_path_parameters_are_checked_before_the_handler(server: Server, path: str) -> None:
    status, body, _ = await server.request("GET", path)
    assert (status, body["errcode"]) == (400, "M_INVALID_PARAM")


async def test_valid_identifier_path_parameters_reach_the_handler(server: Server) -> None:
    status, body, _ = await server.request("GET", "/ids/%21r%3Ahs/%40u%3Ahs%3A8448/%24e/%5B%3A%3A1%5D%3A80")
    assert (status, body) == (200, {"room_id": "!r:hs", "user_id": "@u:hs:8448", "event_id": "$e", "server": "[::1]:80"})


async def test_bad_percent_encoding_is_a_400(server: Server) -> None:
    status, body, _ = await server.request("GET", "/hello/%ff%fe")
    assert status == 400 and body["errcode"] == "M_INVALID_PARAM"


async def test_json_body_round_trip_and_metrics(server: Server) -> None:
    status, body, _ = await server.request("PUT", "/echo/t1", b'{"k": ["v", 1, null]}')
    assert status == 200
    assert body == {"params": {"thing": "t1"}, "body": {"k": ["v", 1, None]}}
    sample = server.registry.get_sample_value(
        "tributary_http_requests_total", {"servlet": "echo", "method": "PUT", "status_class": "2xx"}
    )
    assert sample == 1
    assert server.registry.get_sample_value("tributary_http_request_duration_seconds_count", {"servlet": "echo"}) == 1


async def test_wait_drained_fires_when_requests_finish(server: Server) -> None:
    gate: Deferred[None] = Deferred()

    async def slow(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        await gate
        return 200, {}

    server.router.register(["GET"], r"/slow", slow, "slow")
    pending = Deferred.fromCoroutine(server.request("GET", "/slow"))
    while server.router.in_flight == 0:
        from twisted.internet.task import deferLater

        await deferLater(reactor, 0.005, lambda: None)
    drained = server.router.wait_drained()
    assert not drained.called
    gate.callback(None)
    status, _, _ = await pending
    assert status == 200
    assert drained.called


async def test_a_pre_encoded_answer_is_json_and_other_bytes_keep_their_type(server: Server) -> None:
    """A body assembled from stored JSON (send_join's) is served as application/json, which
    other servers insist on; raw bytes (media) keep the type their handler set."""
    status, body, headers = await server.request("GET", "/encoded")
    assert (status, body) == (200, {"big": "answer"})
    assert headers.getRawHeaders(b"Content-Type") == [b"application/json"]
    status, body, headers = await server.request("GET", "/media")
    assert headers.getRawHeaders(b"Content-Type") == [b"image/png"]


def _raw_exchange(port: int, data: bytes, answers: int, *, read_after: float = 0.0) -> tuple[list[tuple[int, bytes]], bool]:
    """Write ``data`` at once on a new connection, wait ``read_after`` seconds, then read
    ``answers`` HTTP answers (status, body by Content-Length); and whether the server then
    closed the connection (within a second)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        time.sleep(read_after)
        buffer, out = b"", list[tuple[int, bytes]]()
        while len(out) < answers:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end >= 0:
                head = buffer[:head_end].decode("latin-1").split("\r\n")
                length = int(next(line.split(":", 1)[1] for line in head if line.lower().startswith("content-length:")))
                if len(buffer) >= head_end + 4 + length:
                    out.append((int(head[0].split()[1]), buffer[head_end + 4:head_end + 4 + length]))
                    buffer = buffer[head_end + 4 + length:]
                    continue
            chunk = sock.recv(1 << 20)
            assert chunk, f"the connection closed after {len(out)} answers"
            buffer += chunk
        sock.settimeout(1)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
    assert buffer == b"", buffer[:200]
    return out, closed


async def test_pipelined_requests_are_answered_in_order_each_in_full(server: Server) -> None:
    """Answers go out as soon as they are written (``send_now``), not a loop turn later: four
    requests in one write, one of them an answer larger than the socket takes at once, read
    only after a pause, all come back whole and in order, on a connection kept open."""
    port = server.port.getHost().port
    body = b'{"a": 1}'
    requests = (b"GET /hello/one HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /large HTTP/1.1\r\nHost: x\r\n\r\n"
                b"PUT /echo/two HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n") % (len(body), body)
    answers, closed = await deferToThread(_raw_exchange, port, requests, 4, read_after=0.3)
    assert [status for status, _ in answers] == [200, 200, 200, 404]
    assert json.loads(answers[0][1]) == {"hello": "one"}
    assert len(answers[1][1]) == LARGE_ANSWER + len(b'{"big":""}')
    assert json.loads(answers[2][1]) == {"params": {"thing": "two"}, "body": {"a": 1}}
    assert json.loads(answers[3][1])["errcode"] == "M_UNRECOGNIZED"
    assert not closed


@pytest.mark.parametrize("request_head", [b"GET /hello/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                                          b"GET /hello/x HTTP/1.0\r\n\r\n",
                                          b"GET /large HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
async def test_an_answer_on_a_closing_connection_is_whole_then_the_connection_closes(
        server: Server, request_head: bytes) -> None:
    answers, closed = await deferToThread(_raw_exchange, server.port.getHost().port, request_head, 1, read_after=0.2)
    assert answers[0][0] == 200 and closed


# Patterns of each shape the servers register (homeserver/http/client_api, federation, admin).
INDEXED_PATTERNS = [
    r"/_matrix/client/versions/?",
    r"/\.well-known/matrix/client",
    r"/_matrix/client/(?:r0|v3)/register",
    r"/_matrix/client/v1/register/m\.login\.registration_token/validity",
    r"/_matrix/client/(?:r0|v3)/profile/(?P<user_id>[^/]+)/(?P<field>displayname|avatar_url)",
    r"/_matrix/client/(?:r0|v3)/rooms/(?P<room_id>[^/]+)/(?P<action>join|leave|invite)",
    r"/_matrix/client/(?:r0|v3)/rooms/(?P<room_id>[^/]+)/send/(?P<event_type>[^/]+)/(?P<txn_id>[^/]+)",
    r"/_matrix/client/(?:r0|v3)/rooms/(?P<room_id>[^/]+)/state/(?P<event_type>[^/]+)(?:/(?P<state_key>[^/]*))?",
    r"/_matrix/client/(?:r0|v3)/pushrules(?P<rest>/.*)?",
    r"/_matrix/client/(?:r0|v3)/sync",
    r"/_matrix/media/(?:v3|r0|v1)/download/(?P<server>[^/]+)/(?P<media_id>[^/]+)(?:/(?P<file_name>[^/]*))?",
    r"/_matrix/federation/v1/send/(?P<txn_id>[^/]+)",
    r"/_matrix/key/v2/server(?:/[^/]+)?",
    r"/_synapse/admin/v2/users/(?P<user_id>[^/]+)",
    r"/(?P<a>[^/]*)/(?P<b>[^/]*)/(?P<c>[^/]*)/rooms",   # a group holding a / : not read
    r"/_matrix/client/v3/rooms/x|/_matrix/y",           # an alternative to all of it
    r"/_matrix/(?:client|a.b)/v3/sync",                 # an unescaped . may be a /
    r"/_matrix/(?P<any>.*)",
]


def test_route_keys_are_read_only_where_one_path_segment_each_leads_to_a_literal() -> None:
    from homeserver.http.server import route_key

    assert [route_key(p) for p in INDEXED_PATTERNS] == [
        None, None, "register", "register", "profile", "rooms", "rooms", "rooms", None, "sync", "download",
        "send", None, "users", None, None, None, None,
    ]


def _first_match(routes: list[Any], path: str, method: str) -> tuple[str, str] | None:
    for route in routes:
        if route.pattern.fullmatch(path) is not None and route.method == method:
            return route.method, route.pattern.pattern
    return None


_segment = st.sampled_from(["_matrix", "client", "v3", "r0", "rooms", "send", "state", "sync", "register",
                            "pushrules", "media", "download", "federation", "v1", "users", "x", "",
                            ".well-known", "matrix", "key", "v2", "server", "m.login.registration_token", "y", "a", "b"])


@settings(derandomize=True, max_examples=500)
@given(st.lists(_segment, min_size=1, max_size=8), st.sampled_from(["GET", "PUT"]))
@example(["_matrix", "y"], "PUT").via("the alternative to all of a pattern")
@example(["_matrix", "a", "b", "v3", "sync"], "PUT").via("an unescaped . matching the /")
def test_the_index_picks_the_route_a_scan_of_every_route_picks(segments: list[str], method: str) -> None:
    router = JsonRouter(HttpMetrics.create(CollectorRegistry()))

    async def handler(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, {}

    for i, pattern in enumerate(INDEXED_PATTERNS):
        router.register(["GET", "PUT"] if i % 2 else ["PUT"], pattern, handler, f"s{i}")
    path = "/" + "/".join(segments)
    assert _first_match(router.candidates(path), path, method) == _first_match(router._routes, path, method)
