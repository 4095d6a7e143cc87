"""Requests to application services: transactions, user and alias queries, third-party
lookups and pings, each with the service's ``hs_token`` as ``Authorization: Bearer``.

A service's URL comes from the operator's registration file, so it is trusted (a bridge
usually listens on loopback); unlike a push gateway's, it is not checked against IP ranges.
Answers are bounded in size and time; a failure to connect or a timeout raises
``ServiceUnreachable``.
"""

# tests: tests/integration/test_appservice.py

from __future__ import annotations

import json
from collections.abc import Mapping
from io import BytesIO
from typing import Any, Final
from urllib.parse import quote, urlencode

from twisted.internet.defer import Deferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from homeserver.appservice.registration import AppService

MAX_RESPONSE_BYTES: Final = 1024 * 1024


class ServiceUnreachable(Exception):
    """No answer: the connection failed or the service took too long."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class AppServiceClient:
    def __init__(self, reactor: Any, *, timeout: float) -> None:
        self._reactor = reactor
        self._timeout = timeout
        # A connection per request: a service that stopped is seen to have stopped, and a
        # transaction is never resent behind our back on a stale connection.
        self._pool = HTTPConnectionPool(reactor, persistent=False)
        self._pool.retryAutomatically = False
        self._agent = Agent(reactor, pool=self._pool, connectTimeout=min(timeout, 10.0))

    async def request(self, service: AppService, method: str, path: str, *, body: Mapping[str, Any] | None = None,
                      query: Mapping[str, str] | None = None) -> tuple[int, Any]:
        """(status, parsed JSON body or None). ``path`` starts with ``/_matrix/app/v1/``."""
        if service.url is None:
            raise ServiceUnreachable(f"application service {service.id} has no url")
        url = service.url + path + (("?" + urlencode(query)) if query else "")
        headers = Headers({b"Authorization": [f"Bearer {service.hs_token}".encode()],
                           b"User-Agent": [b"Tributary"]})
        producer = None
        if body is not None:
            headers.addRawHeader(b"Content-Type", b"application/json")
            payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            producer = FileBodyProducer(BytesIO(payload))
        try:
            pending: Deferred[Any] = self._agent.request(method.encode("ascii"), url.encode("utf-8"), headers, producer)
            pending.addTimeout(self._timeout, self._reactor)
            response = await pending
            if isinstance(response.length, int) and response.length > MAX_RESPONSE_BYTES:
                response.deliverBody(_Discard())
                return int(response.code), None
            read: Deferred[bytes] = readBody(response)
            read.addTimeout(self._timeout, self._reactor)
            raw = await read
        except Exception as e:  # noqa: BLE001 - the adapter: any failure to get an answer is "no answer"
            raise ServiceUnreachable(f"{type(e).__name__}: {e}", timed_out=isinstance(e, DeferredTimeout)) from e
        try:
            parsed = json.loads(raw) if raw and len(raw) <= MAX_RESPONSE_BYTES else None
        except ValueError:
            parsed = None
        return int(response.code), parsed

    async def send_transaction(self, service: AppService, txn_id: int, body: Mapping[str, Any]) -> int:
        status, _ = await self.request(service, "PUT", f"/_matrix/app/v1/transactions/{txn_id}", body=body)
        return status

    async def query_user(self, service: AppService, user_id: str) -> bool:
        """Whether the service says it has (now) created ``user_id``."""
        status, _ = await self.request(service, "GET", "/_matrix/app/v1/users/" + quote(user_id, safe=""))
        return 200 <= status < 300

    async def query_alias(self, service: AppService, alias: str) -> bool:
        status, _ = await self.request(service, "GET", "/_matrix/app/v1/rooms/" + quote(alias, safe=""))
        return 200 <= status < 300

    def close(self) -> Deferred[Any]:
        closed: Deferred[Any] = self._pool.closeCachedConnections()
        return closed


class _Discard:
    def dataReceived(self, data: bytes) -> None:
        pass

    def connectionLost(self, reason: Any) -> None:
        pass

    def makeConnection(self, transport: Any) -> None:
        transport.stopProducing()
