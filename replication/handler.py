# tests: tests/unit/replication/test_handler.py tests/integration/test_replication_tcp.py tests/integration/test_replication_redis.py
"""What a process does with replication commands, whichever transport carries them.

This module owns the process-side decisions: as a writer, which RDATA and
POSITION commands a stream advance turns into and what to answer REPLICATE;
as a reader, how far it has got per (stream, writer), when a POSITION means
rows were missed and must be fetched from the database, and how to apply every
row exactly once, in stream order; and the cross-process commands (USER_SYNC,
CLEAR_USER_SYNC, FEDERATION_ACK, REMOTE_SERVER_UP) handed to registered
callbacks. Rows of the ``caches`` stream go to a cache-invalidation callback
through ``CacheInvalidationHandler``.

It deliberately knows nothing of sockets, Redis or Twisted (nothing here
imports it): a transport hands it a ``Channel`` (one TCP connection, or the
Redis channel) on ``on_connected``/``on_command``/``on_disconnected`` and the
handler sends through channels; time and background work come through a
``Scheduler`` (``transport.TwistedScheduler`` in a process). The stream layer is reached through two small protocols,
``StreamSource`` and ``RowHandler``, so that this module is the seam between
replication and storage.

Inside, every token is a ``StreamPosition`` of its stream (as in the commands),
so a position of one stream can never be compared with another's. The stream
layer and the row handlers speak bare stream IDs: ``_TypedSource`` converts a
``StreamSource``'s ints into positions, and ``_deliver`` and the
FEDERATION_ACK callbacks hand ``.value`` out; nowhere else converts.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

import attrs

from replication.commands import (
    FEDERATION_STREAM,
    ClearUserSyncCommand,
    Command,
    ErrorCommand,
    FederationAckCommand,
    JsonValue,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    Row,
    ServerCommand,
    UserSyncCommand,
)
from replication.metrics import ReplicationMetrics
from storage.kernel.backoff import BackoffPolicy
from storage.tokens import StreamPosition

__all__ = [
    "CACHES_STREAM",
    "CacheInvalidationHandler",
    "Channel",
    "FETCH_LIMIT",
    "MAX_QUEUED_COMMANDS",
    "MemoryStream",
    "MemoryStreamView",
    "POSITION_ANNOUNCE_INTERVAL_SECONDS",
    "ReplicationHandler",
    "RowHandler",
    "Scheduler",
    "StreamSource",
    "Updates",
]

logger = logging.getLogger(__name__)

#: Rows asked for per ``get_updates_between`` call, by writers and readers.
FETCH_LIMIT: Final = 1000

#: RDATA/POSITION commands a reader holds while it waits for a POSITION or a
#: database catch-up; at this many, transports stop reading (back-pressure),
#: and at twice as many the held commands are dropped and positions asked for
#: again (``REPLICATE``), so memory stays bounded whatever the peer does.
MAX_QUEUED_COMMANDS: Final = 10_000

#: Writers announce POSITION for streams that moved this often (Redis), so a
#: reader that lost a message notices, and an idle writer's position is seen.
POSITION_ANNOUNCE_INTERVAL_SECONDS: Final = 1.0

#: Delay before retrying a failed database read or a writer pump.
RETRY_DELAY_SECONDS: Final = 1.0
MAX_RETRY_DELAY_SECONDS: Final = 30.0
RETRY_BACKOFF: Final = BackoffPolicy(initial=RETRY_DELAY_SECONDS, multiplier=2.0, maximum=MAX_RETRY_DELAY_SECONDS)


def _NO_JITTER(low: float, high: float) -> float:
    return 1.0

#: The cache invalidation stream's name.
CACHES_STREAM: Final = "caches"

#: ``(rows, upto_token, limited)``: ``rows`` are ``(token, row)`` in token
#: order, all with ``from_token < token <= upto_token``; every row of the
#: writer up to ``upto_token`` is included; ``limited`` is True when rows
#: beyond ``upto_token`` (up to ``to_token``) may exist.
Updates: TypeAlias = tuple[Sequence[tuple[int, Row]], int, bool]


@runtime_checkable
class StreamSource(Protocol):
    """One stream, as replication needs it (the stream registry's seam).

    ``current_position(instance)``: in a writer, for its own instance, how far
    its rows are complete; in a reader, where this process's view of
    ``instance`` starts (loaded from ``stream_positions`` at start-up).
    ``get_updates_between(instance, from_token, to_token, limit)``: the rows
    ``instance`` wrote with ``from_token < token <= to_token``, from the
    database; at most about ``limit`` rows, but never part of a token's rows.
    """

    @property
    def name(self) -> str: ...

    def current_position(self, instance: str) -> int: ...

    async def get_updates_between(
        self, instance: str, from_token: int, to_token: int, limit: int
    ) -> Updates: ...


class RowHandler(Protocol):
    """Receives another writer's rows, once each, in token order per
    (stream, writer). ``rows`` are all the rows of ``token`` (several when the
    writer batched them), or empty when the writer's position moved to
    ``token`` without rows. ``token`` is the bare stream ID (the ``value`` of
    the command's ``StreamPosition``), as the stream layer's ID generators
    take it. Runs on the reactor thread; must not block."""

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None: ...


class Cancellable(Protocol):
    def cancel(self) -> None: ...

    def active(self) -> bool: ...


class Scheduler(Protocol):
    """Time and background work, injected (Twisted's reactor or a test clock
    behind ``transport.TwistedScheduler``)."""

    def call_later(self, delay: float, action: Callable[[], None]) -> Cancellable:
        """Run ``action()`` after ``delay`` seconds."""
        ...

    def sleep(self, delay: float) -> Awaitable[None]:
        """Something to await for ``delay`` seconds, in a background coroutine."""
        ...

    def run_in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Start driving ``coro`` now (it may finish synchronously). The
        handler wraps it so that it never raises."""
        ...


class Channel(Protocol):
    """Where a command came from and where answers go: a TCP connection or the
    Redis channel. Implemented by the transports.

    ``kind`` is the transport's metric label; ``relay`` is True when commands
    received here reach no other process unless this one passes them on (the
    main process's TCP connections); ``broadcast`` is True when what is sent
    reaches every process (Redis).
    """

    kind: str
    relay: bool
    broadcast: bool

    @property
    def peer_name(self) -> str | None: ...

    def may_send(self, command_name: str) -> bool:
        """True if this channel is open and its side may send this command."""
        ...

    def send_commands(self, commands: Sequence[Command]) -> None:
        """Queue commands for the peer(s); dropped (and counted) if the channel is down."""
        ...

    def writable(self) -> Awaitable[None] | None:
        """None if more may be sent now, else something to await until it may
        (Redis: the publish pipeline caught up). TCP never makes a writer
        wait: a reader that does not keep up is disconnected instead."""
        ...


# --------------------------------------------------------------------------
# Cache invalidation.


class CacheInvalidationHandler:
    """A ``RowHandler`` for the ``caches`` stream: each row
    ``[cache_name, keys|null, ...]`` invalidates ``keys`` (a tuple) in
    ``cache_name``, or the whole cache when ``keys`` is null. A name in
    ``groups`` stands for several caches (one row invalidates the same keys in
    each), as Synapse's ``cs_cache_fake``; it is expanded here, by the reader.
    """

    def __init__(
        self,
        invalidate: Callable[[str, tuple[JsonValue, ...] | None], None],
        groups: Mapping[str, Collection[str]] | None = None,
        stream: str = CACHES_STREAM,
    ) -> None:
        self._invalidate = invalidate
        self._groups = {name: tuple(members) for name, members in (groups or {}).items()}
        self._stream = stream

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
        if stream != self._stream:
            return
        for row in rows:
            if not row or type(row[0]) is not str:
                logger.warning("[%s] ignoring a caches row without a cache name: %.200r", instance, row)
                continue
            name = row[0]
            keys = row[1] if len(row) > 1 else None
            if keys is not None and type(keys) is not tuple:
                keys = (keys,)
            for cache in self._groups.get(name, (name,)):
                self._invalidate(cache, keys)


# --------------------------------------------------------------------------
# An in-memory stream: for tests, benchmarks and streams with no table.


class MemoryStream:
    """A stream kept in memory, with the ``StreamSource`` methods: per writer,
    its rows as ``(token, row)`` in token order and its current position.

    ``write(instance, token, rows)`` appends the rows of one token and moves
    the writer to it; ``advance(instance, token)`` moves it without rows. A
    reader process uses a ``MemoryStreamView`` of the same table, so that it
    has its own starting positions, as a reader's generator would.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._rows: dict[str, list[tuple[int, Row]]] = {}
        self._tokens: dict[str, list[int]] = {}
        self._positions: dict[str, int] = {}
        self.fetches = 0

    @property
    def name(self) -> str:
        return self._name

    def write(self, instance: str, token: int, rows: Iterable[Row]) -> None:
        if token <= self._positions.get(instance, 0):
            raise ValueError(
                f"{self._name}: token {token} of {instance} is not after its position "
                f"{self._positions.get(instance, 0)}"
            )
        table = self._rows.setdefault(instance, [])
        tokens = self._tokens.setdefault(instance, [])
        for row in rows:
            table.append((token, row))
            tokens.append(token)
        self._positions[instance] = token

    def advance(self, instance: str, token: int) -> None:
        if token > self._positions.get(instance, 0):
            self._positions[instance] = token

    def current_position(self, instance: str) -> int:
        return self._positions.get(instance, 0)

    def rows(self, instance: str) -> list[tuple[int, Row]]:
        return list(self._rows.get(instance, ()))

    def instances(self) -> list[str]:
        return sorted(self._positions)

    async def get_updates_between(self, instance: str, from_token: int, to_token: int, limit: int) -> Updates:
        self.fetches += 1
        table = self._rows.get(instance, [])
        tokens = self._tokens.get(instance, [])
        start = bisect.bisect_right(tokens, from_token)
        end = bisect.bisect_right(tokens, to_token)
        if end - start <= limit:
            return table[start:end], to_token, False
        # Cut after ``limit`` rows, but never inside one token's rows.
        cut = start + limit
        last = tokens[cut - 1]
        cut = bisect.bisect_right(tokens, last)
        return table[start:cut], last, True

    def view(self, positions: Mapping[str, int] | None = None) -> MemoryStreamView:
        return MemoryStreamView(self, positions or {})


class MemoryStreamView:
    """A reader's view of a ``MemoryStream``: the same rows, its own starting
    positions (0 unless given)."""

    def __init__(self, stream: MemoryStream, positions: Mapping[str, int]) -> None:
        self._stream = stream
        self._positions = dict(positions)
        self.fetches = 0

    @property
    def name(self) -> str:
        return self._stream.name

    def current_position(self, instance: str) -> int:
        return self._positions.get(instance, 0)

    async def get_updates_between(self, instance: str, from_token: int, to_token: int, limit: int) -> Updates:
        self.fetches += 1
        return await self._stream.get_updates_between(instance, from_token, to_token, limit)


# --------------------------------------------------------------------------
# The handler.

#: ``(rows, upto, limited)`` of ``Updates``, with tokens as positions of the stream.
_TypedUpdates: TypeAlias = tuple[list[tuple[StreamPosition, Row]], StreamPosition, bool]


@attrs.frozen(slots=True)
class _TypedSource:
    """A ``StreamSource`` in ``StreamPosition`` terms: where the handler turns
    the stream layer's bare stream IDs into positions of ``stream`` and back."""

    stream: str
    source: StreamSource

    def current(self, instance: str) -> StreamPosition:
        return StreamPosition(self.stream, self.source.current_position(instance))

    async def updates(
        self, instance: str, start: StreamPosition, target: StreamPosition, limit: int
    ) -> _TypedUpdates:
        rows, upto, limited = await self.source.get_updates_between(instance, start.value, target.value, limit)
        stream = self.stream
        return [(StreamPosition(stream, token), row) for token, row in rows], StreamPosition(stream, upto), limited


@attrs.define(slots=True, eq=False)
class _Feed:
    """A reader's state for one (stream, writer)."""

    stream: str
    instance: str
    source: _TypedSource
    #: Last complete token applied: every row of the writer up to it was handed over.
    position: StreamPosition
    #: True once a POSITION was handled on the current channel; until then
    #: RDATA is held, since rows may have been missed before it.
    synced: bool = False
    channel: Channel | None = None
    #: Rows of a ``batch`` group, waiting for the group's real token.
    batch: list[Row] = attrs.field(factory=list)
    #: Commands held while unsynced or while a catch-up runs, in arrival order.
    queue: deque[tuple[RdataCommand | PositionCommand, Channel]] = attrs.field(factory=deque)
    fetching: bool = False
    #: Too much was held; ask for positions again after the current catch-up.
    overflowed: bool = False
    #: Highest token the writer announced (RDATA or POSITION), for the lag metric.
    announced: StreamPosition = attrs.field(kw_only=True)
    lag: int = 0
    #: ``rows_applied_total{stream}``, resolved once.
    applied: Any = None


@attrs.define(slots=True, eq=False)
class _Written:
    """A writer's state for one stream it writes."""

    stream: str
    source: _TypedSource
    #: Everything up to this token has been sent (RDATA, or POSITION for row-less advances).
    last_sent: StreamPosition
    announced: StreamPosition
    dirty: bool = False
    pumping: bool = False
    failures: int = 0


class ReplicationHandler:
    """The process side of replication, for one process named ``instance_name``.

    ``sources``: every stream this process knows, by name. ``writes``: the
    names of the streams this process writes (it sends their rows); it reads
    every other (stream, writer) pair it hears about. ``announce_interval``:
    seconds between periodic POSITIONs (Redis), or None.

    Wiring: the stream layer calls ``on_stream_advanced(stream)`` whenever a
    written stream's position moves; other modules register callbacks with the
    ``add_*`` methods; transports call ``on_connected``/``on_command``/
    ``on_disconnected``. Call ``start()`` once and ``stop()`` at shutdown.
    """

    def __init__(
        self,
        instance_name: str,
        scheduler: Scheduler,
        *,
        sources: Mapping[str, StreamSource],
        writes: Collection[str] = (),
        metrics: ReplicationMetrics,
        announce_interval: float | None = None,
        fetch_limit: int = FETCH_LIMIT,
        max_queued: int = MAX_QUEUED_COMMANDS,
    ) -> None:
        NameCommand(instance_name)  # validates the name for the wire
        unknown = sorted(set(writes) - set(sources))
        if unknown:
            raise ValueError(f"writes names streams that are not in sources: {unknown}")
        for name, source in sources.items():
            if source.name != name:
                raise ValueError(f"sources[{name!r}] is the stream {source.name!r}")
        self.instance_name: Final = instance_name
        self._scheduler = scheduler
        self._sources = dict(sources)
        self._metrics = metrics
        for name in self._sources:
            metrics.add_stream(name)
        self._fetch_limit = fetch_limit
        self._max_queued = max_queued
        self._announce_interval = announce_interval
        self._written: dict[str, _Written] = {}
        for name in dict.fromkeys(writes):  # announced in the order given
            typed = _TypedSource(name, self._sources[name])
            position = typed.current(instance_name)
            self._written[name] = _Written(name, typed, position, position)
        self._feeds: dict[tuple[str, str], _Feed] = {}
        self._channels: list[Channel] = []
        self._queued = 0
        self._drained_waiters: list[Callable[[], None]] = []
        self._row_handlers: list[RowHandler] = []
        self._user_sync: list[Callable[[UserSyncCommand], None]] = []
        self._clear_user_sync: list[Callable[[str], None]] = []
        self._federation_ack: list[Callable[[str, int], None]] = []
        self._remote_server_up: list[Callable[[str], None]] = []
        self._announcer: Cancellable | None = None
        self._retries: list[Cancellable] = []
        self._running = 0
        self._unknown_streams: set[str] = set()
        self._stopped = False

    # -- wiring -------------------------------------------------------------

    def add_row_handler(self, handler: RowHandler) -> None:
        self._row_handlers.append(handler)

    def add_user_sync_listener(self, callback: Callable[[UserSyncCommand], None]) -> None:
        self._user_sync.append(callback)

    def add_clear_user_sync_listener(self, callback: Callable[[str], None]) -> None:
        self._clear_user_sync.append(callback)

    def add_federation_ack_listener(self, callback: Callable[[str, int], None]) -> None:
        self._federation_ack.append(callback)

    def add_remote_server_up_listener(self, callback: Callable[[str], None]) -> None:
        self._remote_server_up.append(callback)

    def start(self) -> None:
        """Start the periodic POSITION announcements, if configured."""
        if self._announce_interval is not None and self._written and self._announcer is None:
            self._schedule_announce()

    def _schedule_announce(self) -> None:
        interval = self._announce_interval
        if interval is None or self._stopped:
            return

        def announce() -> None:
            self._announce_positions()
            self._schedule_announce()

        self._announcer = self._scheduler.call_later(interval, announce)

    def stop(self) -> None:
        """Stop periodic work and retries; callbacks stop being called."""
        self._stopped = True
        if self._announcer is not None and self._announcer.active():
            self._announcer.cancel()
        for call in self._retries:
            if call.active():
                call.cancel()
        self._retries.clear()
        waiters, self._drained_waiters = self._drained_waiters, []
        for waiter in waiters:
            waiter()

    # -- introspection ------------------------------------------------------

    def position(self, stream: str, instance: str) -> int | None:
        """The last complete token applied for (stream, writer), or None if
        this process has not heard of that writer."""
        feed = self._feeds.get((stream, instance))
        return None if feed is None else feed.position.value

    def last_sent(self, stream: str) -> int:
        """How far this writer has sent ``stream`` (RDATA or POSITION)."""
        return self._written[stream].last_sent.value

    def busy(self) -> bool:
        """True while a writer pump or a reader catch-up is running or any
        command is held: tests and benches wait for it to be False."""
        return (
            self._running > 0
            or self._queued > 0
            or any(w.dirty or w.pumping for w in self._written.values())
            or any(f.fetching for f in self._feeds.values())
        )

    @property
    def channels(self) -> Sequence[Channel]:
        return tuple(self._channels)

    # -- flow control ---------------------------------------------------------

    @property
    def backlogged(self) -> bool:
        """True when transports should stop reading until ``when_drained()``."""
        return self._queued >= self._max_queued

    def call_when_drained(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once fewer than half of ``max_queued`` commands
        are held (at once if that is already so)."""
        if self._queued < self._max_queued // 2 or self._stopped:
            callback()
        else:
            self._drained_waiters.append(callback)

    def _dequeued(self, count: int) -> None:
        self._queued -= count
        if self._drained_waiters and self._queued < self._max_queued // 2:
            waiters, self._drained_waiters = self._drained_waiters, []
            for waiter in waiters:
                waiter()

    # -- transports call these ----------------------------------------------

    def on_connected(self, channel: Channel) -> None:
        """A channel is open. On a broadcast channel (Redis) a writer announces
        its positions at once, since readers may have missed its commands
        while it was away; over TCP the client's REPLICATE asks for them."""
        self._channels.append(channel)
        if channel.broadcast and self._written:
            self._send_positions(channel)

    def on_disconnected(self, channel: Channel) -> None:
        """A channel closed: what was held from it is dropped (the next
        POSITION shows any gap) and its feeds wait for a POSITION again."""
        if channel in self._channels:
            self._channels.remove(channel)
        dropped = 0
        for feed in self._feeds.values():
            if feed.channel is channel or not feed.synced:
                feed.synced = False
                feed.channel = None
                feed.batch.clear()
                dropped += len(feed.queue)
                feed.queue.clear()
        if dropped:
            self._dequeued(dropped)

    def on_command(self, channel: Channel, command: Command) -> None:
        """A command arrived on ``channel`` (the transport has already dropped
        this process's own echoes)."""
        match command:
            case RdataCommand():
                self._on_rdata(channel, command)
            case PositionCommand():
                self._on_position_command(channel, command)
            case ReplicateCommand():
                if self._written:
                    self._send_positions(channel)
            case UserSyncCommand():
                if command.instance != self.instance_name:
                    self._call("user_sync", self._user_sync, command)
            case ClearUserSyncCommand(instance=instance):
                if instance != self.instance_name:
                    self._call("clear_user_sync", self._clear_user_sync, instance)
            case FederationAckCommand(instance=instance, token=token):
                if instance != self.instance_name:
                    self._call("federation_ack", self._federation_ack, instance, token.value)
            case RemoteServerUpCommand(server_name=server_name):
                self._call("remote_server_up", self._remote_server_up, server_name)
                if channel.relay:
                    # The main process over TCP is a hub: pass it on to the
                    # other workers, as Redis would have.
                    for other in self._channels:
                        if other is not channel and other.relay and other.may_send(command.NAME):
                            other.send_commands((command,))
            case ServerCommand() | NameCommand() | PingCommand() | ErrorCommand():
                pass  # the connection and the transport deal with these

    # -- cross-process commands --------------------------------------------

    def send_user_sync(self, user_id: str, device_id: str | None, is_syncing: bool, last_sync_ms: int) -> None:
        self._send_everywhere(UserSyncCommand(self.instance_name, user_id, device_id, is_syncing, last_sync_ms))

    def send_clear_user_sync(self) -> None:
        self._send_everywhere(ClearUserSyncCommand(self.instance_name))

    def send_federation_ack(self, token: int) -> None:
        """Acknowledge the ``federation`` stream up to the stream ID ``token``."""
        self._send_everywhere(FederationAckCommand(self.instance_name, StreamPosition(FEDERATION_STREAM, token)))

    def send_remote_server_up(self, server_name: str) -> None:
        """Tell every other process that ``server_name`` is up (this process
        handles it itself; its own echo is not delivered back)."""
        self._send_everywhere(RemoteServerUpCommand(server_name))

    def _send_everywhere(self, command: Command) -> None:
        for channel in self._channels:
            if channel.may_send(command.NAME):
                channel.send_commands((command,))

    def _call(self, kind: str, callbacks: Sequence[Callable[..., None]], *args: Any) -> None:
        for callback in callbacks:
            try:
                callback(*args)
            except Exception:
                self._metrics.callback_failures.labels(kind).inc()
                logger.exception("replication %s callback %r failed", kind, callback)

    # -- writer side ----------------------------------------------------------

    def on_stream_advanced(self, stream: str) -> None:
        """The stream layer's position-advance listener: ``stream``'s position
        for this process moved. The rows in between are sent as RDATA soon
        (several advances in a row are coalesced into one database read)."""
        written = self._written.get(stream)
        if written is None:
            raise ValueError(f"{self.instance_name} does not write stream {stream!r}")
        written.dirty = True
        if not written.pumping and not self._stopped:
            # Start on the next reactor turn, so that every advance of this
            # turn (a burst of completed facts) shares one read and one write.
            written.pumping = True
            self._scheduler.call_later(0, lambda: self._run_in_background(f"pump {stream}", self._pump(written)))

    async def _pump(self, written: _Written) -> None:
        source, me = written.source, self.instance_name
        try:
            while written.dirty and not self._stopped:
                written.dirty = False
                target = source.current(me)
                while written.last_sent < target and not self._stopped:
                    channels = [c for c in self._channels if c.may_send("RDATA")]
                    if not channels:
                        # Nobody is listening: skip the read. Whoever connects
                        # asks for positions and fills the gap from the database.
                        written.last_sent = target
                        break
                    start = written.last_sent
                    rows, upto, limited = await source.updates(me, start, target, self._fetch_limit)
                    upto = min(upto, target)
                    if upto <= start and limited:
                        raise RuntimeError(
                            f"{written.stream}.get_updates_between({me!r}, {start.value}, {target.value}) made no progress"
                        )
                    commands = self._rdata_commands(written.stream, rows, start, upto)
                    # Sent and recorded in the same reactor turn: a REPLICATE
                    # answer never sees one without the other.
                    for channel in self._channels:
                        if channel.may_send("RDATA"):
                            channel.send_commands(commands)
                    written.last_sent = max(upto, start)
                    if commands and type(commands[-1]) is PositionCommand:
                        written.announced = written.last_sent  # that was an announcement
                    for channel in self._channels:
                        waiting = channel.writable()
                        if waiting is not None:
                            await waiting
            written.failures = 0
        except Exception:
            written.failures += 1
            delay = RETRY_BACKOFF.delay(written.failures, _NO_JITTER)
            logger.exception("replication: sending %s rows failed; retrying in %.1f s", written.stream, delay)
            written.dirty = True
            self._retry_later(delay, lambda: self.on_stream_advanced(written.stream))
        finally:
            written.pumping = False

    def _rdata_commands(
        self, stream: str, rows: Sequence[tuple[StreamPosition, Row]], start: StreamPosition, upto: StreamPosition
    ) -> list[Command]:
        """One RDATA per row in ``(start, upto]``, ``batch`` for all but the
        last row of a token, and a POSITION if the position moved past the
        last row without rows."""
        commands: list[Command] = []
        me = self.instance_name
        last_token = start
        count = len(rows)
        sent = 0
        for index, (token, row) in enumerate(rows):
            if token <= start or token > upto:
                continue
            last_of_token = index + 1 == count or rows[index + 1][0] != token
            commands.append(RdataCommand(stream, me, token if last_of_token else None, row))
            last_token = token
            sent += 1
        if upto > last_token:
            commands.append(PositionCommand(stream, me, last_token, upto))
        if sent:
            self._metrics.rows_sent.labels(stream).inc(sent)
        return commands

    def _send_positions(self, channel: Channel) -> None:
        """POSITION for every stream this process writes, as far as it has sent."""
        me = self.instance_name
        commands: list[Command] = [
            PositionCommand(stream, me, written.last_sent, written.last_sent)
            for stream, written in self._written.items()
        ]
        if channel.may_send("POSITION"):
            channel.send_commands(commands)
        for written in self._written.values():
            if not written.pumping and written.source.current(me) > written.last_sent:
                self.on_stream_advanced(written.stream)  # an advance nobody reported

    def _announce_positions(self) -> None:
        """Periodic (Redis): POSITION for each stream whose sent position moved
        since the last announcement, and a pump for any advance not yet seen."""
        me = self.instance_name
        commands: list[Command] = []
        for written in self._written.values():
            if written.source.current(me) > written.last_sent and not written.pumping:
                self.on_stream_advanced(written.stream)
            if written.last_sent != written.announced and not written.pumping:
                commands.append(PositionCommand(written.stream, me, written.last_sent, written.last_sent))
                written.announced = written.last_sent
        if commands:
            for channel in self._channels:
                if channel.may_send("POSITION"):
                    channel.send_commands(commands)

    # -- reader side ----------------------------------------------------------

    def _feed(self, stream: str, instance: str) -> _Feed | None:
        feed = self._feeds.get((stream, instance))
        if feed is None:
            source = self._sources.get(stream)
            if source is None:
                if stream not in self._unknown_streams:
                    self._unknown_streams.add(stream)
                    logger.warning("replication: ignoring stream %r, which this process does not know", stream)
                return None
            typed = _TypedSource(stream, source)
            position = typed.current(instance)
            feed = self._feeds[(stream, instance)] = _Feed(
                stream, instance, typed, position, announced=position,
                applied=self._metrics.rows_applied.labels(stream),
            )
            self._metrics.reader_lag.labels(stream, instance)  # the series starts at 0
        return feed

    def _on_rdata(self, channel: Channel, command: RdataCommand) -> None:
        if command.instance == self.instance_name:
            return
        feed = self._feed(command.stream, command.instance)
        if feed is None:
            return
        if command.token is not None and command.token > feed.announced:
            feed.announced = command.token
        if feed.fetching or feed.queue or not feed.synced:
            self._hold(feed, command, channel)
            return
        self._apply_rdata(feed, command)

    def _on_position_command(self, channel: Channel, command: PositionCommand) -> None:
        if command.instance == self.instance_name:
            return
        feed = self._feed(command.stream, command.instance)
        if feed is None:
            return
        if command.new_token > feed.announced:
            feed.announced = command.new_token
            self._update_lag(feed)
        if feed.fetching or (feed.synced and feed.queue):
            self._hold(feed, command, channel)
            return
        if not feed.synced:
            self._sync(feed, command, channel)
        else:
            self._apply_position(feed, command)
        self._drain(feed)

    def _sync(self, feed: _Feed, command: PositionCommand, channel: Channel) -> None:
        """A POSITION is where a feed (re)starts. RDATA held before it was sent
        before it on the same channel, so it is covered by the catch-up this
        POSITION starts (and skipped when drained)."""
        feed.synced = True
        feed.channel = channel
        self._apply_position(feed, command)

    def _hold(self, feed: _Feed, command: RdataCommand | PositionCommand, channel: Channel) -> None:
        if len(feed.queue) >= 2 * self._max_queued:
            # The transport did not stop reading (it cannot always): drop what
            # is held and ask for positions again once the catch-up is done.
            dropped = len(feed.queue)
            feed.queue.clear()
            feed.batch.clear()
            self._dequeued(dropped)
            feed.overflowed = True
            feed.channel = channel
            logger.warning(
                "replication: dropped %d held commands of %s/%s; will ask for positions again",
                dropped, feed.stream, feed.instance,
            )
            if not feed.fetching:
                self._resync(feed)
            return
        feed.queue.append((command, channel))
        self._queued += 1

    def _resync(self, feed: _Feed) -> None:
        feed.overflowed = False
        feed.synced = False
        channel = feed.channel
        if channel is not None and channel.may_send("REPLICATE"):
            channel.send_commands((ReplicateCommand(),))

    def _apply_rdata(self, feed: _Feed, command: RdataCommand) -> None:
        token = command.token
        if token is None:
            feed.batch.append(command.row)
            return
        if feed.batch:
            rows: Sequence[Row] = (*feed.batch, command.row)
            feed.batch.clear()
        else:
            rows = (command.row,)
        if token <= feed.position:
            self._metrics.rows_skipped.labels(feed.stream).inc(len(rows))
            return
        self._deliver(feed, token, rows)

    def _apply_position(self, feed: _Feed, command: PositionCommand) -> None:
        new = command.new_token
        if new <= feed.position:
            return
        if feed.position >= command.prev_token:
            # Nothing was written between our position and ``prev``.
            feed.batch.clear()
            self._deliver(feed, new, ())
            return
        feed.batch.clear()
        feed.fetching = True
        self._metrics.gap_fills.labels(feed.stream).inc()
        logger.info(
            "replication: %s/%s is at %d, writer at %d: catching up from the database",
            feed.stream, feed.instance, feed.position.value, new.value,
        )
        self._run_in_background(f"catch up {feed.stream}/{feed.instance}", self._catch_up(feed, new))

    def _deliver(self, feed: _Feed, token: StreamPosition, rows: Sequence[Row]) -> None:
        feed.position = token
        if rows:
            feed.applied.inc(len(rows))
        value = token.value  # row handlers take the bare stream ID
        for handler in self._row_handlers:
            try:
                handler.on_rows(feed.stream, feed.instance, value, rows)
            except Exception:
                self._metrics.callback_failures.labels("rows").inc()
                logger.exception("replication: row handler %r failed on %s/%s %d", handler, feed.stream, feed.instance, value)
        if feed.lag or feed.announced > token:
            self._update_lag(feed)

    def _update_lag(self, feed: _Feed) -> None:
        lag = max(feed.announced.value - feed.position.value, 0)
        if lag != feed.lag:
            self._metrics.reader_lag.labels(feed.stream, feed.instance).set(lag)
            feed.lag = lag

    async def _catch_up(self, feed: _Feed, target: StreamPosition) -> None:
        """Fetch and apply every row of (stream, writer) up to ``target``."""
        failures = 0
        try:
            while feed.position < target and not self._stopped:
                start = feed.position
                try:
                    rows, upto, limited = await feed.source.updates(feed.instance, start, target, self._fetch_limit)
                except Exception:
                    failures += 1
                    delay = RETRY_BACKOFF.delay(failures, _NO_JITTER)
                    logger.exception(
                        "replication: reading %s/%s after %d failed; retrying in %.1f s",
                        feed.stream, feed.instance, start.value, delay,
                    )
                    await self._scheduler.sleep(delay)
                    continue
                failures = 0
                upto = min(upto, target) if limited else target
                if upto <= start:
                    raise RuntimeError(
                        f"{feed.stream}.get_updates_between({feed.instance!r}, {start.value}, {target.value}) made no progress"
                    )
                self._metrics.gap_fill_rows.labels(feed.stream).inc(len(rows))
                group: list[Row] = []
                for index, (token, row) in enumerate(rows):
                    if token <= start or token > upto:
                        continue
                    group.append(row)
                    if index + 1 == len(rows) or rows[index + 1][0] != token:
                        self._deliver(feed, token, group)
                        group = []
                if upto > feed.position:
                    self._deliver(feed, upto, ())
        finally:
            feed.fetching = False
        if feed.overflowed:
            self._resync(feed)
        self._drain(feed)

    def _drain(self, feed: _Feed) -> None:
        """Apply held commands in arrival order until one starts a catch-up.
        An unsynced feed first looks for a held POSITION to start from."""
        queue = feed.queue
        while queue and not feed.fetching:
            if not feed.synced:
                for index, (held, channel) in enumerate(queue):
                    if type(held) is PositionCommand:
                        del queue[index]
                        self._dequeued(1)
                        self._sync(feed, held, channel)
                        break
                else:
                    return  # wait for a POSITION
                continue
            command, _channel = queue.popleft()
            self._dequeued(1)
            if type(command) is RdataCommand:
                self._apply_rdata(feed, command)
            else:
                assert type(command) is PositionCommand
                self._apply_position(feed, command)

    # -- background work ----------------------------------------------------

    def _run_in_background(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` through the scheduler; log (never lose) a failure, and
        count it in ``busy()`` while it runs."""

        async def guarded() -> None:
            try:
                await coro
            except Exception:
                logger.exception("replication: background task %s failed", name)
            finally:
                self._running -= 1

        self._running += 1
        self._scheduler.run_in_background(guarded())

    def _retry_later(self, delay: float, action: Callable[[], None]) -> None:
        if self._stopped:
            return
        call: Cancellable | None = None

        def run() -> None:
            if call in self._retries:
                self._retries.remove(call)
            if not self._stopped:
                action()

        call = self._scheduler.call_later(delay, run)
        self._retries.append(call)
