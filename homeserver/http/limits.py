"""Connection limits of an HTTP listener: header, body and keep-alive deadlines, a per-address cap.

Twisted's own ``HTTPChannel.timeOut`` restarts on every byte received, so a client that sends
its headers one byte a second keeps a connection forever. ``LimitedChannel`` instead tracks
where each connection is in its request (``Phase``) and keeps one timer for that phase, on an
injected clock: headers must be complete by a deadline, a body must keep arriving, a keep-alive
connection may wait only so long for its next request, and nothing runs while a request is
being answered (a long-poll ``/sync`` or a slow handler is never cut). ``LimitedSite`` counts
open connections per client address and refuses one over the cap as it is accepted.
This module does not know what a request asks for; the routing is ``homeserver/http/server.py``'s.
"""

# tests: tests/unit/http/test_limits.py

from __future__ import annotations

import enum
import logging
from collections import Counter as Tally
from typing import Any

from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import Site

from homeserver.config import ConnectionLimitsConfig
from homeserver.http.metrics import HttpMetrics

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
)


class Phase(enum.Enum):
    """Where a connection is; the timed phases name the limit (and metric reason) that ends them."""

    HEADERS = "header_timeout"  # waiting for a request line and headers to be complete
    BODY = "body_timeout"  # waiting for more of a request's body
    PROCESSING = "processing"  # a request is being answered: no limit
    IDLE = "idle_timeout"  # a keep-alive connection waiting for its next request
    CLOSED = "closed"


class LimitedChannel(HTTPChannel):
    """An ``HTTPChannel`` with one timer per phase (``Phase``); ``LimitedSite`` builds it."""

    def __init__(self, site: LimitedSite, host: str | None, *, counted: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._limits_site = site
        self.peer_host = host
        self._counted = counted  # whether it holds one of its address's slots
        self.phase = Phase.HEADERS
        self._timer: IDelayedCall | None = None
        self._released = False  # whether the site was told this connection closed

    def _enter(self, phase: Phase) -> None:
        """Move to ``phase`` and (re)start its timer; the previous phase's timer stops."""
        self.phase = phase
        seconds = self._limits_site.phase_seconds.get(phase)
        if self._timer is not None and self._timer.active():
            if seconds is not None:
                self._timer.reset(seconds)
                return
            self._timer.cancel()
        self._timer = None if seconds is None else self._limits_site.clock.callLater(seconds, self._expired)

    def _expired(self) -> None:
        phase, self._timer = self.phase, None
        self._limits_site.closed(phase.value)
        logger.info("[%s] closing HTTP connection: %s", self.peer_host or "-", phase.value)
        self.phase = Phase.CLOSED
        assert self.transport is not None
        if phase is not Phase.IDLE:  # no response has started: say why
            self.transport.write(REQUEST_TIMEOUT_RESPONSE)
        self.transport.loseConnection()
        # A peer that does not read keeps the 408 in our buffer: drop it after Twisted's grace.
        if self.abortTimeout is not None:
            self._abortingCall = self._limits_site.clock.callLater(self.abortTimeout, self.forceAbortClient)

    def connectionMade(self) -> None:
        super().connectionMade()  # type: ignore[no-untyped-call]
        self._enter(Phase.HEADERS)  # the first request's deadline runs from the connection's start

    def dataReceived(self, data: bytes) -> None:
        if self.phase is Phase.IDLE:
            self._enter(Phase.HEADERS)  # a later request's deadline runs from its first byte
        elif self.phase is Phase.BODY:
            self._enter(Phase.BODY)  # progress: the body limit starts again
        elif self.phase is Phase.CLOSED:
            return
        super().dataReceived(data)  # type: ignore[no-untyped-call]

    def allHeadersReceived(self) -> None:
        super().allHeadersReceived()  # type: ignore[no-untyped-call]
        self._enter(Phase.BODY)  # allContentReceived follows at once when there is no body

    def allContentReceived(self) -> None:
        self._enter(Phase.PROCESSING)
        super().allContentReceived()  # type: ignore[no-untyped-call]

    def requestDone(self, request: Any) -> None:
        # Before Twisted replays pipelined bytes (they then start the next request's deadline).
        self._enter(Phase.IDLE)
        super().requestDone(request)  # type: ignore[no-untyped-call]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.phase = Phase.CLOSED
        if not self._released:
            self._released = True
            self._limits_site.release(self.peer_host if self._counted else None)
        super().connectionLost(reason)  # type: ignore[no-untyped-call]


class _Refused(Protocol):
    """What a connection over the per-address cap gets: closed as soon as it is made."""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.abortConnection()  # type: ignore[attr-defined]


class LimitedSite(Site):
    """A ``Site`` whose channels are ``LimitedChannel``s, at most ``max_connections_per_ip`` per
    capped address (``ConnectionLimitsConfig.is_capped``) open at once."""

    def __init__(self, root: Resource, *, limits: ConnectionLimitsConfig, clock: IReactorTime,
                 metrics: HttpMetrics) -> None:
        super().__init__(root, reactor=clock)  # type: ignore[no-untyped-call]
        self.timeOut = None  # Twisted's idle timeout restarts on every byte; LimitedChannel's do not
        self.limits = limits
        # Each phase's limit in seconds, read at every phase change of every request.
        self.phase_seconds: dict[Phase, float] = {
            Phase.HEADERS: limits.header_timeout.total_seconds(), Phase.BODY: limits.body_timeout.total_seconds(),
            Phase.IDLE: limits.idle_timeout.total_seconds()}
        self.clock = clock
        self._metrics = metrics
        self._open: Tally[str] = Tally()

    def closed(self, reason: str) -> None:
        self._metrics.connections_closed.labels(reason=reason).inc()

    def buildProtocol(self, addr: IAddress | None) -> Any:  # a LimitedChannel, not Twisted's h2 wrapper
        peer = getattr(addr, "host", None)
        host = peer if isinstance(peer, str) else None
        capped = host is not None and self.limits.is_capped(host)
        if host is not None and capped and self._open[host] >= self.limits.max_connections_per_ip:
            self.closed("per_ip_cap")
            logger.info("[%s] refusing HTTP connection: %d open from this address", host, self._open[host])
            refused = _Refused()
            refused.factory = self
            return refused
        channel = LimitedChannel(self, host, counted=capped)
        channel.factory = self
        channel.requestFactory = self.requestFactory
        channel.site = self  # type: ignore[attr-defined]
        channel.timeOut = None
        if host is not None and capped:
            self._open[host] += 1
        self._metrics.connections_open.inc()
        return channel

    def release(self, host: str | None) -> None:
        """A channel closed: its slot (``host``'s, when that address is capped) is free."""
        self._metrics.connections_open.dec()
        if host is not None:
            self._open[host] -= 1
            if self._open[host] <= 0:
                del self._open[host]

    def open_connections(self, host: str) -> int:
        return self._open[host]
