# tests: replication/transport.py replication/service.py replication/handler.py
"""Replication over real TCP on loopback: a person with netcat, and readers
that survive disconnects and congestion without losing or repeating a row."""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from replication.config import ReplicationConfig
from replication.connection import ConnectionConfig
from replication.handler import MemoryStream
from replication.service import start_replication
from replication.transport import ReplicationClientFactory, ReplicationProtocol, ReplicationServerFactory
from tests.harness import free_port
from tests.integration.test_replication_support import (
    STREAMS,
    Producer,
    Recorder,
    assert_exactly_once,
    converged,
    make_handler,
    wait_until,
)
from tests.twisted_plugin import reactor

SERVER = "example.com"


def _netcat(port: int) -> tuple[list[bytes], list[bytes]]:
    """What a person typing into ``nc 127.0.0.1 PORT`` does and sees."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        wire = sock.makefile("rwb")
        greeting = [wire.readline(), wire.readline()]
        wire.write(b"NAME x\nPING 1\nREPLICATE\n")
        wire.flush()
        positions = [wire.readline() for _ in STREAMS]
        return greeting, positions


async def test_netcat_sees_server_and_ping_then_one_position_per_stream() -> None:
    port = free_port()
    streams = {name: MemoryStream(name) for name in STREAMS}
    streams["events"].write("master", 25833, [("ev",)])
    streams["caches"].write("master", 1004, [("get_user_by_id", ("@a:hs",), 1)])
    service = await start_replication(
        reactor, ReplicationConfig(), CollectorRegistry(), server_name=SERVER, instance_name="master",
        sources=dict(streams), writes=STREAMS, listen=[("127.0.0.1", port)],
    )
    try:
        greeting, positions = await deferToThread(_netcat, port)
    finally:
        await service.stop()
    assert greeting[0] == b"SERVER example.com\n"
    assert greeting[1].startswith(b"PING ") and greeting[1][5:-1].isdigit()
    assert positions == [
        b"POSITION events master 25833 25833\n",
        b"POSITION caches master 1004 1004\n",
        b"POSITION typing master 0 0\n",
    ]


def _set_buffer(protocol: ReplicationProtocol, option: int, size: int) -> None:
    protocol.transport.getHandle().setsockopt(socket.SOL_SOCKET, option, size)  # type: ignore[union-attr]


async def test_readers_apply_every_row_once_in_order_through_disconnects_and_congestion() -> None:
    """A writer produces 30,000 rows across three streams (sometimes several
    rows per stream ID, sometimes skipping IDs). Reader A's connection is cut
    twice while that happens; it reconnects with backoff and catches up from
    the streams. Reader B stops reading for a while: the writer holds what it
    cannot send up to its bound, then cuts B off for congestion; B reconnects
    and refills the gap from the streams, not from a replay. In the end both
    readers have applied every row exactly once, in order, and stand at the
    writer's positions."""
    streams = {name: MemoryStream(name) for name in STREAMS}
    writer, writer_metrics, writer_registry = make_handler("master", dict(streams), writes=STREAMS)
    server = ReplicationServerFactory(SERVER, writer, reactor, writer_metrics, ConnectionConfig(max_outbound_buffer=500))
    port = reactor.listenTCP(0, server, interface="127.0.0.1")
    readers = {}
    for name in ("reader_a", "reader_b"):
        handler, metrics, registry = make_handler(name, {s: streams[s].view() for s in STREAMS})
        recorder = Recorder()
        handler.add_row_handler(recorder)
        factory = ReplicationClientFactory(name, handler, reactor, metrics, ConnectionConfig(expected_server_name=SERVER))
        reactor.connectTCP("127.0.0.1", port.getHost().port, factory)
        readers[name] = (handler, recorder, factory, registry)
    try:
        await wait_until(lambda: len(server.connections) == 2 and all(r[2].protocol_instance for r in readers.values()), 10, "both readers connected")
        b_client = readers["reader_b"][2].protocol_instance
        assert b_client is not None
        # Small socket buffers on B's connection, so that "B stopped reading"
        # reaches the writer's bound quickly instead of filling megabytes of
        # kernel buffers first.
        _set_buffer(b_client, socket.SO_RCVBUF, 16_384)
        b_local = b_client.transport.getHost().port  # type: ignore[union-attr]
        for protocol in server.connections:
            if protocol.transport.getPeer().port == b_local:  # type: ignore[union-attr]
                _set_buffer(protocol, socket.SO_SNDBUF, 16_384)

        producer = Producer(streams, {"master": (writer, STREAMS)})
        a_factory = readers["reader_a"][2]

        def a_connected() -> bool:
            client = a_factory.protocol_instance
            return client is not None and client.peer_name == SERVER

        await producer.produce(3_000)
        b_client.transport.pauseProducing()  # type: ignore[union-attr]  # B stops reading
        await producer.produce(7_500)
        assert a_factory.protocol_instance is not None
        a_factory.protocol_instance.transport.abortConnection()  # type: ignore[union-attr]
        await producer.produce(12_000)  # while A is away
        await wait_until(a_connected, 10, "reader A to reconnect")
        await producer.produce(15_000)
        a_factory.protocol_instance.transport.abortConnection()  # type: ignore[union-attr]
        await producer.produce(30_000)
        await wait_until(
            lambda: writer_registry.get_sample_value(
                "tributary_replication_disconnects_total", {"transport": "tcp_server", "reason": "congested"}
            ) == 1,
            10,
            "reader B cut off for congestion",
        )
        b_client.transport.resumeProducing()  # type: ignore[union-attr]
        for name, (handler, recorder, _, _) in readers.items():
            await wait_until(lambda: converged(handler, streams), 30, f"{name} to catch up")
            assert_exactly_once(recorder, handler, streams)
            assert recorder.count == 30_000
        for stream in STREAMS:
            assert writer.last_sent(stream) == streams[stream].current_position("master")
        a_registry = readers["reader_a"][3]
        assert a_registry.get_sample_value(
            "tributary_replication_disconnects_total", {"transport": "tcp_client", "reason": "connection_lost"}
        ) >= 2
        b_registry = readers["reader_b"][3]
        assert sum(
            b_registry.get_sample_value("tributary_replication_gap_fills_total", {"stream": s}) or 0 for s in STREAMS
        ) >= 1
    finally:
        for _, _, factory, _ in readers.values():
            factory.stop()
        server.close_all("server stopping")
        await port.stopListening()
        await deferLater(reactor, 0.05)


async def test_a_worker_reconnects_after_the_main_process_restarts() -> None:
    """The listener goes away and comes back on the same port: the client
    retries with backoff and resumes from its position."""
    streams = {"events": MemoryStream("events")}
    writer, writer_metrics, _ = make_handler("master", dict(streams), writes=["events"])
    server = ReplicationServerFactory(SERVER, writer, reactor, writer_metrics)
    port_number = free_port()
    port = reactor.listenTCP(port_number, server, interface="127.0.0.1")
    reader, metrics, _ = make_handler("worker1", {"events": streams["events"].view()})
    recorder = Recorder()
    reader.add_row_handler(recorder)
    factory = ReplicationClientFactory("worker1", reader, reactor, metrics, ConnectionConfig(expected_server_name=SERVER))
    reactor.connectTCP("127.0.0.1", port_number, factory)
    try:
        await wait_until(lambda: reader.position("events", "master") == 0, 10, "the first POSITION")
        streams["events"].write("master", 1, [("a",)])
        writer.on_stream_advanced("events")
        await wait_until(lambda: reader.position("events", "master") == 1, 10, "row 1")
        await port.stopListening()
        server.close_all("server stopping")
        await wait_until(lambda: factory.protocol_instance is None, 10, "the disconnect")
        streams["events"].write("master", 2, [("b",)])  # written while the worker is away
        writer.on_stream_advanced("events")
        port = reactor.listenTCP(port_number, server, interface="127.0.0.1")
        await wait_until(lambda: reader.position("events", "master") == 2, 15, "the catch-up after reconnecting")
        assert recorder.rows[("events", "master")] == [(1, ("a",)), (2, ("b",))]
    finally:
        factory.stop()
        server.close_all("server stopping")
        stopped: Deferred[None] | None = port.stopListening()
        if stopped is not None:
            await stopped
        await deferLater(reactor, 0.05)
