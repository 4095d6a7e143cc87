"""The JSON HTTP server: routing, Matrix error JSON, CORS, body limits, metrics.

Servlets register ``(method, path pattern) -> async handler``; a handler gets the
request and the path's named groups (percent-decoded) and returns
``(status, json_body)``. Every failure becomes Matrix error JSON: a
``MatrixError`` as itself, an outage of the database (the kernel's ``Unavailable``) as
``503 M_UNKNOWN`` with ``Retry-After`` and no traceback (the storage layer logs the
outage once), anything else as ``500 M_UNKNOWN`` with the traceback in the log (that
is our bug). Unknown paths get ``404 M_UNRECOGNIZED`` and
known paths with another method ``405 M_UNRECOGNIZED``. The router counts
requests in flight so that shutdown can wait for them.
"""

# tests: tests/unit/http/test_router.py

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any, Final, Protocol
from urllib.parse import unquote

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.tcp import Server
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from storage.kernel.errors import MatrixError, Unavailable, bad_json, invalid_param, unrecognized
from storage.kernel.json_input import JsonRules, decode_json, decode_json_entries
from homeserver.events.canonical import EncodedJson
from homeserver.events.identifiers import is_valid_event_id, is_valid_room_id, is_valid_server_name, is_valid_user_id
from homeserver.config import ConnectionLimitsConfig
from homeserver.http.limits import LimitedSite
from homeserver.http.metrics import HttpMetrics, method_label
from storage.kernel.logcontext import log_context, set_log_context
from storage.metrics import Children

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("homeserver.http.access")
#: Request IDs for log lines (``GET-17``), unique within the process.
_request_ids = itertools.count(1)

JsonDict = dict[str, Any]
Handler = Callable[[Request, Mapping[str, str]], Awaitable[tuple[int, Any]]]

DEFAULT_MAX_BODY_BYTES: Final = 1024 * 1024  # JSON bodies; media uploads get their own limit
MAX_JSON_DEPTH: Final = 100

CORS_HEADERS: Final = (
    (b"Access-Control-Allow-Origin", b"*"),
    (b"Access-Control-Allow-Methods", b"GET, HEAD, POST, PUT, DELETE, OPTIONS"),
    (b"Access-Control-Allow-Headers", b"X-Requested-With, Content-Type, Authorization, Date"),
)

# The spec has no errcode for "try again later" but M_LIMIT_EXCEEDED, which would tell the
# client it sent too much; M_UNKNOWN with a 503 and Retry-After says what happened instead.
DATABASE_UNAVAILABLE: Final = {
    "errcode": "M_UNKNOWN",
    "error": "The server cannot reach its database just now; try again in a moment",
}


@attrs.frozen
class Route:
    method: str
    pattern: re.Pattern[str]
    handler: Handler
    servlet: str


class TributaryRequest(Request):
    """A request that stops buffering a body once it passes the size limit."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Path prefixes whose bodies may be larger, each with its limit (media uploads; make_site).
    large_bodies: tuple[tuple[tuple[bytes, ...], int], ...] = ()
    body_too_large: bool = False
    _body_limit: int | None = None
    # The servlet routed to and its path parameters (set by JsonRouter); auth checks guests against them.
    servlet: str = ""
    path_params: Mapping[str, str] = {}
    _received_bytes: int = 0

    def body_limit(self) -> int:
        """The most body bytes this request may send: by its path, which the channel has parsed
        (from the request line) before any body arrives."""
        if self._body_limit is None:
            path = getattr(self.channel, "_path", b"") or b""
            self._body_limit = next(
                (size for prefixes, size in self.large_bodies if prefixes and path.startswith(prefixes)),
                self.max_body_bytes,
            )
        return self._body_limit

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self.body_limit():
            self.body_too_large = True
        super().gotLength(length)  # type: ignore[no-untyped-call]

    def handleContentChunk(self, data: bytes) -> None:
        self._received_bytes += len(data)
        if self._received_bytes > self.body_limit():
            self.body_too_large = True
            return
        if not self.body_too_large:
            super().handleContentChunk(data)  # type: ignore[no-untyped-call]


CLIENT_JSON: Final = JsonRules(max_bytes=DEFAULT_MAX_BODY_BYTES, max_depth=MAX_JSON_DEPTH)
"""Client-server bodies: floats allowed where the spec has them, integers as Python parses them."""
FEDERATION_JSON: Final = JsonRules(max_bytes=DEFAULT_MAX_BODY_BYTES, max_depth=MAX_JSON_DEPTH, canonical=True)
"""Server-server bodies: signed as canonical JSON, so unique keys and integers in its range."""


def parse_json_body(request: Request, rules: JsonRules = CLIENT_JSON) -> Any:
    """The request body as JSON by ``rules`` (storage/kernel/json_input.py); 413 M_TOO_LARGE past the
    listener's body limit, 400 M_NOT_JSON / M_BAD_JSON as the decoder says."""
    return read_json_body(request, rules)[0]


def read_json_body(request: Request, rules: JsonRules = CLIENT_JSON) -> tuple[Any, bytes]:
    """``parse_json_body``, with the body's bytes as they came (what a signature may cover)."""
    body, raw, _ = read_json_entries(request, rules, ())
    return body, raw


def read_json_entries(request: Request, rules: JsonRules,
                      entries: Collection[str]) -> tuple[Any, bytes, Mapping[tuple[str, int], str]]:
    """``read_json_body``, with the entries of the top-level lists named ``entries`` judged one
    by one (``decode_json_entries``): what each refused entry breaks, by (list, index)."""
    if getattr(request, "body_too_large", False):
        raise MatrixError(413, "M_TOO_LARGE", "Request body is too large")
    assert request.content is not None
    raw = request.content.read()
    rules = _bounded_by_listener(rules, raw)
    if not entries:
        return decode_json(raw, rules), raw, {}
    body, refused = decode_json_entries(raw, rules, entries)
    return body, raw, {where: e.error for where, e in refused.items()}


def _bounded_by_listener(rules: JsonRules, raw: bytes) -> JsonRules:
    """``rules`` for a body the listener already bounded (its own limit, maybe above the default)."""
    return rules if len(raw) <= rules.max_bytes else attrs.evolve(rules, max_bytes=len(raw))


def _json_object(value: Any) -> JsonDict:
    if not isinstance(value, dict):
        raise bad_json("Request body must be a JSON object")
    return value


def parse_json_object(request: Request, rules: JsonRules = CLIENT_JSON) -> JsonDict:
    return _json_object(parse_json_body(request, rules))


def parse_optional_json_object(request: Request, rules: JsonRules = CLIENT_JSON) -> JsonDict:
    """The body as a JSON object, or ``{}`` when the body is empty (clients send none on some
    POSTs); the body is read once."""
    if getattr(request, "body_too_large", False):
        raise MatrixError(413, "M_TOO_LARGE", "Request body is too large")
    content = request.content
    if content is None:
        return {}
    raw = content.read()
    if not raw.strip():
        return {}
    return _json_object(decode_json(raw, _bounded_by_listener(rules, raw)))


ID_PARAMS: Final[Mapping[str, tuple[Callable[[object], bool], str]]] = {
    "room_id": (is_valid_room_id, "room ID"),
    "user_id": (is_valid_user_id, "user ID"),
    "event_id": (is_valid_event_id, "event ID"),
    "server": (is_valid_server_name, "server name"),
}
"""Path parameters named after an identifier, checked by its grammar (homeserver/events/identifiers.py)."""


def check_path_params(params: Mapping[str, str]) -> None:
    """400 ``M_INVALID_PARAM`` for a path parameter with a NUL, or an identifier parameter that
    breaks its grammar; run before any handler, so none of them reaches a lookup or a query."""
    for name, value in params.items():
        check = ID_PARAMS.get(name)
        if check is not None and not check[0](value):
            raise invalid_param(f"{name}: {value[:100]!r} is not a valid {check[1]}")
        if "\x00" in value:
            raise invalid_param(f"{name}: path parameters may not contain NUL")


def encode_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


KEY_SEGMENT: Final = 4
"""The path segment routes are indexed by: ``/_matrix/client/v3/{rooms}/...`` (the first is the
empty one before the leading ``/``). It tells most routes of each API apart."""

_LITERAL: Final = r"(?:[A-Za-z0-9_\-]|\\\.)+"
_LITERAL_SEGMENT: Final = re.compile(_LITERAL)
_ONE_SEGMENT: Final = re.compile(rf"{_LITERAL}|\(\?(?::|P<\w+>){_LITERAL}(?:\|{_LITERAL})*\)")
"""Pattern text that matches exactly one path segment: literal text, or a choice of literal texts."""


def route_key(pattern: str) -> str | None:
    """The literal text a route's pattern requires of path segment ``KEY_SEGMENT``, or None where
    that cannot be read off the pattern simply (the route is then tried for every path).

    It can be read off when the pattern, split at ``/``, starts with segments that each match
    exactly one path segment (``_ONE_SEGMENT``) up to that one, which is literal text (followed
    by ``/`` or the pattern's end), and no ``|`` outside a group makes the rest an alternative to
    all of it. A group or class holding a ``/`` is cut by the split and matches neither."""
    segments = pattern.split("/")
    if len(segments) <= KEY_SEGMENT or segments[0] != "" or _top_level_choice(pattern):
        return None
    if not all(_ONE_SEGMENT.fullmatch(segment) for segment in segments[1:KEY_SEGMENT]):
        return None
    key = segments[KEY_SEGMENT]
    if _LITERAL_SEGMENT.fullmatch(key) is None:
        return None
    return key.replace("\\.", ".")


def _top_level_choice(pattern: str) -> bool:
    """Whether ``pattern`` has a ``|`` outside every group (escapes and classes skipped)."""
    depth = 0
    in_class = False
    chars = iter(pattern)
    for char in chars:
        if char == "\\":
            next(chars, None)
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            return True
    return False


class Routes(Protocol):
    """Where servlets are registered: a ``JsonRouter``, or a filter in front of one."""

    def register(self, methods: Iterable[str], pattern: str, handler: Handler, servlet: str) -> None: ...


class JsonRouter(Resource):
    """One Twisted resource that routes every request under it by regex."""

    isLeaf = True

    def __init__(self, metrics: HttpMetrics) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._metrics = metrics
        # The children touched by every request (their labels are servlet names, HTTP method
        # labels and status classes: bounded sets).
        self._requests = Children(metrics.requests)
        self._durations = Children(metrics.duration)
        self._in_flight_by = Children(metrics.in_flight)
        self._routes: list[Route] = []
        # Path segment KEY_SEGMENT -> the routes that may match such a path, in registration order
        # (those of that key and those of none); None for a path whose segment no route names.
        self._by_key: dict[str | None, list[Route]] | None = None
        self._in_flight = 0
        self._drain_waiters: list[Deferred[None]] = []

    def register(self, methods: Iterable[str], pattern: str, handler: Handler, servlet: str) -> None:
        """Route ``methods`` on paths fully matching ``pattern`` to ``handler``."""
        compiled = re.compile(pattern)
        for method in methods:
            self._routes.append(Route(method.upper(), compiled, handler, servlet))
            self._metrics.requests.labels(servlet=servlet, method=method.upper(), status_class="2xx")
        self._metrics.duration.labels(servlet=servlet)
        self._metrics.in_flight.labels(servlet=servlet)
        self._by_key = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def wait_drained(self) -> Deferred[None]:
        """A Deferred that fires once no request is in flight."""
        d: Deferred[None] = Deferred()
        if self._in_flight == 0:
            d.callback(None)
        else:
            self._drain_waiters.append(d)
        return d

    def render(self, request: Request) -> int:
        self._in_flight += 1
        Deferred.fromCoroutine(self._handle(request))
        return NOT_DONE_YET

    async def _handle(self, request: Request) -> None:
        method = request.method.decode("ascii", "replace")
        with log_context(request=f"{method_label(method)}-{next(_request_ids)}", method=method_label(method)):
            await self._handle_in_context(request, method)

    async def _handle_in_context(self, request: Request, method: str) -> None:
        start = time.perf_counter()
        servlet = "unrecognized"
        status = 500
        headers: tuple[tuple[bytes, bytes], ...] = ()
        try:
            status, body, servlet = await self._dispatch(request, method)
        except MatrixError as e:
            status, body = e.status, e.to_json()
        except Unavailable as e:
            status, body, headers = 503, DATABASE_UNAVAILABLE, ((b"Retry-After", str(e.retry_after).encode()),)
        except Exception:
            logger.exception("request %s %s failed", method, _loggable_path(request))
            status, body = 500, {"errcode": "M_UNKNOWN", "error": "Internal server error"}
        finally:
            self._in_flight -= 1
        self._respond(request, status, body, headers)
        duration = time.perf_counter() - start
        self._requests[servlet, method_label(method), f"{status // 100}xx"].inc()
        self._durations[servlet].observe(duration)
        if access_logger.isEnabledFor(logging.INFO):
            peer = request.getClientAddress()
            access_logger.info(
                "%s %s %s %d %.1fms", getattr(peer, "host", "-"), method, _loggable_path(request), status, duration * 1000
            )
        if self._in_flight == 0 and self._drain_waiters:
            waiters, self._drain_waiters = self._drain_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def candidates(self, path: str) -> list[Route]:
        """The routes that may match ``path``, in the order they were registered: a path is tried
        only against the routes its segment ``KEY_SEGMENT`` allows (``route_key``), not all."""
        by_key = self._by_key
        if by_key is None:
            by_key = self._by_key = self._index()
        segments = path.split("/", KEY_SEGMENT + 1)
        key = segments[KEY_SEGMENT] if len(segments) > KEY_SEGMENT else None
        found = by_key.get(key)
        return by_key[None] if found is None else found

    def _index(self) -> dict[str | None, list[Route]]:
        keys = [route_key(route.pattern.pattern) for route in self._routes]
        return {k: [route for route, key in zip(self._routes, keys) if key is None or key == k]
                for k in {*keys, None}}

    async def _dispatch(self, request: Request, method: str) -> tuple[int, Any, str]:
        path = request.path.decode("utf-8", "replace")
        if method == "OPTIONS":
            return 200, {}, "cors_preflight"
        allowed = False
        for route in self.candidates(path):
            match = route.pattern.fullmatch(path)
            if match is None:
                continue
            if route.method != method and not (method == "HEAD" and route.method == "GET"):
                allowed = True
                continue
            try:
                params = {k: unquote(v, errors="strict") for k, v in match.groupdict().items() if v is not None}
            except UnicodeDecodeError:
                raise MatrixError(400, "M_INVALID_PARAM", "Path parameters must be percent-encoded UTF-8") from None
            check_path_params(params)
            set_log_context(servlet=route.servlet)
            if isinstance(request, TributaryRequest):
                request.servlet = route.servlet
                request.path_params = params
            gauge = self._in_flight_by[route.servlet]
            gauge.inc()
            try:
                status, body = await route.handler(request, params)
            finally:
                gauge.dec()
            return status, body, route.servlet
        if allowed:
            raise MatrixError(405, "M_UNRECOGNIZED", f"Method {method} is not allowed on this path")
        raise unrecognized()

    def _respond(self, request: Request, status: int, body: Any, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        if request._disconnected or request.finished:
            return
        payload = body if isinstance(body, bytes) else encode_json(body)
        request.setResponseCode(status)
        if not isinstance(body, bytes) or isinstance(body, EncodedJson):
            request.setHeader(b"Content-Type", b"application/json")
        for name, value in CORS_HEADERS:
            request.setHeader(name, value)
        for name, value in headers:
            request.setHeader(name, value)
        request.setHeader(b"Content-Length", str(len(payload)).encode("ascii"))
        if request.method != b"HEAD":
            request.write(payload)
        transport = getattr(request.channel, "transport", None)  # finish() lets go of the channel
        request.finish()
        send_now(transport)


def send_now(transport: object) -> None:
    """Send what a request wrote to ``transport`` (its channel's) now, not a loop turn later.

    A TCP transport only buffers a write and asks the loop to say when the socket is writable;
    the answer then leaves on the next turn, after the rest of this turn's work (a send's
    post-commit work, the metrics). A socket just read from is almost always writable, so
    this calls the transport's ``doWrite`` (``IWriteDescriptor``'s, what the loop would call)
    at once: the client has its answer while the server finishes the turn, and the turn's
    two system calls are saved. What the socket does not take stays buffered for the loop,
    as before. Only on an open TCP connection that is not closing: a failed send is left to
    the loop too, which calls ``doWrite`` again (the transport stays registered for writing)
    and handles the error as it always does; TLS and a closing connection take the usual path."""
    if type(transport) is not Server or not transport.connected or transport.disconnecting \
            or transport._writeDisconnecting or not (transport._tempDataLen or transport.dataBuffer):
        return
    transport.doWrite()


def _loggable_path(request: Request) -> str:
    # The path only: query strings may carry access tokens.
    return request.path.decode("utf-8", "replace")


def make_site(root: Resource, *, clock: IReactorTime, metrics: HttpMetrics,
              limits: ConnectionLimitsConfig = ConnectionLimitsConfig(),
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              large_bodies: tuple[tuple[tuple[bytes, ...], int], ...] = ()) -> Site:
    """A Site serving ``root``, with our request class, the listener's connection ``limits``
    (homeserver/http/limits.py, timed on ``clock``) and Twisted's own access log off.
    ``large_bodies``: (path prefixes, how many bytes their requests may carry), first match
    wins (uploads; the internal API's bulk operations)."""

    class _Request(TributaryRequest):
        pass

    _Request.max_body_bytes = max_body_bytes
    _Request.large_bodies = large_bodies
    site = LimitedSite(root, limits=limits, clock=clock, metrics=metrics)
    site.requestFactory = _Request
    site.displayTracebacks = False
    site.noisy = False
    site.log = lambda request: None  # type: ignore[method-assign]
    return site
