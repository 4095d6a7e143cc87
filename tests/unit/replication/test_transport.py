# tests: replication/transport.py replication/reconnect.py replication/metrics.py
"""The TCP adapter, on Twisted's in-memory transport and a fake clock: no
sockets, no sleeps. What is checked is what goes on the wire, when, and what
the metrics say about it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from replication.commands import Row
from replication.connection import ConnectionConfig
from replication.handler import MemoryStream, ReplicationHandler
from replication.metrics import ReplicationMetrics
from replication.reconnect import RECONNECT_INITIAL_DELAY_SECONDS, RECONNECT_MAX_DELAY_SECONDS, backoff_delay
from replication.transport import (
    ReplicationClientFactory,
    ReplicationProtocol,
    ReplicationServerFactory,
    TwistedScheduler,
    UnsafeReplicationListener,
    check_listener_addresses,
)

SERVER = "example.com"
PEER = IPv4Address("TCP", "127.0.0.1", 40000)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, tuple[Row, ...]]] = []

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
        self.calls.append((stream, instance, token, tuple(rows)))


class Setup:
    """A main process's replication (server factory) with three streams, and
    helpers to open connections to it over ``StringTransport``."""

    def __init__(self, config: ConnectionConfig = ConnectionConfig()) -> None:
        self.clock = Clock()
        self.clock.advance(1_000)
        self.registry = CollectorRegistry()
        self.metrics = ReplicationMetrics.create(self.registry)
        self.streams = {name: MemoryStream(name) for name in ("events", "caches", "typing")}
        self.handler = ReplicationHandler(
            "master", TwistedScheduler(self.clock), sources=dict(self.streams),
            writes=list(self.streams), metrics=self.metrics,
        )
        self.factory = ReplicationServerFactory(SERVER, self.handler, self.clock, self.metrics, config)

    def connect(self) -> tuple[ReplicationProtocol, StringTransport]:
        protocol = self.factory.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER)
        protocol.makeConnection(transport)
        return protocol, transport

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def lines(transport: StringTransport, clock: Clock | None = None) -> list[str]:
    if clock is not None:
        clock.advance(0)  # writer pumps start on the next reactor turn
    out = transport.value().decode().split("\n")
    transport.clear()
    assert out[-1] == "", "every line ends with a newline"
    return out[:-1]


def feed(protocol: ReplicationProtocol, *text: str) -> None:
    protocol.dataReceived("".join(line + "\n" for line in text).encode())


def test_what_a_person_with_netcat_sees() -> None:
    setup = Setup()
    setup.streams["events"].write("master", 53, [("ev",)])
    setup.handler.on_stream_advanced("events")
    setup.clock.advance(0)
    protocol, transport = setup.connect()
    assert lines(transport) == ["SERVER example.com", "PING 1000000"]
    feed(protocol, "NAME x", "PING 1", "REPLICATE")
    assert lines(transport) == [
        "POSITION events master 53 53",
        "POSITION caches master 0 0",
        "POSITION typing master 0 0",
    ]
    assert protocol.peer_name == "x"
    assert setup.sample("tributary_replication_connections", transport="tcp_server") == 1
    assert setup.sample("tributary_replication_commands_received_total", transport="tcp_server", command="REPLICATE") == 1
    assert setup.sample("tributary_replication_commands_sent_total", transport="tcp_server", command="POSITION") == 3


def test_telnet_line_endings_and_blank_lines_are_accepted() -> None:
    setup = Setup()
    protocol, transport = setup.connect()
    lines(transport)
    protocol.dataReceived(b"NAME x\r\n\r\n  \nREPLICATE\r\n")
    assert len(lines(transport)) == 3


def test_rdata_goes_to_every_connection_as_rows_are_written() -> None:
    setup = Setup()
    (one, t1), (two, t2) = setup.connect(), setup.connect()
    lines(t1), lines(t2)
    setup.streams["caches"].write("master", 1, [("a", None, 5), ("b", None, 5)])
    setup.handler.on_stream_advanced("caches")
    expected = ['RDATA caches master batch ["a",null,5]', 'RDATA caches master 1 ["b",null,5]']
    assert lines(t1, setup.clock) == expected and lines(t2) == expected
    assert setup.sample("tributary_replication_rows_sent_total", stream="caches") == 2


def test_keepalive_ping_after_five_quiet_seconds_and_timeout_only_after_the_peers_ping() -> None:
    setup = Setup()
    protocol, transport = setup.connect()
    lines(transport)
    setup.clock.advance(5)
    assert lines(transport) == ["PING 1005000"]
    # No PING from the peer yet: silence does not close the connection.
    setup.clock.pump([1] * 30)
    assert not transport.disconnecting
    lines(transport)
    feed(protocol, "PING 1")
    setup.clock.pump([1] * 14)
    assert not transport.disconnecting
    setup.clock.advance(1)
    assert lines(transport)[-1] == "ERROR ping timeout: nothing received for 15.0 s"
    assert transport.disconnecting
    assert setup.sample("tributary_replication_disconnects_total", transport="tcp_server", reason="timed_out") == 1


def test_a_bad_line_gets_an_error_and_the_connection_is_closed() -> None:
    setup = Setup()
    protocol, transport = setup.connect()
    lines(transport)
    feed(protocol, "HELLO there")
    out = lines(transport)
    assert out[0].startswith("ERROR can't parse line: command 'HELLO' is not supported")
    assert transport.disconnecting
    protocol.connectionLost(Failure(ConnectionError("closed")))
    assert setup.sample("tributary_replication_disconnects_total", transport="tcp_server", reason="protocol_violation") == 1
    assert setup.sample("tributary_replication_disconnects_total", transport="tcp_server", reason="connection_lost") == 0
    assert setup.sample("tributary_replication_connections", transport="tcp_server") == 0


def test_a_command_from_the_wrong_side_is_rejected() -> None:
    setup = Setup()
    protocol, transport = setup.connect()
    lines(transport)
    feed(protocol, 'RDATA events w 1 ["x"]')
    assert lines(transport) == ["ERROR RDATA may not be sent by a client (tcp rules)"]
    assert transport.disconnecting


def test_an_overlong_line_is_rejected_without_buffering_it_forever() -> None:
    setup = Setup()
    protocol, transport = setup.connect()
    lines(transport)
    protocol.dataReceived(b"NAME " + b"x" * (ReplicationProtocol.MAX_LENGTH + 10))
    assert lines(transport)[0].startswith("ERROR can't parse line: line must be at most 1048576 bytes")
    assert transport.disconnecting


def test_a_reader_that_stops_reading_is_cut_off_for_congestion_and_the_socket_aborted() -> None:
    setup = Setup(ConnectionConfig(max_outbound_buffer=5))
    protocol, transport = setup.connect()
    lines(transport)
    protocol.pauseProducing()  # what Twisted does when the socket's buffer is full
    for token in range(1, 6):
        setup.streams["events"].write("master", token, [("r", token)])
        setup.handler.on_stream_advanced("events")
        setup.clock.advance(0)
    assert transport.value() == b""
    assert setup.sample("tributary_replication_outbound_buffer_commands", transport="tcp_server") == 5
    setup.streams["events"].write("master", 6, [("r", 6)])
    setup.handler.on_stream_advanced("events")
    assert lines(transport, setup.clock) == ["ERROR congested: the peer did not keep up; dropping 5 buffered commands"]
    assert transport.disconnecting
    assert transport.producer is None, "a transport with a producer never finishes closing"
    assert setup.sample("tributary_replication_disconnects_total", transport="tcp_server", reason="congested") == 1
    assert setup.sample("tributary_replication_outbound_buffer_commands", transport="tcp_server") == 0
    # It never drains: after the grace period the socket is aborted.
    assert not transport.disconnected
    setup.clock.advance(5)
    assert transport.disconnected


def test_held_commands_go_out_when_the_transport_drains() -> None:
    setup = Setup()
    protocol, transport = setup.connect()
    lines(transport)
    protocol.pauseProducing()
    setup.streams["events"].write("master", 1, [("r",)])
    setup.handler.on_stream_advanced("events")
    setup.clock.advance(0)
    assert transport.value() == b""
    protocol.resumeProducing()
    assert lines(transport) == ['RDATA events master 1 ["r"]']


def test_client_sends_its_opening_and_follows_the_server() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    metrics = ReplicationMetrics.create(registry)
    stream = MemoryStream("events")
    handler = ReplicationHandler("worker1", TwistedScheduler(clock), sources={"events": stream.view()}, metrics=metrics)
    recorder = Recorder()
    handler.add_row_handler(recorder)
    factory = ReplicationClientFactory("worker1", handler, clock, metrics, ConnectionConfig(expected_server_name=SERVER))
    protocol = factory.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    protocol.makeConnection(transport)
    assert lines(transport) == ["NAME worker1", "PING 0", "REPLICATE "]
    stream.write("master", 3, [("old",)])
    feed(protocol, "SERVER example.com", "PING 1", "POSITION events master 3 3", 'RDATA events master 4 ["new"]')
    assert recorder.calls == [("events", "master", 3, (("old",),)), ("events", "master", 4, (("new",),))]
    assert registry.get_sample_value("tributary_replication_connections", {"transport": "tcp_client"}) == 1


def test_client_closes_on_the_wrong_server_name() -> None:
    clock = Clock()
    metrics = ReplicationMetrics.create(CollectorRegistry())
    handler = ReplicationHandler("worker1", TwistedScheduler(clock), sources={}, metrics=metrics)
    factory = ReplicationClientFactory("worker1", handler, clock, metrics, ConnectionConfig(expected_server_name=SERVER))
    protocol = factory.buildProtocol(PEER)
    transport = StringTransport()
    protocol.makeConnection(transport)
    lines(transport)
    feed(protocol, "SERVER other.example")
    assert lines(transport) == ["ERROR connected to server 'other.example', expected 'example.com'"]
    assert transport.disconnecting


def test_client_stops_reading_while_its_handler_holds_too_much() -> None:
    clock = Clock()
    metrics = ReplicationMetrics.create(CollectorRegistry())
    stream = MemoryStream("events")
    handler = ReplicationHandler(
        "worker1", TwistedScheduler(clock), sources={"events": stream.view()}, metrics=metrics, max_queued=3
    )
    factory = ReplicationClientFactory("worker1", handler, clock, metrics)
    protocol = factory.buildProtocol(PEER)
    transport = StringTransport()
    protocol.makeConnection(transport)
    # No POSITION yet: RDATA is held.
    feed(protocol, *[f'RDATA events master {t} ["r"]' for t in range(1, 4)])
    assert transport.producerState == "paused"
    feed(protocol, "POSITION events master 3 3")
    assert transport.producerState == "producing"


class FakeConnector:
    def __init__(self) -> None:
        self.connects = 0
        self.state = "disconnected"

    def connect(self) -> None:
        self.connects += 1

    def disconnect(self) -> None:
        pass

    def stopConnecting(self) -> None:
        pass

    def getDestination(self) -> IPv4Address:
        return PEER


def test_client_reconnects_with_exponential_backoff_reset_by_a_handshake() -> None:
    clock = Clock()
    metrics = ReplicationMetrics.create(CollectorRegistry())
    handler = ReplicationHandler("worker1", TwistedScheduler(clock), sources={}, metrics=metrics)
    factory = ReplicationClientFactory("worker1", handler, clock, metrics, rand=lambda: 0.5)  # no jitter
    connector = FakeConnector()
    reason = Failure(ConnectionRefusedError())
    delays = []
    for _ in range(10):
        factory.clientConnectionFailed(connector, reason)  # type: ignore[arg-type]
        (call,) = clock.getDelayedCalls()
        delays.append(call.getTime() - clock.seconds())
        clock.advance(delays[-1])
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert delays[-1] == RECONNECT_MAX_DELAY_SECONDS
    assert connector.connects == 10
    # A connection that got as far as SERVER starts the backoff over.
    protocol = factory.buildProtocol(PEER)
    protocol.makeConnection(StringTransport())
    feed(protocol, "SERVER example.com")
    factory.clientConnectionLost(connector, reason)  # type: ignore[arg-type]
    assert factory.attempts == 1
    clock.advance(RECONNECT_INITIAL_DELAY_SECONDS)
    assert connector.connects == 11
    # Stopped: no more attempts.
    factory.clientConnectionLost(connector, reason)  # type: ignore[arg-type]
    factory.stop()
    clock.advance(RECONNECT_MAX_DELAY_SECONDS * 2)
    assert connector.connects == 11


def test_backoff_is_jittered_within_twenty_percent() -> None:
    assert backoff_delay(1, lambda: 0.0) == pytest.approx(0.4)
    assert backoff_delay(1, lambda: 1.0) == pytest.approx(0.6)
    assert backoff_delay(20, lambda: 1.0) == pytest.approx(36.0)


def test_listening_elsewhere_than_loopback_needs_an_explicit_opt_in() -> None:
    check_listener_addresses(["127.0.0.1", "::1"], allow_unauthenticated=False)
    with pytest.raises(UnsafeReplicationListener, match="0.0.0.0.*allow_unauthenticated_replication"):
        check_listener_addresses(["127.0.0.1", "0.0.0.0"], allow_unauthenticated=False)
    check_listener_addresses(["0.0.0.0"], allow_unauthenticated=True)


def test_server_stopping_tells_every_worker() -> None:
    setup = Setup()
    (_, t1), (_, t2) = setup.connect(), setup.connect()
    lines(t1), lines(t2)
    setup.factory.close_all("server stopping")
    assert lines(t1) == ["ERROR server stopping"] and lines(t2) == ["ERROR server stopping"]
    assert t1.disconnecting and t2.disconnecting


def test_metrics_start_at_zero_for_every_label_value() -> None:
    registry = CollectorRegistry()
    ReplicationMetrics.create(registry, ["events"])
    assert registry.get_sample_value(
        "tributary_replication_commands_sent_total", {"transport": "redis", "command": "USER_SYNC"}
    ) == 0
    assert registry.get_sample_value(
        "tributary_replication_disconnects_total", {"transport": "tcp_client", "reason": "congested"}
    ) == 0
    assert registry.get_sample_value("tributary_replication_rows_applied_total", {"stream": "events"}) == 0
    for metric in registry.collect():
        assert metric.name.startswith("tributary_replication_")
        assert metric.documentation.endswith(".")


def test_the_transport_constants_quoted_in_the_doc_are_the_codes() -> None:
    from pathlib import Path

    from replication import handler, reconnect, redis_transport, transport

    doc = (Path(__file__).resolve().parents[3] / "docs" / "replication.md").read_text(encoding="utf-8")
    assert f"`CLOSE_GRACE_SECONDS` ({transport.CLOSE_GRACE_SECONDS:g} s)" in doc
    assert f"`MAX_QUEUED_COMMANDS` ({handler.MAX_QUEUED_COMMANDS})" in doc
    assert f"`DEFAULT_LINES_PER_MESSAGE` ({redis_transport.DEFAULT_LINES_PER_MESSAGE})" in doc
    for name in ("RECONNECT_INITIAL_DELAY_SECONDS", "RECONNECT_MAX_DELAY_SECONDS", "RECONNECT_JITTER"):
        assert hasattr(reconnect, name) and f"`{name}`" in doc
    assert hasattr(transport, "TICK_INTERVAL_SECONDS") and "`TICK_INTERVAL_SECONDS`" in doc
    for name in ("POSITION_ANNOUNCE_INTERVAL_SECONDS", "MAX_RETRY_DELAY_SECONDS"):
        assert hasattr(handler, name) and f"`{name}`" in doc


def test_replication_config_reaches_the_connection() -> None:
    from datetime import timedelta

    from replication.config import ReplicationConfig, connection_config

    config = ReplicationConfig(
        keepalive_interval=timedelta(seconds=2), timeout=timedelta(seconds=6), max_outbound_buffer=500
    )
    assert connection_config(config, expected_server_name="example.com") == ConnectionConfig(
        keepalive_interval=2.0, timeout=6.0, max_outbound_buffer=500, expected_server_name="example.com"
    )
    # The defaults are the protocol's constants.
    assert connection_config(ReplicationConfig()) == ConnectionConfig()
