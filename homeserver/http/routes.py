"""Declared routes: a servlet is a declaration next to its handler, and one gate applies it.

A servlet states, as data, its method, path pattern, servlet name (a metrics label and the
name worker roles route by), who may call it (``Caller``), its rate-limit class (``Rate``)
and what its body must be (``Body``); the handler then receives a ``Call`` whose requester,
origin and body are already checked. ``Gate`` is the one place that authenticates every
kind of caller, applies the declared rate limit and parses the body, in that order, so a
request without credentials is answered 401 before its body is looked at, and a servlet
never repeats any of it.

Servlets are classes whose handler methods carry ``@route(...)`` declarations; their
constructors take the few services they use. ``declare(router, gate, *servlets)``
registers every declaration in the order it is written. What this module does not know:
what any endpoint does, or how a credential is checked (the gate is given the checkers).
"""

# tests: tests/unit/http/test_routes.py, tests/integration/test_client_fuzz.py

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, Protocol, TypeVar

import attrs
from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Requester, client_ip
from homeserver.http.server import (
    CLIENT_JSON,
    FEDERATION_JSON,
    JsonDict,
    Routes,
    parse_json_body,
    parse_json_object,
    parse_optional_json_object,
    read_json_entries,
)
from storage.kernel.errors import MatrixError, forbidden
from storage.kernel.json_input import JsonRules
from storage.kernel.ratelimit import Ratelimiter, ratelimit


class Caller(enum.Enum):
    """Who may call an endpoint, and so what the gate checks before the handler runs."""

    NONE = "none"
    """Anyone: no credential is read (login, registration, discovery)."""
    OPTIONAL_USER = "optional_user"
    """Anyone; a user's access token, when one is given, must be valid and names the requester."""
    USER = "user"
    """A registered user's access token, or an application service's acting as one of its users."""
    GUEST = "guest"
    """As ``USER``, and guests too (for the path-parameter values ``Endpoint.guest_params`` allows)."""
    APPSERVICE = "appservice"
    """An application service's ``as_token`` only (401 without a token, 403 with a user's)."""
    ADMIN = "admin"
    """A server admin's access token; rate-limited per admin and audited."""
    ADMIN_OR_SELF = "admin_or_self"
    """As ``ADMIN``, or the user the path's ``user_id`` names."""
    SERVER = "server"
    """Another homeserver: an ``X-Matrix`` signature over the request (and, for a path naming a
    room, that room's server ACL)."""
    WORKER = "worker"
    """Another process of this server: the shared ``worker_replication_secret`` (the internal API)."""


class Body(enum.Enum):
    """What the request body must be; the gate parses it (``Call.body``) or answers 400/413."""

    NONE = "none"
    """Not read."""
    JSON = "json"
    """Any JSON value (client rules: M_NOT_JSON / M_BAD_JSON)."""
    OBJECT = "object"
    """A JSON object."""
    OPTIONAL_OBJECT = "optional_object"
    """A JSON object, or nothing (``{}``): clients send no body on some POSTs."""
    SIGNED = "signed"
    """A server's canonical JSON, kept with its raw bytes for the ``X-Matrix`` signature; absent is None.
    A route may name top-level lists whose entries are judged one by one (``route(entries=...)``)."""


class Rate(enum.Enum):
    """The rate-limit classes a route may declare, each keyed as its comment says. The gate
    counts every call it lets through; a limit that only checks, and counts once the action
    succeeds (client registration's ``rc_registration``, logins' ``rc_login``), stays in its
    handler."""

    KEY_QUERY = "key_query"
    """``rc_key_query``, per client address: the notary's key queries."""
    SHARED_SECRET_REGISTRATION = "admin_register"
    """``rc_registration``, per client address, in a budget of its own: the admin API's
    shared-secret registration (``/_synapse/admin/v1/register``, its nonce and its account)."""


class UserAuth(Protocol):
    """How users' and services' access tokens are checked (``Auth``)."""

    async def get_user_by_req(self, request: Request, *, allow_guest: bool = False) -> Requester: ...

    def has_app_service_token(self, request: Request) -> bool: ...

    def has_access_token(self, request: Request) -> bool: ...


class AdminCheck(Protocol):
    """How a server admin is recognised and audited (``homeserver/admin/guard.py``); ``check``
    may rate-limit the requester too, as it runs before the body is read."""

    async def check(self, request: Request, requester: Requester, params: Mapping[str, str], *,
                    allow_self: bool) -> None: ...

    def audit(self, request: Request, requester: Requester, status: int) -> None: ...


class ServerAuth(Protocol):
    """How another server's signed request is checked (``homeserver/http/federation/servlets.py``)."""

    async def authenticate(self, request: Request, params: Mapping[str, str], content: Any,
                           raw: bytes | None) -> str: ...


class WorkerAuth(Protocol):
    """How another process of this server proves itself (``homeserver/routing/internal_api.py``)."""

    def check(self, request: Request) -> None: ...


@attrs.frozen
class Call:
    """One request as a handler sees it: checked, authenticated and parsed as declared."""

    request: Request
    params: Mapping[str, str]
    body: Any = None
    requester: Requester | None = None
    origin: str | None = None
    # A signed body's entries (of the lists its route names) that break the canonical rules,
    # by (list, index): what each breaks. The entry is in ``body`` as leniently parsed.
    refused: Mapping[tuple[str, int], str] = attrs.field(factory=dict)

    @property
    def user(self) -> Requester:
        """The requester of a route declared for users, guests or admins."""
        if self.requester is None:
            raise RuntimeError("this route does not authenticate a user; declare its caller")
        return self.requester

    @property
    def server(self) -> str:
        """The verified origin of a route declared for servers."""
        if self.origin is None:
            raise RuntimeError("this route does not authenticate a server; declare Caller.SERVER")
        return self.origin

    @property
    def content(self) -> JsonDict:
        """The body of a route declared with ``Body.OBJECT`` or ``Body.OPTIONAL_OBJECT``."""
        if not isinstance(self.body, dict):
            raise RuntimeError("this route's body is not declared as an object")
        return self.body


Response = tuple[int, Any]
CallHandler = Callable[[Call], Awaitable[Response]]


@attrs.frozen
class Endpoint:
    """One declared route: what the gate checks, and the handler it then calls."""

    method: str
    path: str
    name: str
    caller: Caller
    handler: CallHandler
    body: Body = Body.NONE
    rate: Rate | None = None
    # For GUEST: (path parameter, values) a guest may use; None: any.
    guest_params: tuple[str, frozenset[str]] | None = None
    # For a SIGNED body: top-level lists whose entries are judged one by one (``Call.refused``).
    entries: tuple[str, ...] = ()

    def guest_allowed(self, params: Mapping[str, str]) -> bool:
        if self.caller is not Caller.GUEST:
            return False
        return self.guest_params is None or params.get(self.guest_params[0]) in self.guest_params[1]


@attrs.frozen
class _Declaration:
    method: str
    path: str
    name: str
    caller: Caller
    body: Body
    rate: Rate | None
    guest_params: tuple[str, frozenset[str]] | None
    entries: tuple[str, ...]


ROUTES_ATTRIBUTE: Final = "__tributary_routes__"
F = TypeVar("F", bound=Callable[..., Awaitable[Response]])


def route(method: str, path: str, name: str, *, caller: Caller, body: Body = Body.NONE, rate: Rate | None = None,
          guests: tuple[str, Iterable[str]] | None = None, entries: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Declare that ``method path`` is served by the decorated handler method (``async def
    h(self, call: Call)``). A handler may carry several declarations (a path and its legacy
    alias); they are registered in the order written, top to bottom. ``entries``: for a signed
    body, the top-level lists an entry of which breaking the canonical rules is that entry's
    fault, not the body's (a transaction's ``pdus`` and ``edus``): see ``Call.refused``."""
    if guests is not None and caller is not Caller.GUEST:
        raise ValueError(f"{name}: guest_params only make sense for Caller.GUEST")
    if entries and body is not Body.SIGNED:
        raise ValueError(f"{name}: only a signed body's entries are judged one by one")
    declaration = _Declaration(method.upper(), path, name, caller, body, rate,
                               None if guests is None else (guests[0], frozenset(guests[1])), entries)

    def mark(handler: F) -> F:
        # Decorators apply bottom-up; prepend so the list reads top to bottom.
        setattr(handler, ROUTES_ATTRIBUTE, (declaration, *getattr(handler, ROUTES_ATTRIBUTE, ())))
        return handler

    return mark


def endpoints(*servlets: object) -> list[Endpoint]:
    """Every declared route of ``servlets``, in the order their classes write them."""
    found = []
    for servlet in servlets:
        for attribute, value in vars(type(servlet)).items():
            for d in getattr(value, ROUTES_ATTRIBUTE, ()):
                found.append(Endpoint(d.method, d.path, d.name, d.caller, getattr(servlet, attribute), d.body,
                                      d.rate, d.guest_params, d.entries))
    return found


def missing_credentials() -> MatrixError:
    return MatrixError(401, "M_MISSING_TOKEN", "Missing access token")


class Gate:
    """Turns declared endpoints into router handlers: authenticate, rate-limit, parse, call.

    Each checker is optional, so a router serves only the callers it was given (the federation
    listener has no user auth, the client listener no server auth); declaring a caller the
    gate cannot check is refused at registration, not at the first request."""

    def __init__(self, *, users: UserAuth | None = None, admins: AdminCheck | None = None,
                 servers: ServerAuth | None = None, workers: WorkerAuth | None = None,
                 limiters: Mapping[Rate, Ratelimiter] | None = None,
                 clock: Callable[[], float] = time.time, json: JsonRules = CLIENT_JSON) -> None:
        # ``json``: the rules of a Body.JSON or Body.OBJECT body (the federation listener's are
        # FEDERATION_JSON, canonical, as for its signed bodies).
        self._users = users
        self._admins = admins
        self._servers = servers
        self._workers = workers
        self._limiters = dict(limiters or {})
        self._clock = clock
        self._json = json

    def can_serve(self, endpoint: Endpoint) -> str | None:
        """Why this gate cannot serve ``endpoint`` (None: it can)."""
        needs = {
            Caller.OPTIONAL_USER: self._users, Caller.USER: self._users, Caller.GUEST: self._users,
            Caller.APPSERVICE: self._users, Caller.ADMIN: self._admins, Caller.ADMIN_OR_SELF: self._admins,
            Caller.SERVER: self._servers, Caller.WORKER: self._workers,
        }
        if endpoint.caller in needs and needs[endpoint.caller] is None:
            return f"no checker for {endpoint.caller.value} callers"
        if endpoint.caller in (Caller.ADMIN, Caller.ADMIN_OR_SELF) and self._users is None:
            return "admin routes need user auth too"
        if endpoint.rate is not None and endpoint.rate not in self._limiters:
            return f"no limiter for rate class {endpoint.rate.value}"
        if (endpoint.body is Body.SIGNED) != (endpoint.caller is Caller.SERVER) and endpoint.body is not Body.NONE:
            return "a signed body goes with Caller.SERVER, and a server's body is signed"
        return None

    def handler(self, endpoint: Endpoint) -> Gated:
        problem = self.can_serve(endpoint)
        if problem is not None:
            raise ValueError(f"route {endpoint.name} ({endpoint.method} {endpoint.path}): {problem}")
        return Gated(self, endpoint)

    async def serve(self, endpoint: Endpoint, request: Request, params: Mapping[str, str]) -> Response:
        caller = endpoint.caller
        requester: Requester | None = None
        origin: str | None = None
        body: Any = None
        refused: Mapping[tuple[str, int], str] = {}
        if caller is Caller.SERVER:
            assert self._servers is not None
            raw = None
            if endpoint.body is Body.SIGNED:
                body, raw, refused = read_json_entries(request, FEDERATION_JSON, endpoint.entries)
            origin = await self._servers.authenticate(request, params, body, raw)
        elif caller is Caller.WORKER:
            assert self._workers is not None
            self._workers.check(request)
        elif caller is not Caller.NONE:
            requester = await self._user(endpoint, request, params)
        if endpoint.rate is not None:
            key = requester.user_id if requester is not None else (client_ip(request) or "-")
            ratelimit(self._limiters[endpoint.rate], (endpoint.rate.value, key), self._clock())
        if caller not in (Caller.ADMIN, Caller.ADMIN_OR_SELF):
            return await self._call(endpoint, request, params, body, requester, origin, refused)
        assert self._admins is not None and requester is not None
        status = 500
        try:
            # Inside the audit: an admin's malformed body is an outcome (400) like any other.
            status, answer = await self._call(endpoint, request, params, body, requester, origin, refused)
            return status, answer
        except MatrixError as e:
            status = e.status
            raise
        finally:
            self._admins.audit(request, requester, status)

    async def _call(self, endpoint: Endpoint, request: Request, params: Mapping[str, str], body: Any,
                    requester: Requester | None, origin: str | None,
                    refused: Mapping[tuple[str, int], str]) -> Response:
        """The handler, given the body parsed as declared (a signed body was read to authenticate)."""
        if endpoint.body is not Body.SIGNED:
            body = _parse_body(endpoint.body, request, self._json)
        return await endpoint.handler(Call(request, params, body, requester, origin, refused))

    async def _user(self, endpoint: Endpoint, request: Request, params: Mapping[str, str]) -> Requester | None:
        users = self._users
        assert users is not None
        caller = endpoint.caller
        if caller is Caller.OPTIONAL_USER:
            if not users.has_access_token(request):
                return None
            return await users.get_user_by_req(request, allow_guest=True)
        if caller is Caller.APPSERVICE:
            if not users.has_app_service_token(request):
                await users.get_user_by_req(request, allow_guest=False)  # 401 without a valid token
                raise forbidden("Only application services may use this endpoint")
            return await users.get_user_by_req(request, allow_guest=False)
        requester = await users.get_user_by_req(request, allow_guest=endpoint.guest_allowed(params))
        if caller in (Caller.ADMIN, Caller.ADMIN_OR_SELF):
            assert self._admins is not None
            await self._admins.check(request, requester, params, allow_self=caller is Caller.ADMIN_OR_SELF)
        return requester


def _parse_body(kind: Body, request: Request, rules: JsonRules) -> Any:
    if kind is Body.NONE:
        return None
    if kind is Body.JSON:
        return parse_json_body(request, rules)
    if kind is Body.OBJECT:
        return parse_json_object(request, rules)
    return parse_optional_json_object(request)


@attrs.frozen
class Gated:
    """What the router calls for a declared endpoint: the gate's checks, then the handler."""

    gate: Gate
    endpoint: Endpoint

    async def __call__(self, request: Request, params: Mapping[str, str]) -> Response:
        return await self.gate.serve(self.endpoint, request, params)


def declare(router: Routes, gate: Gate, *servlets: object) -> None:
    """Register every route ``servlets`` declare, through ``gate``, in the order written."""
    serve(router, gate, endpoints(*servlets))


def serve(router: Routes, gate: Gate, declared: Iterable[Endpoint]) -> None:
    """Register ``declared`` endpoints (made as data rather than by ``@route``), through ``gate``."""
    for endpoint in declared:
        router.register([endpoint.method], endpoint.path, gate.handler(endpoint), endpoint.name)
