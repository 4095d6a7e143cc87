# tests: tests/unit/replication/test_transport.py tests/integration/test_replication_tcp.py
"""The TCP transport of replication.

This module owns the Twisted side of a replication connection: a
``LineOnlyReceiver`` that feeds lines to the sans-I/O ``ReplicationConnection``
and writes what it returns, a ``LoopingCall`` on an injected clock for
keep-alives and timeouts, producer/consumer flow control mapped to
``pause_writing``/``resume_writing``, the listening factory of the main process,
the reconnecting client factory of workers (``replication.reconnect``'s
backoff), and the metrics and log lines of all of it. Protocol decisions live in
``connection.py``; what commands mean lives in ``handler.py``; which transport a
process uses is ``replication.service``'s choice.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import random
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IConnector, IDelayedCall, IReactorTime
from twisted.internet.protocol import ClientFactory, ServerFactory, connectionDone
from twisted.internet.task import LoopingCall, deferLater
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from replication.commands import MAX_LINE_LENGTH, Command, ErrorCommand, ServerCommand
from replication.connection import (
    Closed,
    CommandReceived,
    ConnectionConfig,
    ConnectionState,
    Event,
    LineIgnored,
    ReplicationConnection,
    Role,
    Trigger,
)
from replication.handler import ReplicationHandler
from replication.metrics import ReplicationMetrics, TransportCounters
from replication.reconnect import backoff_delay
from storage.kernel.background import run_in_background

__all__ = [
    "ReplicationClientFactory",
    "ReplicationProtocol",
    "ReplicationServerFactory",
    "TICK_INTERVAL_SECONDS",
    "TwistedScheduler",
    "UnsafeReplicationListener",
    "check_listener_addresses",
]

logger = logging.getLogger(__name__)

#: How often each connection's ``tick`` runs (keep-alive and timeout checks).
TICK_INTERVAL_SECONDS: Final = 1.0

#: After closing, the transport gets this long to write the final ERROR before
#: the socket is aborted (a peer that stopped reading never drains it).
CLOSE_GRACE_SECONDS: Final = 5.0

_connection_ids = itertools.count(1)


class TwistedScheduler:
    """The handler's ``Scheduler`` on a Twisted clock (the reactor, or a
    ``task.Clock`` in tests); coroutines run as Twisted coroutines, so they
    may await Deferreds."""

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock

    def call_later(self, delay: float, action: Callable[[], None]) -> IDelayedCall:
        return self.clock.callLater(delay, action)

    def sleep(self, delay: float) -> Deferred[None]:
        return deferLater(self.clock, delay)

    def run_in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        run_in_background("replication", coro)


def _describe(address: IAddress | None) -> str:
    host = getattr(address, "host", None)
    port = getattr(address, "port", None)
    return f"{host}:{port}" if host is not None else str(address)


class ReplicationProtocol(LineOnlyReceiver):
    """One TCP replication connection, either end: lines to the core, events
    to the handler, the core's lines to the socket. Also the handler's
    ``Channel`` for this connection."""

    delimiter = b"\n"
    MAX_LENGTH = MAX_LINE_LENGTH

    def __init__(
        self,
        role: Role,
        name: str,
        config: ConnectionConfig,
        handler: ReplicationHandler,
        clock: IReactorTime,
        metrics: ReplicationMetrics,
        on_handshake: Callable[[], None] | None = None,
    ) -> None:
        self.conn = ReplicationConnection(role, name, config)
        self.kind = "tcp_server" if role is Role.SERVER else "tcp_client"
        self.relay = role is Role.SERVER
        self.broadcast = False
        self._handler = handler
        self._clock = clock
        self._counters: TransportCounters = metrics.transport(self.kind)
        self._on_handshake = on_handshake
        self._ticker: LoopingCall | None = None
        self._held = 0
        self._reading_paused = False
        self._abort: IDelayedCall | None = None
        self._tcp: Any = None
        self._now = 0.0
        self.conn_id = f"{self.kind}-{next(_connection_ids)}"

    # -- Channel -------------------------------------------------------------

    @property
    def peer_name(self) -> str | None:
        return self.conn.peer_name

    def may_send(self, command_name: str) -> bool:
        return self.conn.state is ConnectionState.OPEN and self.conn.config.rules.may_send(self.conn.role, command_name)

    def writable(self) -> Deferred[None] | None:
        return None

    def send_commands(self, commands: Sequence[Command]) -> None:
        if self.conn.state is not ConnectionState.OPEN:
            return
        now = self._clock.seconds()
        send = self.conn.send
        counts: dict[str, int] = {}
        try:
            for command in commands:
                events = send(command, now)
                counts[command.NAME] = counts.get(command.NAME, 0) + 1
                if events:
                    self._handle(events)
                    return
        finally:
            for name, count in counts.items():
                self._counters.sent[name].inc(count)
        self._flush()

    # -- Twisted --------------------------------------------------------------

    def connectionMade(self) -> None:
        # A TCP transport (ITCPTransport, IConsumer, IPushProducer); Twisted's
        # interfaces do not compose for mypy, so it is typed Any here.
        self._tcp = self.transport
        # Commands are small and latency matters: no Nagle delay.
        no_delay = getattr(self._tcp, "setTcpNoDelay", None)  # TCP only, not UNIX sockets
        if no_delay is not None:
            no_delay(True)
        peer = _describe(self._tcp.getPeer())
        self.conn_id = f"{self.conn_id} {peer}"
        self._counters.connections.inc()
        logger.info("[%s] replication connection open", self.conn_id)
        self._tcp.registerProducer(self, True)
        self._ticker = LoopingCall(self._tick)
        self._ticker.clock = self._clock
        self._ticker.start(TICK_INTERVAL_SECONDS, now=False)
        self.conn.start(self._clock.seconds())
        self._handler.on_connected(self)
        self._flush()

    def dataReceived(self, data: bytes) -> None:
        # One timestamp per chunk read from the socket, not per line.
        self._now = self._clock.seconds()
        super().dataReceived(data)  # type: ignore[no-untyped-call]
        if self._handler.backlogged and not self._reading_paused and self.conn.state is ConnectionState.OPEN:
            # The handler holds too much (a catch-up is running): stop reading
            # until it drains. If that takes long, the writer cuts us off for
            # congestion and we catch up from the database.
            self._reading_paused = True
            self._tcp.pauseProducing()
            self._handler.call_when_drained(self._resume_reading)

    def lineReceived(self, line: bytes) -> None:
        conn = self.conn
        if conn.state is not ConnectionState.OPEN:
            return
        events = conn.receive_line(line, self._now)
        if not events:
            return
        event = events[0]
        if len(events) == 1 and type(event) is CommandReceived:
            # The hot path: one command, nothing queued for the peer.
            command = event.command
            self._counters.received[command.NAME].inc()
            try:
                self._on_command(command)
            except Exception:
                self._internal_error()
                self._finish_io()
            return
        self._handle(events)

    def _resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            if self.conn.state is ConnectionState.OPEN:
                self._tcp.resumeProducing()

    def lineLengthExceeded(self, line: bytes) -> None:
        # The core rejects it as too long, queues ERROR and closes.
        self.lineReceived(line[: MAX_LINE_LENGTH + 1])
        self._buffer = b""

    def pauseProducing(self) -> None:
        self.conn.pause_writing()

    def resumeProducing(self) -> None:
        if self.conn.state is ConnectionState.OPEN:
            self.conn.resume_writing()
            self._flush()

    def stopProducing(self) -> None:
        pass

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._ticker is not None and self._ticker.running:
            self._ticker.stop()
        if self._abort is not None and self._abort.active():
            self._abort.cancel()
        if self.conn.closed is None:
            self.conn.close()
            self._counters.disconnects["connection_lost"].inc()
            logger.info("[%s] replication connection lost: %s", self.conn_id, reason.getErrorMessage())
        self._counters.connections.dec()
        self._set_held(0)
        self._handler.on_disconnected(self)

    # -- core plumbing --------------------------------------------------------

    def close(self, message: str | None = None) -> None:
        """End the connection from this side, with ``ERROR message`` if given."""
        self._handle(self.conn.close(message))

    def _tick(self) -> None:
        if self.conn.state is ConnectionState.OPEN:
            self._handle(self.conn.tick(self._clock.seconds()))

    def _internal_error(self) -> None:
        """A handler raised: our bug. Log it, tell the peer, close."""
        logger.exception("[%s] replication handler failed; closing the connection", self.conn_id)
        if self.conn.closed is None:
            self._counters.disconnects["internal_error"].inc()
            self.conn.close("internal error")

    def _handle(self, events: list[Event]) -> None:
        try:
            for event in events:
                match event:
                    case CommandReceived(command=command):
                        self._counters.received[command.NAME].inc()
                        self._on_command(command)
                    case LineIgnored(line=line, reason=reason):
                        self._counters.lines_ignored.inc()
                        logger.warning("[%s] ignored line %r: %s", self.conn_id, line, reason)
                    case Closed(reason=reason, message=message):
                        self._counters.disconnects[reason.value].inc()
                        level = logging.INFO if reason is Trigger.CLOSE else logging.WARNING
                        logger.log(level, "[%s] closing replication connection (%s): %s", self.conn_id, reason.value, message)
        except Exception:
            self._internal_error()
        self._finish_io()

    def _finish_io(self) -> None:
        """Write what the core queued; if it is finished, close the socket."""
        self._flush()
        if self.conn.closed is not None and self._abort is None:
            # A transport with a registered producer never finishes closing.
            self._tcp.unregisterProducer()
            self._tcp.loseConnection()
            self._abort = self._clock.callLater(CLOSE_GRACE_SECONDS, self._tcp.abortConnection)

    def _on_command(self, command: Command) -> None:
        match command:
            case ServerCommand(server_name=server_name):
                logger.info("[%s] connected to replication server %s", self.conn_id, server_name)
                if self._on_handshake is not None:
                    self._on_handshake()
            case ErrorCommand(message=message):
                logger.warning("[%s] peer reported error: %s", self.conn_id, message)
            case _:
                pass
        self._handler.on_command(self, command)

    def _flush(self) -> None:
        if self.conn.buffered:
            lines = self.conn.pending_lines()
            if lines:
                lines.append("")
                try:
                    self._tcp.write("\n".join(lines).encode("utf-8"))
                except RuntimeError as e:
                    # Seen once under uvloop: the event loop had closed the
                    # socket's poll handle without telling Twisted, so the
                    # connection is dead but was never reported lost.
                    self._socket_broken(e)
        if self.conn.buffered != self._held:
            self._set_held(self.conn.buffered)

    def _socket_broken(self, error: Exception) -> None:
        logger.warning("[%s] replication socket unusable (%s); dropping the connection", self.conn_id, error)
        if self.conn.closed is None:
            self.conn.close()
        for drop in (self._tcp.abortConnection, lambda: self._tcp.connectionLost(Failure(error))):
            try:
                drop()
                return
            except RuntimeError:
                continue

    def _set_held(self, held: int) -> None:
        if held != self._held:
            self._counters.outbound_buffer.inc(held - self._held)
            self._held = held


class ReplicationServerFactory(ServerFactory):
    """The main process's ``replication`` listener: one ``ReplicationProtocol``
    (server role) per accepted connection, all feeding one handler."""

    def __init__(
        self,
        server_name: str,
        handler: ReplicationHandler,
        clock: IReactorTime,
        metrics: ReplicationMetrics,
        config: ConnectionConfig = ConnectionConfig(),
    ) -> None:
        ServerCommand(server_name)
        self.server_name = server_name
        self.handler = handler
        self.clock = clock
        self.metrics = metrics
        self.config = config
        self.connections: set[ReplicationProtocol] = set()

    def buildProtocol(self, addr: IAddress | None) -> ReplicationProtocol:
        protocol = _TrackedProtocol(
            self.connections, Role.SERVER, self.server_name, self.config, self.handler, self.clock, self.metrics
        )
        protocol.factory = self
        return protocol

    def close_all(self, message: str) -> None:
        for protocol in list(self.connections):
            protocol.close(message)


class _TrackedProtocol(ReplicationProtocol):
    def __init__(self, registry: set[ReplicationProtocol], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._registry = registry

    def connectionMade(self) -> None:
        self._registry.add(self)
        super().connectionMade()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._registry.discard(self)
        super().connectionLost(reason)


class ReplicationClientFactory(ClientFactory):
    """A worker's connection to the main process: reconnects after any loss
    or failed attempt, after ``backoff_delay(attempt)``; the attempt count
    resets once a connection gets the server's ``SERVER``."""

    def __init__(
        self,
        instance_name: str,
        handler: ReplicationHandler,
        clock: IReactorTime,
        metrics: ReplicationMetrics,
        config: ConnectionConfig = ConnectionConfig(),
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.instance_name = instance_name
        self.handler = handler
        self.clock = clock
        self.metrics = metrics
        self.config = config
        self._rand = rand
        self.attempts = 0
        self.protocol_instance: ReplicationProtocol | None = None
        self._retry: IDelayedCall | None = None
        self._connector: IConnector | None = None
        self._stopping = False

    def buildProtocol(self, addr: IAddress | None) -> ReplicationProtocol:
        protocol = ReplicationProtocol(
            Role.CLIENT, self.instance_name, self.config, self.handler, self.clock, self.metrics,
            on_handshake=self._reset_backoff,
        )
        protocol.factory = self
        self.protocol_instance = protocol
        return protocol

    def _reset_backoff(self) -> None:
        self.attempts = 0

    def startedConnecting(self, connector: IConnector) -> None:
        self._connector = connector

    def clientConnectionLost(self, connector: IConnector, reason: Failure) -> None:
        self.protocol_instance = None
        self._schedule(connector, reason)

    def clientConnectionFailed(self, connector: IConnector, reason: Failure) -> None:
        self._schedule(connector, reason)

    def _schedule(self, connector: IConnector, reason: Failure) -> None:
        if self._stopping:
            return
        self.attempts += 1
        delay = backoff_delay(self.attempts, self._rand)
        logger.info(
            "replication: connection to %s ended (%s); reconnecting in %.2f s (attempt %d)",
            _describe(connector.getDestination()), reason.getErrorMessage(), delay, self.attempts,
        )
        self._retry = self.clock.callLater(delay, self._reconnect, connector)

    def _reconnect(self, connector: IConnector) -> None:
        self._retry = None
        if not self._stopping:
            connector.connect()

    def stop(self) -> None:
        """Stop reconnecting and drop the current connection, if any."""
        self._stopping = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self.protocol_instance is not None:
            self.protocol_instance.close()
        elif self._connector is not None:
            self._connector.disconnect()


# --------------------------------------------------------------------------
# Where the TCP listener may listen (checked by ``replication.service``).


class UnsafeReplicationListener(ValueError):
    """A replication listener would be reachable from other machines, and the
    operator did not opt in with ``allow_unauthenticated_replication``."""


def check_listener_addresses(addresses: Sequence[str], allow_unauthenticated: bool) -> None:
    """Refuse non-loopback addresses for the unauthenticated TCP protocol."""
    if allow_unauthenticated:
        return
    for address in addresses:
        if not ipaddress.ip_address(address).is_loopback:
            raise UnsafeReplicationListener(
                f"the replication listener would listen on {address}, which is not a loopback address; "
                "the TCP replication protocol has no authentication. Use Redis (with a password, or "
                "rediss:// for TLS) between machines, or set allow_unauthenticated_replication: true"
            )
