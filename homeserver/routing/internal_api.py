"""The internal HTTP replication API: one process asks another to do a write it owns.

Every process serves ``POST /_tributary/replication/{name}`` on its listeners
with the ``replication`` resource (the address ``instance_map`` gives for it).
A request carries ``Authorization: Bearer <worker_replication_secret>``; without
the secret it gets ``403 M_FORBIDDEN`` and nothing runs. Bodies and answers are
JSON objects. An operation that fails with a ``MatrixError`` answers with that
error's status and JSON, and the caller raises the same ``MatrixError``, so a
client sees the owner's verdict unchanged whichever process it asked.

``InternalApiServer`` declares each operation by name as a route (``Caller.WORKER``: the
gate checks the secret, ``SharedSecret``; ``Body.OBJECT``);
``InternalApiClient`` calls them on another instance over pooled HTTP/1.1
connections. A call that could not be delivered (connection refused: the owner
is restarting) is retried with backoff for ``retry_for`` seconds; a call that
was delivered is never repeated here (the caller's own retry, with its
transaction ID, is what makes a write idempotent).
"""

# tests: tests/integration/test_workers.py

from __future__ import annotations

import hmac
from io import BytesIO
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError, ConnectionRefusedError
from twisted.web.client import (
    Agent,
    FileBodyProducer,
    HTTPConnectionPool,
    PartialDownloadError,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from storage.kernel.backoff import BackoffPolicy
from storage.kernel.errors import MatrixError, bad_json, forbidden
from homeserver.http.routes import Body, Call, Caller, Endpoint, Gate, Response, serve
from homeserver.http.server import Routes
from homeserver.routing.layout import Layout

logger = logging.getLogger(__name__)

PREFIX: Final = "/_tributary/replication"

Operation = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


# An unreachable owner (restarting, say) is retried after 50 ms, doubling up to 2 s.
_RETRY: Final = BackoffPolicy(initial=0.05, multiplier=2.0, maximum=2.0)

class SharedSecret:
    """The gate's check of a call from another process: ``Authorization: Bearer <secret>``."""

    def __init__(self, secret: str | None) -> None:
        self._secret = (secret or "").encode("utf-8")

    def check(self, request: Request) -> None:
        header = request.getHeader(b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        if not self._secret or scheme != b"Bearer" or not hmac.compare_digest(token, self._secret):
            raise forbidden("the internal replication API needs worker_replication_secret")


class InternalApiServer:
    """The operations this process performs for others, each a route behind the shared secret."""

    def __init__(self, router: Routes, secret: str | None) -> None:
        self._router = router
        self._gate = Gate(workers=SharedSecret(secret))
        self._names: set[str] = set()

    def register(self, name: str, operation: Operation) -> None:
        if name in self._names:
            raise ValueError(f"internal API operation {name!r} registered twice")
        self._names.add(name)

        async def handle(call: Call) -> Response:
            try:
                return 200, await operation(call.content)
            except (KeyError, TypeError, ValueError) as e:
                # Only our own processes call this (they hold the secret): a malformed body means
                # mismatched versions. Say so, without a 500; the traceback helps find which field.
                logger.warning("malformed %s request: %r", name, e, exc_info=True)
                raise bad_json(f"malformed {name} request: {e!r}") from None

        serve(self._router, self._gate,
              [Endpoint("POST", f"{PREFIX}/{name}", f"replication_{name}", Caller.WORKER, handle, Body.OBJECT)])


class InternalApiError(MatrixError):
    """The owner could not be asked, or did not answer (it is restarting, or it crashed
    mid-request). The client sees ``503``; retrying the request (with the same transaction
    ID, for a send) is safe."""

    def __init__(self, message: str) -> None:
        super().__init__(503, "M_UNKNOWN", message)


class InternalApiClient:
    """Calls another instance's internal API operations."""

    def __init__(self, reactor: Any, layout: Layout, secret: str | None, *, retry_for: float = 30.0) -> None:
        self._reactor = reactor
        self._layout = layout
        self._auth = f"Bearer {secret or ''}".encode("utf-8")
        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = 16
        pool.retryAutomatically = False  # a delivered write is never silently repeated
        self._pool = pool
        self._agent = Agent(reactor, pool=pool, connectTimeout=5)
        self._retry_for = retry_for

    async def call(self, instance: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Run operation ``name`` on ``instance``; its answer, or the ``MatrixError`` it raised."""
        location = self._layout.location(instance)
        url = f"http://{location.host}:{location.port}{PREFIX}/{name}".encode("ascii")
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        deadline = self._reactor.seconds() + self._retry_for
        delay = _RETRY.initial
        while True:
            try:
                response = await self._agent.request(
                    b"POST", url,
                    Headers({b"Authorization": [self._auth], b"Content-Type": [b"application/json"]}),
                    FileBodyProducer(BytesIO(payload)),
                )
                break
            except (ResponseNeverReceived, ResponseFailed) as e:
                # Delivered, maybe acted on, but unanswered: never repeat it here.
                logger.warning("%s did not answer %s: %s", instance, name, e)
                raise InternalApiError(f"{instance} did not answer {name}; the request may be retried") from None
            except (ConnectError, ConnectionRefusedError) as e:
                if self._reactor.seconds() + delay > deadline:
                    raise InternalApiError(f"{instance} is unreachable for {name}: {e}") from None
                logger.info("%s unreachable for %s (%s); retrying in %.2fs", instance, name, e, delay)
                await _sleep(self._reactor, delay)
                delay = _RETRY.next_interval(delay)
        try:
            raw = await readBody(response)
        except (ResponseFailed, PartialDownloadError) as e:
            raise InternalApiError(f"{instance} broke off its answer to {name}: {e}") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            raise InternalApiError(f"{instance} answered {name} with {response.code} and no JSON") from None
        if not isinstance(answer, dict):
            raise InternalApiError(f"{instance} answered {name} with a non-object")
        if response.code != 200:
            errcode = answer.pop("errcode", "M_UNKNOWN")
            error = answer.pop("error", f"{instance} failed {name}")
            raise MatrixError(response.code, str(errcode), str(error), **answer)
        return answer

    async def close(self) -> None:
        await self._pool.closeCachedConnections()


def _sleep(reactor: Any, seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d
