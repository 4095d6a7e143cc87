"""Declared routes over real loopback HTTP: the gate authenticates each kind of caller, applies
the declared rate limit and parses the body, in that order, before the handler runs.

The credential checkers are small fakes (a token table, an admin set, a signature that is the
origin's name): what is under test is the gate's order and its answers, not ``Auth``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from io import BytesIO
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from twisted.web.client import FileBodyProducer, readBody
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Requester, access_token_from_request
from homeserver.http.metrics import HttpMetrics
from homeserver.http.routes import Body, Call, Caller, Endpoint, Gate, Rate, Response, declare, endpoints, route
from homeserver.http.server import JsonRouter
from storage.kernel.errors import MatrixError, forbidden
from storage.kernel.ratelimit import Ratelimiter
from tests.unit.http.test_router import Server

TOKENS = {"alice": Requester("@alice:hs", "A", 1), "guest": Requester("@guest:hs", "G", 2, is_guest=True),
          "admin": Requester("@admin:hs", "M", 3)}
SERVICE_TOKEN = "as_token"


class FakeUsers:
    async def get_user_by_req(self, request: Request, *, allow_guest: bool = False) -> Requester:
        token = access_token_from_request(request)
        if token is None:
            raise MatrixError(401, "M_MISSING_TOKEN", "Missing access token")
        if token == SERVICE_TOKEN:
            return Requester("@bridge:hs", "", 9)
        if token not in TOKENS:
            raise MatrixError(401, "M_UNKNOWN_TOKEN", "Unknown access token")
        requester = TOKENS[token]
        if requester.is_guest and not allow_guest:
            raise MatrixError(403, "M_GUEST_ACCESS_FORBIDDEN", "Guest access not allowed")
        return requester

    def has_access_token(self, request: Request) -> bool:
        return access_token_from_request(request) is not None

    def has_app_service_token(self, request: Request) -> bool:
        return access_token_from_request(request) == SERVICE_TOKEN


class FakeAdmins:
    def __init__(self) -> None:
        self.audited: list[tuple[str, int]] = []

    async def check(self, request: Request, requester: Requester, params: Mapping[str, str], *,
                    allow_self: bool) -> None:
        if requester.user_id != "@admin:hs" and not (allow_self and params.get("user_id") == requester.user_id):
            raise forbidden("You are not a server admin")

    def audit(self, request: Request, requester: Requester, status: int) -> None:
        self.audited.append((requester.user_id, status))


class FakeServers:
    async def authenticate(self, request: Request, params: Mapping[str, str], content: Any,
                           raw: bytes | None) -> str:
        header = request.getHeader("authorization")
        if header is None or not header.startswith("X-Matrix origin="):
            raise MatrixError(401, "M_UNAUTHORIZED", "Missing X-Matrix Authorization header")
        return header.removeprefix("X-Matrix origin=")


class Servlets:
    @route("GET", r"/open", "open", caller=Caller.NONE)
    async def open(self, call: Call) -> Response:
        return 200, {"requester": None if call.requester is None else call.requester.user_id}

    @route("GET", r"/maybe", "maybe", caller=Caller.OPTIONAL_USER)
    async def maybe(self, call: Call) -> Response:
        return 200, {"requester": None if call.requester is None else call.requester.user_id}

    @route("PUT", r"/things/(?P<kind>[^/]+)", "things", caller=Caller.GUEST, body=Body.OBJECT,
           guests=("kind", {"shared"}))
    async def things(self, call: Call) -> Response:
        return 200, {"user": call.user.user_id, "kind": call.params["kind"], "body": call.content}

    @route("POST", r"/members", "members", caller=Caller.USER, body=Body.OPTIONAL_OBJECT, rate=Rate.KEY_QUERY)
    @route("POST", r"/members/legacy", "members_legacy", caller=Caller.USER, body=Body.OPTIONAL_OBJECT)
    async def members(self, call: Call) -> Response:
        return 200, {"user": call.user.user_id, "body": call.content}

    @route("GET", r"/bridge", "bridge", caller=Caller.APPSERVICE)
    async def bridge(self, call: Call) -> Response:
        return 200, {"user": call.user.user_id}

    @route("DELETE", r"/users/(?P<user_id>[^/]+)", "admin_user", caller=Caller.ADMIN_OR_SELF)
    async def admin_user(self, call: Call) -> Response:
        if call.params["user_id"] == "@nobody:hs":
            raise MatrixError(404, "M_NOT_FOUND", "No such user")
        return 200, {"by": call.user.user_id}

    @route("PUT", r"/send/(?P<txn>[^/]+)", "send", caller=Caller.SERVER, body=Body.SIGNED)
    async def send(self, call: Call) -> Response:
        return 200, {"origin": call.server, "body": call.body}

    @route("PUT", r"/send_entries/(?P<txn>[^/]+)", "send_entries", caller=Caller.SERVER, body=Body.SIGNED,
           entries=("pdus",))
    async def send_entries(self, call: Call) -> Response:
        return 200, {"body": call.body, "refused": {f"{name}/{i}": e for (name, i), e in call.refused.items()}}


@pytest.fixture
def gated() -> Any:
    server = Server()
    admins = FakeAdmins()
    gate = Gate(users=FakeUsers(), admins=admins, servers=FakeServers(),
                limiters={Rate.KEY_QUERY: Ratelimiter(per_second=0.001, burst_count=2)}, clock=lambda: 1000.0)
    declare(server.router, gate, Servlets())
    server.admins = admins  # type: ignore[attr-defined]
    yield server
    server.port.stopListening()


async def call(server: Server, method: str, path: str, body: bytes | None = None, *,
               token: str | None = None, origin: str | None = None) -> tuple[int, Any]:
    headers = Headers()
    if token is not None:
        headers.addRawHeader(b"Authorization", f"Bearer {token}".encode())
    if origin is not None:
        headers.addRawHeader(b"Authorization", f"X-Matrix origin={origin}".encode())
    producer = FileBodyProducer(BytesIO(body)) if body is not None else None
    response = await server.agent.request(method.encode(), (server.url + path).encode(), headers, producer)
    raw = await readBody(response)
    return response.code, json.loads(raw) if raw else None


def test_declarations_are_collected_in_the_order_written() -> None:
    found = endpoints(Servlets())
    assert [(e.method, e.name) for e in found] == [
        ("GET", "open"), ("GET", "maybe"), ("PUT", "things"), ("POST", "members"), ("POST", "members_legacy"),
        ("GET", "bridge"), ("DELETE", "admin_user"), ("PUT", "send"), ("PUT", "send_entries"),
    ]
    assert found[3].rate is Rate.KEY_QUERY and found[4].rate is None
    assert all(isinstance(e, Endpoint) for e in found)


async def test_a_user_route_answers_401_before_it_looks_at_the_body(gated: Server) -> None:
    assert await call(gated, "PUT", "/things/mine", b"{not json") == (
        401, {"errcode": "M_MISSING_TOKEN", "error": "Missing access token"})
    status, body = await call(gated, "PUT", "/things/mine", b"{not json", token="alice")
    assert status == 400 and body["errcode"] == "M_NOT_JSON"
    status, body = await call(gated, "PUT", "/things/mine", b"[1]", token="alice")
    assert status == 400 and body["errcode"] == "M_BAD_JSON"
    assert await call(gated, "PUT", "/things/mine", b'{"a": 1}', token="alice") == (
        200, {"user": "@alice:hs", "kind": "mine", "body": {"a": 1}})


async def test_guests_only_where_declared_and_for_the_declared_values(gated: Server) -> None:
    assert (await call(gated, "PUT", "/things/shared", b"{}", token="guest"))[0] == 200
    status, body = await call(gated, "PUT", "/things/mine", b"{}", token="guest")
    assert (status, body["errcode"]) == (403, "M_GUEST_ACCESS_FORBIDDEN")
    status, body = await call(gated, "POST", "/members/legacy", token="guest")
    assert (status, body["errcode"]) == (403, "M_GUEST_ACCESS_FORBIDDEN")


async def test_an_optional_user_is_none_without_a_token_and_checked_with_one(gated: Server) -> None:
    assert await call(gated, "GET", "/maybe") == (200, {"requester": None})
    assert await call(gated, "GET", "/maybe", token="alice") == (200, {"requester": "@alice:hs"})
    assert (await call(gated, "GET", "/maybe", token="stolen"))[0] == 401
    assert await call(gated, "GET", "/open", token="stolen") == (200, {"requester": None})


async def test_an_empty_optional_body_is_an_empty_object(gated: Server) -> None:
    assert await call(gated, "POST", "/members/legacy", token="alice") == (200, {"user": "@alice:hs", "body": {}})
    assert (await call(gated, "POST", "/members/legacy", b"  ", token="alice"))[1]["body"] == {}
    assert (await call(gated, "POST", "/members/legacy", b'"text"', token="alice"))[0] == 400


async def test_the_declared_rate_limit_is_applied_per_requester(gated: Server) -> None:
    for _ in range(2):
        assert (await call(gated, "POST", "/members", token="alice"))[0] == 200
    status, body = await call(gated, "POST", "/members", token="alice")
    assert (status, body["errcode"]) == (429, "M_LIMIT_EXCEEDED") and body["retry_after_ms"] > 0
    # Another requester has a budget of its own, and the undeclared alias none at all.
    assert (await call(gated, "POST", "/members", token="admin"))[0] == 200
    assert (await call(gated, "POST", "/members/legacy", token="alice"))[0] == 200


async def test_an_appservice_route_refuses_users_and_anonymous_callers(gated: Server) -> None:
    assert (await call(gated, "GET", "/bridge"))[0] == 401
    status, body = await call(gated, "GET", "/bridge", token="alice")
    assert (status, body["errcode"]) == (403, "M_FORBIDDEN")
    assert await call(gated, "GET", "/bridge", token=SERVICE_TOKEN) == (200, {"user": "@bridge:hs"})


async def test_admin_routes_check_then_audit_every_outcome(gated: Server) -> None:
    admins: FakeAdmins = gated.admins  # type: ignore[attr-defined]
    assert (await call(gated, "DELETE", "/users/@bob:hs", token="alice"))[0] == 403
    assert admins.audited == []  # refused before the handler: the checker logs its own refusal
    assert await call(gated, "DELETE", "/users/@alice:hs", token="alice") == (200, {"by": "@alice:hs"})
    assert (await call(gated, "DELETE", "/users/@nobody:hs", token="admin"))[0] == 404
    assert admins.audited == [("@alice:hs", 200), ("@admin:hs", 404)]


async def test_a_server_route_passes_the_verified_origin_and_the_signed_body(gated: Server) -> None:
    assert (await call(gated, "PUT", "/send/1", b"{}"))[0] == 401
    assert await call(gated, "PUT", "/send/1", b'{"pdus": []}', origin="remote.example") == (
        200, {"origin": "remote.example", "body": {"pdus": []}})
    status, body = await call(gated, "PUT", "/send/1", b'{"a": 1, "a": 2}', origin="remote.example")
    assert status == 400  # canonical JSON: duplicate keys are refused


async def test_a_route_naming_entries_gets_the_refused_ones_and_the_rest_as_declared(gated: Server) -> None:
    """An entry of a named list that breaks the canonical rules is the handler's to answer
    (``Call.refused``); out of range anywhere else, the body is a 400 as for any signed route."""
    raw = b'{"pdus": [{"d": 1}, {"d": 1152921504606846976}]}'
    status, body = await call(gated, "PUT", "/send_entries/1", raw, origin="remote.example")
    assert status == 200
    assert body["body"] == {"pdus": [{"d": 1}, {"d": 2**60}]}
    assert list(body["refused"]) == ["pdus/1"] and "canonical" in body["refused"]["pdus/1"]
    assert (await call(gated, "PUT", "/send/1", raw, origin="remote.example"))[0] == 400
    assert (await call(gated, "PUT", "/send_entries/1", b'{"pdus": [], "x": 1152921504606846976}',
                       origin="remote.example"))[0] == 400
    with pytest.raises(ValueError, match="signed body"):
        route("PUT", "/x", "x", caller=Caller.USER, body=Body.OBJECT, entries=("pdus",))


def test_a_gate_refuses_routes_it_cannot_check() -> None:
    router = JsonRouter(HttpMetrics.create(CollectorRegistry()))
    with pytest.raises(ValueError, match="no checker for server callers"):
        declare(router, Gate(users=FakeUsers(), admins=FakeAdmins(), clock=lambda: 0.0,
                             limiters={Rate.KEY_QUERY: Ratelimiter(per_second=1.0, burst_count=1)}), Servlets())
    with pytest.raises(ValueError, match="no limiter for rate class key_query"):
        declare(router, Gate(users=FakeUsers(), admins=FakeAdmins(), servers=FakeServers(), clock=lambda: 0.0),
                Servlets())


def test_a_handler_asking_for_what_its_route_does_not_check_is_a_bug() -> None:
    bare = Call(request=None, params={})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="declare its caller"):
        bare.user
    with pytest.raises(RuntimeError, match="Caller.SERVER"):
        bare.server
    with pytest.raises(RuntimeError, match="not declared as an object"):
        bare.content
    with pytest.raises(ValueError, match="only make sense for Caller.GUEST"):
        route("GET", "/x", "x", caller=Caller.USER, guests=("a", {"b"}))
