# tests: tests/integration/test_replication_redis.py
"""The Redis pub/sub transport of replication.

This module owns one process's session with Redis: a subscriber connection on
the channel named after the server and a publisher connection, one
``ReplicationConnection`` (``REDIS_RULES``: everyone may send everything, bad
lines are ignored, no keep-alive) per session, batched and pipelined PUBLISH,
dropping this process's own echoes, and reconnecting with backoff (each new
session sends ``REPLICATE`` again, and the handler re-announces positions).
It is asyncio code (redis.asyncio) on the reactor's event loop; Twisted code
awaits it through ``Deferred.fromFuture(asyncio.ensure_future(...))``.

Framing: one Redis message carries one command line, or, when several are
waiting, up to ``max_lines_per_message`` lines separated by ``\\n``, because
redis-py's pure-Python reader costs tens of microseconds per message (see
docs/replication.md). ``max_lines_per_message=1`` gives exactly one command
per message, as Synapse publishes.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any, Final

import redis.asyncio as aioredis
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from replication.commands import Command
from replication.connection import (
    REDIS_RULES,
    Closed,
    CommandReceived,
    ConnectionConfig,
    ConnectionState,
    Event,
    LineIgnored,
    ReplicationConnection,
    Role,
)
from replication.handler import ReplicationHandler
from replication.metrics import ReplicationMetrics
from replication.reconnect import backoff_delay

__all__ = ["DEFAULT_LINES_PER_MESSAGE", "REDIS_CONNECTION_CONFIG", "RedisTransport"]

logger = logging.getLogger(__name__)

#: The core's settings over Redis: keep-alive and timeout off (Redis watches
#: its own connections), bad lines ignored.
REDIS_CONNECTION_CONFIG: Final = ConnectionConfig(keepalive_interval=None, timeout=None, rules=REDIS_RULES)

#: Lines packed into one PUBLISH when several are waiting.
DEFAULT_LINES_PER_MESSAGE: Final = 100

#: Bytes packed into one PUBLISH, at most (a single longer line still goes alone).
MAX_MESSAGE_BYTES: Final = 64 * 1024

#: Seconds to wait for Redis to confirm the subscription.
SUBSCRIBE_TIMEOUT_SECONDS: Final = 10.0

# Commands that carry no instance name: an echo is recognised by its exact
# line, counted when published.
_ANONYMOUS_PREFIXES: Final = (b"REPLICATE", b"PING", b"REMOTE_SERVER_UP", b"ERROR", b"NAME", b"SERVER")
_INSTANCE_THIRD: Final = frozenset({b"RDATA", b"POSITION"})
_INSTANCE_SECOND: Final = frozenset({b"USER_SYNC", b"CLEAR_USER_SYNC", b"FEDERATION_ACK"})


class _SessionEnded(Exception):
    """The session's connection closed (congestion); start a new one."""


class RedisTransport:
    """One process's replication over Redis pub/sub, and the handler's
    ``Channel`` for it (``broadcast``: what it sends reaches every process)."""

    kind = "redis"
    relay = False
    broadcast = True

    def __init__(
        self,
        *,
        url: str,
        channel: str,
        instance_name: str,
        handler: ReplicationHandler,
        clock: IReactorTime,
        metrics: ReplicationMetrics,
        config: ConnectionConfig = REDIS_CONNECTION_CONFIG,
        max_lines_per_message: int = DEFAULT_LINES_PER_MESSAGE,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if max_lines_per_message < 1:
            raise ValueError(f"max_lines_per_message must be at least 1, got {max_lines_per_message}")
        self._url = url
        self.channel = channel
        self.instance_name = instance_name
        self._me = instance_name.encode("utf-8")
        #: Prefix of the Redis client names of this process's connections.
        self.client_name = f"tributary-replication-{instance_name}"
        self._handler = handler
        self._clock = clock
        self._counters = metrics.transport(self.kind)
        self._metrics = metrics
        self._config = config
        self._max_lines = max_lines_per_message
        self._rand = rand
        self._conn: ReplicationConnection | None = None
        self._publisher: aioredis.Redis | None = None
        self._echoes: dict[bytes, int] = {}
        self._flushing: ReplicationConnection | None = None
        self._writable_waiters: list[asyncio.Future[None]] = []
        self._failed: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected_waiters: list[asyncio.Future[None]] = []
        self._stopping = False
        self.sessions = 0
        self.attempts = 0

    # -- Channel --------------------------------------------------------------

    @property
    def peer_name(self) -> str | None:
        return f"redis channel {self.channel}"

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.state is ConnectionState.OPEN

    def may_send(self, command_name: str) -> bool:
        return self.connected and self._config.rules.may_send(Role.CLIENT, command_name)

    def send_commands(self, commands: Sequence[Command]) -> None:
        conn = self._conn
        if conn is None or conn.state is not ConnectionState.OPEN:
            self._metrics.commands_dropped.labels(self.kind).inc(len(commands))
            return
        now = self._clock.seconds()
        sent = self._counters.sent
        for command in commands:
            events = conn.send(command, now)
            sent[command.NAME].inc()
            if events:
                self._handle(events)
                return
        self._kick()

    def writable(self) -> Deferred[None] | None:
        conn = self._conn
        if conn is None or conn.buffered < self._config.max_outbound_buffer // 2:
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writable_waiters.append(waiter)
        return Deferred.fromFuture(waiter)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start connecting (and reconnecting) in the background; see
        ``wait_connected``."""
        if self._task is None:
            self._stopping = False
            self._task = asyncio.ensure_future(self._run())

    def wait_connected(self) -> Deferred[None]:
        """Fires once a session is open (at once if it is)."""
        future: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        if self.connected:
            future.set_result(None)
        else:
            self._connected_waiters.append(future)
        return Deferred.fromFuture(future)

    def stop(self) -> Deferred[None]:
        """Publish what is queued (briefly), then close and stop reconnecting."""
        return Deferred.fromFuture(asyncio.ensure_future(self._stop()))

    async def _stop(self) -> None:
        self._stopping = True
        conn = self._conn
        if conn is not None and conn.state is ConnectionState.OPEN and (conn.buffered or self._flushing is conn):
            try:
                await asyncio.wait_for(self._flushed(), timeout=2.0)
            except (asyncio.TimeoutError, aioredis.RedisError, OSError):
                pass
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    async def _flushed(self) -> None:
        while self._conn is not None and (self._conn.buffered or self._flushing is self._conn):
            await asyncio.sleep(0.01)

    # -- sessions -------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            started = False
            try:
                started = await self._session()
            except asyncio.CancelledError:
                raise
            except (aioredis.RedisError, OSError, _SessionEnded) as e:
                logger.warning("[redis %s] replication session ended: %s", self.channel, e)
            except Exception:
                logger.exception("[redis %s] replication session failed", self.channel)
            if self._stopping:
                break
            self.attempts = 1 if started else self.attempts + 1
            delay = backoff_delay(self.attempts, self._rand)
            logger.info("[redis %s] reconnecting in %.2f s (attempt %d)", self.channel, delay, self.attempts)
            await asyncio.sleep(delay)

    async def _session(self) -> bool:
        """One connection to Redis, until it fails. Returns whether it got as
        far as being subscribed (so the backoff starts over)."""
        # RESP2: redis-py's RESP3 reader recurses once per queued push message.
        # Named, so that ``CLIENT LIST`` shows which process is which.
        subscriber = aioredis.Redis.from_url(self._url, protocol=2, client_name=f"{self.client_name}-sub")
        publisher = aioredis.Redis.from_url(self._url, protocol=2, client_name=f"{self.client_name}-pub")
        pubsub = subscriber.pubsub()
        conn: ReplicationConnection | None = None
        reader: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        try:
            await pubsub.subscribe(self.channel)
            await asyncio.wait_for(self._confirmed(pubsub), SUBSCRIBE_TIMEOUT_SECONDS)
            await publisher.ping()
            conn = ReplicationConnection(Role.CLIENT, self.instance_name, self._config)
            self._conn, self._publisher = conn, publisher
            self._echoes.clear()
            self._failed = loop.create_future()
            conn.start(self._clock.seconds())  # queues REPLICATE
            self.sessions += 1
            self._counters.connections.inc()
            logger.info("[redis %s] replication connected as %s", self.channel, self.instance_name)
            self._handler.on_connected(self)
            self._kick()
            waiters, self._connected_waiters = self._connected_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            reader = asyncio.ensure_future(self._read(pubsub, conn))
            failed = self._failed
            await asyncio.wait({reader, failed}, return_when=asyncio.FIRST_COMPLETED)
            for done in (reader, failed):
                if done.done() and not done.cancelled():
                    error = done.exception()
                    if error is not None:
                        raise error
            return True
        finally:
            if reader is not None:
                reader.cancel()
                try:
                    await reader
                except (asyncio.CancelledError, Exception):
                    pass
            if conn is not None:
                self._end_session(conn)
            for client in (pubsub, subscriber, publisher):
                try:
                    await client.aclose()
                except Exception:
                    pass

    @staticmethod
    async def _confirmed(pubsub: Any) -> None:
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=SUBSCRIBE_TIMEOUT_SECONDS)
            if message is not None and message["type"] == "subscribe":
                return

    def _end_session(self, conn: ReplicationConnection) -> None:
        if conn.closed is None:
            conn.close()
            self._counters.disconnects["connection_lost"].inc()
        dropped = len(conn.pending_lines()) if conn.state is not ConnectionState.OPEN else 0
        if dropped:
            self._metrics.commands_dropped.labels(self.kind).inc(dropped)
        self._counters.outbound_buffer.set(0)
        self._conn = None
        self._publisher = None
        self._counters.connections.dec()
        self._wake_writers()
        self._handler.on_disconnected(self)

    def _fail(self, conn: ReplicationConnection, error: BaseException) -> None:
        """End the session of ``conn``, if it is still the current one."""
        if conn is self._conn and self._failed is not None and not self._failed.done():
            self._failed.set_exception(error)

    # -- inbound --------------------------------------------------------------

    async def _read(self, pubsub: Any, conn: ReplicationConnection) -> None:
        handler = self._handler
        loop = asyncio.get_running_loop()
        while conn.state is ConnectionState.OPEN:
            if handler.backlogged:
                # Stop reading until the handler catches up; Redis buffers
                # meanwhile, and drops us if its buffer fills, after which we
                # reconnect and catch up from the database.
                drained: asyncio.Future[None] = loop.create_future()

                def wake(future: asyncio.Future[None] = drained) -> None:
                    if not future.done():
                        future.set_result(None)

                handler.call_when_drained(wake)
                await drained
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
            if message is None or message["type"] != "message":
                continue
            now = self._clock.seconds()
            for line in message["data"].split(b"\n"):
                if not line or self._is_own(line):
                    continue
                events = conn.receive_line(line, now)
                if events:
                    self._handle(events)

    def _is_own(self, line: bytes) -> bool:
        """This process's own echo: a command naming this instance, or an
        instance-less line it published and has not seen back yet."""
        name, _, rest = line.partition(b" ")
        if name in _INSTANCE_THIRD:
            parts = rest.split(b" ", 2)
            return len(parts) > 1 and parts[1] == self._me
        if name in _INSTANCE_SECOND:
            return rest.split(b" ", 1)[0] == self._me
        count = self._echoes.get(line)
        if count:
            if count == 1:
                del self._echoes[line]
            else:
                self._echoes[line] = count - 1
            return True
        return False

    def _handle(self, events: list[Event]) -> None:
        for event in events:
            match event:
                case CommandReceived(command=command):
                    self._counters.received[command.NAME].inc()
                    try:
                        self._handler.on_command(self, command)
                    except Exception:
                        logger.exception("[redis %s] replication handler failed on %s", self.channel, command.NAME)
                case LineIgnored(line=line, reason=reason):
                    self._counters.lines_ignored.inc()
                    logger.warning("[redis %s] ignored line %r: %s", self.channel, line, reason)
                case Closed(reason=reason, message=message):
                    self._counters.disconnects[reason.value].inc()
                    logger.warning("[redis %s] replication session closing (%s): %s", self.channel, reason.value, message)
                    if self._conn is not None:
                        self._fail(self._conn, _SessionEnded(message))

    # -- outbound -------------------------------------------------------------

    def _kick(self) -> None:
        conn = self._conn
        if self._flushing is not conn and conn is not None and conn.buffered and self._publisher is not None:
            self._flushing = conn
            asyncio.ensure_future(self._flush(conn, self._publisher))

    async def _flush(self, conn: ReplicationConnection, publisher: aioredis.Redis) -> None:
        """Publish what the connection has, in pipelined batches; while a batch
        is in flight the connection holds new lines (up to its bound)."""
        try:
            while conn.state is ConnectionState.OPEN:
                lines = conn.pending_lines()
                if not lines:
                    break
                conn.pause_writing()
                messages = self._pack(lines)
                pipe = publisher.pipeline(transaction=False)
                for message in messages:
                    pipe.publish(self.channel, message)
                await pipe.execute()
                self._metrics.redis_messages_published.inc(len(messages))
                conn.resume_writing()
                self._counters.outbound_buffer.set(conn.buffered)
                self._wake_writers()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(conn, e)
        finally:
            if self._flushing is conn:
                self._flushing = None

    def _pack(self, lines: list[str]) -> list[bytes]:
        """Lines into messages of at most ``max_lines_per_message`` lines and
        ``MAX_MESSAGE_BYTES``; instance-less lines are counted as echoes to drop."""
        messages: list[bytes] = []
        batch: list[bytes] = []
        size = 0
        echoes = self._echoes
        for text in lines:
            line = text.encode("utf-8")
            if line.startswith(_ANONYMOUS_PREFIXES):
                echoes[line] = echoes.get(line, 0) + 1
            if batch and (len(batch) >= self._max_lines or size + len(line) + 1 > MAX_MESSAGE_BYTES):
                messages.append(b"\n".join(batch))
                batch, size = [], 0
            batch.append(line)
            size += len(line) + 1
        if batch:
            messages.append(b"\n".join(batch))
        return messages

    def _wake_writers(self) -> None:
        conn = self._conn
        if conn is not None and conn.buffered >= self._config.max_outbound_buffer // 2:
            return
        waiters, self._writable_waiters = self._writable_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
