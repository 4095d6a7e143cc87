# tests: replication/handler.py
"""The process side of replication, driven by hand: no sockets, a fake clock.

A writer ``ReplicationHandler`` and a reader ``ReplicationHandler`` are joined
by ``Link``, an in-memory pair of channels that delivers commands only when
the test says so and can be cut (losing what is in flight), so each scenario
below can place a disconnect, a slow database read or a burst exactly where it
wants. The property at the end drives random interleavings of all of it and
checks the one thing that matters: every row reaches the reader exactly once,
in order, and its positions end equal to the writer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from replication.commands import (
    ClearUserSyncCommand,
    Command,
    FederationAckCommand,
    JsonValue,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    Row,
    UserSyncCommand,
)
from replication.connection import REDIS_RULES, TCP_RULES, ProtocolRules, Role
from replication.handler import (
    CacheInvalidationHandler,
    MemoryStream,
    ReplicationHandler,
    Updates,
)
from replication.metrics import ReplicationMetrics
from replication.transport import TwistedScheduler
from storage.tokens import StreamPosition


#: Every fake clock handed to a handler in the current test (see ``settle``).
_clocks: list[Clock] = []


@pytest.fixture(autouse=True)
def _fresh_clocks() -> None:
    _clocks.clear()


def settle() -> None:
    """Run what the handlers scheduled for "the next reactor turn" (writer
    pumps start there, so that a turn's advances share one read)."""
    for clock in _clocks:
        while any(call.getTime() <= clock.seconds() for call in clock.getDelayedCalls()):
            clock.advance(0)


class Channel:
    """One end of a ``Link``: what the handler sends is queued in ``outbox``."""

    def __init__(self, kind: str, role: Role, rules: ProtocolRules = TCP_RULES, broadcast: bool = False) -> None:
        self.kind = kind
        self.relay = kind == "tcp_server"
        self.broadcast = broadcast
        self._role = role
        self._rules = rules
        self.open = True
        self.outbox: list[Command] = []
        self.waiting: Deferred[None] | None = None

    @property
    def peer_name(self) -> str | None:
        return "peer"

    def may_send(self, command_name: str) -> bool:
        return self.open and self._rules.may_send(self._role, command_name)

    def send_commands(self, commands: Sequence[Command]) -> None:
        if self.open:
            self.outbox.extend(commands)

    def writable(self) -> Deferred[None] | None:
        return self.waiting

    def take(self) -> list[str]:
        settle()
        lines = [c.to_line() for c in self.outbox]
        self.outbox.clear()
        return lines


class Link:
    """A writer (TCP server side) and a reader (client side) joined in memory."""

    def __init__(self, writer: ReplicationHandler, reader: ReplicationHandler) -> None:
        self.writer, self.reader = writer, reader
        self.connect()

    def connect(self) -> None:
        self.to_reader = Channel("tcp_server", Role.SERVER)
        self.to_writer = Channel("tcp_client", Role.CLIENT)
        self.writer.on_connected(self.to_reader)
        self.reader.on_connected(self.to_writer)
        # The client core's opening REPLICATE.
        self.to_writer.outbox.append(ReplicateCommand())

    def cut(self) -> None:
        """The connection drops: whatever was not delivered is lost."""
        for channel in (self.to_reader, self.to_writer):
            channel.open = False
            channel.outbox.clear()
        self.writer.on_disconnected(self.to_reader)
        self.reader.on_disconnected(self.to_writer)

    def deliver(self, limit: int | None = None) -> int:
        """Deliver up to ``limit`` commands each way (all by default)."""
        count = 0
        while True:
            settle()
            moved = False
            for source, target, handler in (
                (self.to_writer, self.to_reader, self.writer),
                (self.to_reader, self.to_writer, self.reader),
            ):
                if source.outbox and (limit is None or count < limit):
                    command = source.outbox.pop(0)
                    handler.on_command(target, command)
                    count += 1
                    moved = True
            if not moved:
                return count


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, tuple[Row, ...]]] = []

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
        self.calls.append((stream, instance, token, tuple(rows)))

    def rows(self, stream: str, instance: str = "master") -> list[tuple[int, Row]]:
        return [(token, row) for s, i, token, rows in self.calls if s == stream and i == instance for row in rows]

    def tokens(self, stream: str) -> list[int]:
        return [token for s, _, token, _ in self.calls if s == stream]


class SlowView:
    """A process's view of a ``MemoryStream`` whose reads can be made to wait
    until the test releases them, or to fail. ``live``: positions are the
    stream's (a writer's view), else they start at 0 (a reader's)."""

    def __init__(self, stream: MemoryStream, *, live: bool = False) -> None:
        self.stream = stream
        self.live = live
        self.blocked = False
        self.pending: list[Deferred[None]] = []
        self.fail_next = 0
        self.fetches = 0

    @property
    def name(self) -> str:
        return self.stream.name

    def current_position(self, instance: str) -> int:
        return self.stream.current_position(instance) if self.live else 0

    async def get_updates_between(self, instance: str, from_token: int, to_token: int, limit: int) -> Updates:
        self.fetches += 1
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("database unavailable")
        if self.blocked:
            gate: Deferred[None] = Deferred()
            self.pending.append(gate)
            await gate
        return await self.stream.get_updates_between(instance, from_token, to_token, limit)

    def release(self) -> None:
        self.blocked = False
        pending, self.pending = self.pending, []
        for gate in pending:
            gate.callback(None)


def make_handler(
    name: str,
    sources: dict[str, Any],
    writes: Sequence[str] = (),
    clock: Clock | None = None,
    **kwargs: Any,
) -> tuple[ReplicationHandler, ReplicationMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = ReplicationMetrics.create(registry)
    clock = clock or Clock()
    _clocks.append(clock)
    handler = ReplicationHandler(
        name, TwistedScheduler(clock), sources=sources, writes=writes, metrics=metrics, **kwargs
    )
    return handler, metrics, registry


class Pair:
    """A writer ("master") and a reader ("worker1") of the same in-memory streams."""

    def __init__(self, *names: str, fetch_limit: int = 1000, max_queued: int = 10_000) -> None:
        self.streams = {name: MemoryStream(name) for name in names}
        self.views = {name: SlowView(stream) for name, stream in self.streams.items()}
        self.writer, _, _ = make_handler("master", dict(self.streams), writes=list(names), fetch_limit=fetch_limit)
        self.reader, _, self.registry = make_handler(
            "worker1", dict(self.views), fetch_limit=fetch_limit, max_queued=max_queued
        )
        self.recorder = Recorder()
        self.reader.add_row_handler(self.recorder)

    def write(self, name: str, token: int, *rows: Row) -> None:
        self.streams[name].write("master", token, rows)
        self.writer.on_stream_advanced(name)

    def sample(self, metric: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(metric, labels)


def reader_channel(pair: Pair) -> Channel:
    channel = Channel("tcp_client", Role.CLIENT)
    pair.reader.on_connected(channel)
    return channel


def writer_channel(pair: Pair) -> Channel:
    channel = Channel("tcp_server", Role.SERVER)
    pair.writer.on_connected(channel)
    return channel


# --------------------------------------------------------------------------
# Writer side.


def test_writer_sends_one_rdata_per_row_with_batch_for_all_but_the_last_row_of_a_token() -> None:
    pair = Pair("caches")
    channel = writer_channel(pair)
    pair.write("caches", 5, ("a", ("k1",), 1), ("b", ("k2",), 1), ("c", None, 1))
    pair.write("caches", 6, ("d", ("k3",), 2))
    assert channel.take() == [
        'RDATA caches master batch ["a",["k1"],1]',
        'RDATA caches master batch ["b",["k2"],1]',
        'RDATA caches master 5 ["c",null,1]',
        'RDATA caches master 6 ["d",["k3"],2]',
    ]
    assert pair.writer.last_sent("caches") == 6


def test_writer_sends_position_for_an_advance_without_rows_and_nothing_after_rows() -> None:
    pair = Pair("events")
    channel = writer_channel(pair)
    pair.write("events", 3, ("x",))
    settle()
    pair.streams["events"].advance("master", 7)  # IDs 4..7 were reserved and abandoned
    pair.writer.on_stream_advanced("events")
    settle()
    pair.write("events", 9, ("y",))
    assert channel.take() == [
        'RDATA events master 3 ["x"]',
        "POSITION events master 3 7",
        'RDATA events master 9 ["y"]',
    ]


def test_writer_answers_replicate_with_a_position_for_every_stream_it_writes() -> None:
    pair = Pair("events", "caches", "typing")
    channel = writer_channel(pair)
    pair.write("events", 10, ("e",))
    channel.take()
    pair.writer.on_command(channel, ReplicateCommand())
    assert channel.take() == [  # in the order of the stream registry
        "POSITION events master 10 10",
        "POSITION caches master 0 0",
        "POSITION typing master 0 0",
    ]


def test_writer_starts_from_the_position_the_stream_had_at_start_up() -> None:
    stream = MemoryStream("events")
    stream.write("master", 41, [("old",)])
    writer, _, _ = make_handler("master", {"events": stream}, writes=["events"])
    channel = Channel("tcp_server", Role.SERVER)
    writer.on_connected(channel)
    writer.on_command(channel, ReplicateCommand())
    assert channel.take() == ["POSITION events master 41 41"]


def test_writer_with_no_peers_skips_the_database_read() -> None:
    stream = MemoryStream("events")
    view = SlowView(stream, live=True)
    writer, _, _ = make_handler("master", {"events": view}, writes=["events"])
    for token in range(1, 50):
        stream.write("master", token, [("row", token)])
        writer.on_stream_advanced("events")
    settle()
    assert view.fetches == 0
    assert writer.last_sent("events") == 49


def test_writer_coalesces_advances_into_few_reads_and_pages_through_large_backlogs() -> None:
    stream = MemoryStream("events")
    view = SlowView(stream, live=True)
    writer, _, _ = make_handler("master", {"events": view}, writes=["events"], fetch_limit=10)
    channel = Channel("tcp_server", Role.SERVER)
    writer.on_connected(channel)
    view.blocked = True
    stream.write("master", 1, [("row", 1)])
    writer.on_stream_advanced("events")
    settle()  # the first read waits...
    for token in range(2, 36):
        stream.write("master", token, [("row", token)])
        writer.on_stream_advanced("events")  # ...and these are coalesced
    view.release()
    lines = channel.take()
    assert len(lines) == 35 and lines[-1] == 'RDATA events master 35 ["row",35]'
    assert view.fetches == 1 + 4  # row 1, then 34 rows in pages of 10


def test_writer_retries_after_a_failed_read() -> None:
    clock = Clock()
    stream = MemoryStream("events")
    view = SlowView(stream, live=True)
    writer, _, _ = make_handler("master", {"events": view}, writes=["events"], clock=clock)
    channel = Channel("tcp_server", Role.SERVER)
    writer.on_connected(channel)
    view.fail_next = 1
    stream.write("master", 1, [("a",)])
    writer.on_stream_advanced("events")
    assert channel.take() == []
    clock.advance(1.0)
    assert channel.take() == ['RDATA events master 1 ["a"]']


def test_writer_waits_for_a_channel_that_is_not_writable() -> None:
    stream = MemoryStream("events")
    writer, _, _ = make_handler("master", {"events": stream}, writes=["events"], fetch_limit=2)
    channel = Channel("redis", Role.CLIENT, REDIS_RULES, broadcast=True)
    channel.waiting = Deferred()
    writer.on_connected(channel)
    assert channel.take() == ["POSITION events master 0 0"]  # announced on connect
    for token in range(1, 6):
        stream.write("master", token, [("r", token)])
    writer.on_stream_advanced("events")
    assert len(channel.take()) == 2  # one page, then it waits
    gate, channel.waiting = channel.waiting, None
    gate.callback(None)
    assert len(channel.take()) == 3


def test_writer_announces_positions_periodically_only_when_they_moved() -> None:
    clock = Clock()
    stream = MemoryStream("events")
    writer, _, _ = make_handler("master", {"events": stream}, writes=["events"], clock=clock, announce_interval=1.0)
    writer.start()
    channel = Channel("redis", Role.CLIENT, REDIS_RULES, broadcast=True)
    writer.on_connected(channel)
    assert channel.take() == ["POSITION events master 0 0"]
    clock.advance(1.0)
    assert channel.take() == []  # nothing moved
    stream.write("master", 4, [("a",)])
    writer.on_stream_advanced("events")
    assert channel.take() == ['RDATA events master 4 ["a"]']
    clock.advance(1.0)
    assert channel.take() == ["POSITION events master 4 4"]
    clock.advance(1.0)
    assert channel.take() == []
    # An advance the stream layer did not report is still picked up.
    stream.advance("master", 6)
    clock.advance(1.0)
    assert channel.take() == ["POSITION events master 4 6"]
    writer.stop()
    assert not clock.getDelayedCalls()


# --------------------------------------------------------------------------
# Reader side.


def test_reader_catches_up_from_the_database_on_the_first_position() -> None:
    """A reader that starts late fetches what it missed, then follows RDATA."""
    pair = Pair("events")
    for token in range(1, 4):
        pair.write("events", token, ("old", token))  # nobody connected yet
    link = Link(pair.writer, pair.reader)
    link.deliver()
    assert pair.recorder.rows("events") == [(1, ("old", 1)), (2, ("old", 2)), (3, ("old", 3))]
    pair.write("events", 4, ("new", 4))
    link.deliver()
    assert pair.recorder.rows("events")[-1] == (4, ("new", 4))
    assert pair.reader.position("events", "master") == 4
    assert pair.sample("tributary_replication_gap_fills_total", stream="events") == 1
    assert pair.sample("tributary_replication_rows_applied_total", stream="events") == 4


def test_reader_holds_rdata_until_a_position_says_where_it_is() -> None:
    """RDATA before the first POSITION may follow a gap, so it waits; once the
    POSITION's catch-up covered it, it is skipped, never applied twice."""
    pair = Pair("events")
    channel = reader_channel(pair)
    pair.streams["events"].write("master", 1, [("a",)])
    pair.streams["events"].write("master", 2, [("b",)])
    pair.reader.on_command(channel, RdataCommand("events", "master", StreamPosition("events", 2), ("b",)))
    assert pair.recorder.calls == []
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 2), StreamPosition("events", 2)))
    assert pair.recorder.rows("events") == [(1, ("a",)), (2, ("b",))]
    assert pair.sample("tributary_replication_rows_skipped_total", stream="events") == 1
    assert not pair.reader.busy()


def test_reader_applies_a_batch_group_only_when_its_real_token_arrives() -> None:
    pair = Pair("caches")
    channel = reader_channel(pair)
    pair.reader.on_command(channel, PositionCommand("caches", "master", StreamPosition("caches", 0), StreamPosition("caches", 0)))
    pair.reader.on_command(channel, RdataCommand("caches", "master", None, ("a", None, 1)))
    pair.reader.on_command(channel, RdataCommand("caches", "master", None, ("b", None, 1)))
    assert pair.recorder.calls == [] and pair.reader.position("caches", "master") == 0
    pair.reader.on_command(channel, RdataCommand("caches", "master", StreamPosition("caches", 7), ("c", None, 1)))
    assert pair.recorder.calls == [("caches", "master", 7, (("a", None, 1), ("b", None, 1), ("c", None, 1)))]
    assert pair.reader.position("caches", "master") == 7


def test_reader_moves_on_a_position_without_gap_without_reading_the_database() -> None:
    pair = Pair("events")
    channel = reader_channel(pair)
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 0), StreamPosition("events", 0)))
    pair.reader.on_command(channel, RdataCommand("events", "master", StreamPosition("events", 3), ("x",)))
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 3), StreamPosition("events", 9)))
    assert pair.recorder.calls[-1] == ("events", "master", 9, ())
    assert pair.views["events"].fetches == 0


def test_reader_fills_a_gap_shown_by_a_position() -> None:
    pair = Pair("events")
    channel = reader_channel(pair)
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 0), StreamPosition("events", 0)))
    pair.streams["events"].write("master", 1, [("a",)])
    pair.streams["events"].write("master", 2, [("b1",), ("b2",)])
    pair.streams["events"].advance("master", 5)
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 5), StreamPosition("events", 5)))
    assert pair.recorder.calls == [
        ("events", "master", 1, (("a",),)),
        ("events", "master", 2, (("b1",), ("b2",))),
        ("events", "master", 5, ()),
    ]


def test_rdata_arriving_during_a_catch_up_waits_and_only_the_uncovered_rows_apply() -> None:
    pair = Pair("events")
    view = pair.views["events"]
    for token in range(1, 4):
        pair.write("events", token, ("old", token))
    link = Link(pair.writer, pair.reader)
    view.blocked = True  # the reader's database read is slow
    link.deliver()  # REPLICATE; POSITION events master 3 3 starts a catch-up, which waits
    assert view.pending and pair.recorder.calls == []
    pair.write("events", 4, ("new", 4))
    link.deliver()  # RDATA 4 arrives during the catch-up: held
    assert pair.recorder.calls == []
    view.release()
    assert pair.recorder.rows("events") == [(t, ("old", t)) for t in (1, 2, 3)] + [(4, ("new", 4))]
    assert pair.reader.position("events", "master") == 4
    assert not pair.reader.busy()


def test_a_position_held_during_a_catch_up_is_handled_after_a_reconnect() -> None:
    """Cut during a slow catch-up; the new connection's POSITION arrives while
    the catch-up still runs, and must not be forgotten."""
    pair = Pair("events")
    view = pair.views["events"]
    pair.write("events", 1, ("a",))
    link = Link(pair.writer, pair.reader)
    view.blocked = True
    link.deliver()
    link.cut()
    pair.write("events", 2, ("b",))  # nobody connected: only the position moves
    link.connect()
    link.deliver()  # POSITION events master 2 2 is held behind the running catch-up
    assert pair.recorder.calls == []
    view.release()
    assert pair.recorder.rows("events") == [(1, ("a",)), (2, ("b",))]
    assert pair.reader.position("events", "master") == 2


def test_reader_retries_a_failed_catch_up() -> None:
    clock = Clock()
    stream = MemoryStream("events")
    view = SlowView(stream)
    stream.write("master", 1, [("a",)])
    reader, _, _ = make_handler("worker1", {"events": view}, clock=clock)
    recorder = Recorder()
    reader.add_row_handler(recorder)
    channel = Channel("tcp_client", Role.CLIENT)
    reader.on_connected(channel)
    view.fail_next = 2
    reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 1), StreamPosition("events", 1)))
    assert recorder.calls == []
    clock.advance(1.0)
    assert recorder.calls == []
    clock.advance(2.0)  # the delay doubles
    assert recorder.rows("events") == [(1, ("a",))]


def test_reader_that_holds_too_much_asks_the_transport_to_stop_reading_then_resyncs() -> None:
    pair = Pair("events", max_queued=4)
    view = pair.views["events"]
    channel = reader_channel(pair)
    pair.streams["events"].write("master", 1, [("a",)])
    view.blocked = True
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 1), StreamPosition("events", 1)))  # catch-up waits
    resumed: list[bool] = []
    for token in range(2, 6):
        pair.streams["events"].write("master", token, [("r", token)])
        pair.reader.on_command(channel, RdataCommand("events", "master", StreamPosition("events", token), ("r", token)))
    assert pair.reader.backlogged
    pair.reader.call_when_drained(lambda: resumed.append(True))
    assert resumed == []
    # The transport could not stop at once: more arrive, past twice the bound.
    for token in range(6, 12):
        pair.streams["events"].write("master", token, [("r", token)])
        pair.reader.on_command(channel, RdataCommand("events", "master", StreamPosition("events", token), ("r", token)))
    assert resumed == [True]  # what it held was dropped
    view.release()
    assert channel.take() == ["REPLICATE "]  # asks for positions again after the catch-up
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 11), StreamPosition("events", 11)))
    assert [t for t, _ in pair.recorder.rows("events")] == list(range(1, 12))


def test_own_commands_and_unknown_streams_are_ignored() -> None:
    pair = Pair("events")
    channel = Channel("redis", Role.CLIENT, REDIS_RULES, broadcast=True)
    pair.reader.on_connected(channel)
    pair.reader.on_command(channel, PositionCommand("events", "worker1", StreamPosition("events", 0), StreamPosition("events", 5)))
    pair.reader.on_command(channel, RdataCommand("events", "worker1", StreamPosition("events", 5), ("mine",)))
    pair.reader.on_command(channel, PositionCommand("mystery", "master", StreamPosition("mystery", 0), StreamPosition("mystery", 5)))
    pair.reader.on_command(channel, RdataCommand("mystery", "master", StreamPosition("mystery", 5), ("?",)))
    assert pair.recorder.calls == [] and pair.reader.position("events", "worker1") is None


def test_a_failing_row_handler_is_logged_and_counted_and_does_not_stop_the_others() -> None:
    pair = Pair("events")

    class Broken:
        def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
            raise RuntimeError("bug")

    reader, _, registry = make_handler("worker1", {"events": pair.views["events"]})
    recorder = Recorder()
    reader.add_row_handler(Broken())
    reader.add_row_handler(recorder)
    channel = Channel("tcp_client", Role.CLIENT)
    reader.on_connected(channel)
    reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 0), StreamPosition("events", 0)))
    reader.on_command(channel, RdataCommand("events", "master", StreamPosition("events", 1), ("a",)))
    assert recorder.rows("events") == [(1, ("a",))]
    assert registry.get_sample_value("tributary_replication_callback_failures_total", {"callback": "rows"}) == 1
    assert reader.position("events", "master") == 1


def test_reader_lag_follows_announced_positions() -> None:
    pair = Pair("events")
    view = pair.views["events"]
    channel = reader_channel(pair)
    for token in range(1, 11):
        pair.streams["events"].write("master", token, [("r", token)])
    view.blocked = True
    pair.reader.on_command(channel, PositionCommand("events", "master", StreamPosition("events", 10), StreamPosition("events", 10)))
    assert pair.sample("tributary_replication_reader_lag", stream="events", writer="master") == 10
    view.release()
    assert pair.sample("tributary_replication_reader_lag", stream="events", writer="master") == 0


# --------------------------------------------------------------------------
# Cross-process commands and cache invalidation.


def test_cross_process_commands_reach_their_callbacks_and_not_their_sender() -> None:
    handler, _, _ = make_handler("master", {})
    seen: list[object] = []
    handler.add_user_sync_listener(seen.append)
    handler.add_clear_user_sync_listener(lambda instance: seen.append(("clear", instance)))
    handler.add_federation_ack_listener(lambda instance, token: seen.append(("ack", instance, token)))
    handler.add_remote_server_up_listener(lambda server: seen.append(("up", server)))
    one, two = Channel("tcp_server", Role.SERVER), Channel("tcp_server", Role.SERVER)
    handler.on_connected(one)
    handler.on_connected(two)
    sync = UserSyncCommand("sync1", "@a:hs", "DEV", True, 5)
    handler.on_command(one, sync)
    handler.on_command(one, UserSyncCommand("master", "@a:hs", None, False, 5))  # our own
    handler.on_command(one, ClearUserSyncCommand("sync1"))
    handler.on_command(one, FederationAckCommand("fed1", StreamPosition("federation", 42)))
    handler.on_command(one, RemoteServerUpCommand("other.example"))
    assert seen == [sync, ("clear", "sync1"), ("ack", "fed1", 42), ("up", "other.example")]
    # The main process relays REMOTE_SERVER_UP to its other workers over TCP.
    assert two.take() == ["REMOTE_SERVER_UP other.example"]
    assert one.take() == []


def test_cross_process_sends_go_to_every_channel_that_may_carry_them() -> None:
    handler, _, _ = make_handler("sync1", {})
    to_server = Channel("tcp_client", Role.CLIENT)
    handler.on_connected(to_server)
    handler.send_user_sync("@a:hs", None, True, 1000)
    handler.send_federation_ack(7)
    handler.send_remote_server_up("other.example")
    handler.send_clear_user_sync()
    assert to_server.take() == [
        "USER_SYNC sync1 @a:hs None start 1000",
        "FEDERATION_ACK sync1 7",
        "REMOTE_SERVER_UP other.example",
        "CLEAR_USER_SYNC sync1",
    ]


def test_a_failing_callback_is_counted() -> None:
    handler, _, registry = make_handler("master", {})

    def broken(server: str) -> None:
        raise RuntimeError("bug")

    handler.add_remote_server_up_listener(broken)
    handler.on_command(Channel("tcp_server", Role.SERVER), RemoteServerUpCommand("x.example"))
    assert registry.get_sample_value(
        "tributary_replication_callback_failures_total", {"callback": "remote_server_up"}
    ) == 1


def test_cache_rows_invalidate_named_caches_and_groups_are_expanded() -> None:
    invalidated: list[tuple[str, tuple[JsonValue, ...] | None]] = []
    handler = CacheInvalidationHandler(
        lambda name, keys: invalidated.append((name, keys)),
        groups={"cs_cache_fake": ("get_current_state", "get_users_in_room")},
    )
    handler.on_rows("caches", "master", 5, [("get_user_by_id", ("@a:hs",), 1), ("get_profile", None, 1)])
    handler.on_rows("caches", "master", 6, [("cs_cache_fake", ("!room:hs",), 2)])
    handler.on_rows("events", "master", 7, [("get_user_by_id", ("@b:hs",), 3)])  # not the caches stream
    handler.on_rows("caches", "master", 8, [(), (5,)])  # malformed: ignored
    assert invalidated == [
        ("get_user_by_id", ("@a:hs",)),
        ("get_profile", None),
        ("get_current_state", ("!room:hs",)),
        ("get_users_in_room", ("!room:hs",)),
    ]


def test_handler_refuses_to_write_streams_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="not in sources"):
        make_handler("master", {}, writes=["events"])
    handler, _, _ = make_handler("master", {"events": MemoryStream("events")})
    with pytest.raises(ValueError, match="does not write"):
        handler.on_stream_advanced("events")


# --------------------------------------------------------------------------
# The property: random writes, deliveries, cuts and slow reads.

_actions = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.sampled_from(["events", "caches"]), st.integers(1, 3), st.integers(0, 2)),
        st.tuples(st.just("deliver"), st.integers(0, 8)),
        st.tuples(st.just("cut")),
        st.tuples(st.just("slow"), st.booleans()),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=_actions)
def test_every_row_reaches_the_reader_exactly_once_in_order(actions: list[tuple[Any, ...]]) -> None:
    """Writes (several rows per token, skipped IDs), partial deliveries, cuts
    that lose what is in flight, and a database that is slow for the reader,
    in any order: at the end the reader has every row once, in order, and the
    writer's positions."""
    pair = Pair("events", "caches", fetch_limit=3)
    link = Link(pair.writer, pair.reader)
    tokens = {"events": 0, "caches": 0}
    expected: dict[str, list[tuple[int, Row]]] = {"events": [], "caches": []}
    for action in actions:
        match action:
            case ("write", name, count, skip):
                tokens[name] += 1 + skip  # skipped IDs: reserved and abandoned
                rows = [(name, tokens[name], i) for i in range(count)]
                pair.write(name, tokens[name], *rows)
                expected[name] += [(tokens[name], row) for row in rows]
            case ("deliver", count):
                link.deliver(count)
            case ("cut",):
                link.cut()
                link.connect()
            case ("slow", on):
                for view in pair.views.values():
                    if on:
                        view.blocked = True
                    else:
                        view.release()
    for view in pair.views.values():
        view.release()
    link.deliver()
    for name in ("events", "caches"):
        assert pair.recorder.rows(name) == expected[name]
        applied = pair.recorder.tokens(name)
        assert applied == sorted(set(applied)), "tokens strictly ascending"
        assert pair.reader.position(name, "master") == pair.writer.last_sent(name) == tokens[name]
    assert not pair.reader.busy() and not pair.writer.busy()
