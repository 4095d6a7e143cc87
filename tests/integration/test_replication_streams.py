# tests: replication/stream_sources.py replication/handler.py replication/transport.py
"""Replication over the real PostgreSQL-backed streams (storage/streams.py,
storage/id_generators.py): rows written in transactions reach readers over
TCP exactly once, in order, through a cut connection and a congested reader,
and the readers' generators end at the writer's positions."""

from __future__ import annotations

import random
import socket
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.task import deferLater

from replication.commands import Row
from replication.connection import ConnectionConfig
from replication.handler import ReplicationHandler
from replication.metrics import ReplicationMetrics
from replication.stream_sources import connect_streams, row_to_wire, stream_sources
from replication.transport import ReplicationClientFactory, ReplicationServerFactory, TwistedScheduler
from storage.database import Transaction
from storage.id_generators import StreamIdGenerator
from storage.stores.streams import (
    insert_cache_invalidations_txn,
    insert_device_list_changes_txn,
    insert_typing_txn,
)
from storage.streams import STREAMS, StreamName
from tests.integration.test_replication_support import Recorder, wait_until
from tests.integration.test_streams_support import (  # noqa: F401 (fixtures)
    StreamEnv,
    module_database,
    module_database_dsn,
    streams_env,
)
from tests.twisted_plugin import reactor

NAMES = ("caches", "typing", "device_lists")
DEFINITIONS = {name: STREAMS[StreamName(name)] for name in NAMES}
SERVER = "example.com"


def write_facts_txn(txn: Transaction, generator: StreamIdGenerator, stream: str, facts: int, rng: random.Random) -> int:
    """``facts`` facts of ``stream`` in one transaction; returns the rows written."""
    rows = 0
    for stream_id in generator.get_next_mult_txn(txn, facts):
        count = rng.choice((1, 1, 2, 3))
        if stream == "caches":
            keys = [(f"@u{stream_id}_{i}:hs",) for i in range(count)]
            insert_cache_invalidations_txn(txn, stream_id, "main", "get_user_by_id", keys, 1000)
        elif stream == "typing":
            count = 1
            insert_typing_txn(txn, stream_id, "main", f"!room{stream_id % 7}:hs", [f"@u{stream_id}:hs"])
        else:
            changes = [(f"@u{stream_id}:hs", f"DEV{i}") for i in range(count)]
            insert_device_list_changes_txn(txn, stream_id, "main", changes)
        rows += count
    return rows


async def test_postgres_stream_rows_reach_every_reader_exactly_once(streams_env: StreamEnv) -> None:
    """The main process writes about 15,000 rows over three streams in
    transactions of 40 facts. Reader A's connection is cut half-way; reader B
    stops reading and is cut off for congestion. Both come back, fill their
    gaps with ``get_updates_between`` from PostgreSQL, and end with exactly
    the rows in the tables, in order, their generators at the writer's
    positions."""
    db = streams_env.db
    writer_gens = {n: await streams_env.make(DEFINITIONS[n], instance="main", writers=("main",)) for n in NAMES}
    writer = ReplicationHandler(
        "main", TwistedScheduler(reactor), sources=stream_sources(DEFINITIONS, writer_gens, db), writes=NAMES,
        metrics=ReplicationMetrics.create(CollectorRegistry()),
    )
    connect_streams(writer, writer_gens)
    registry = CollectorRegistry()
    server = ReplicationServerFactory(
        SERVER, writer, reactor, ReplicationMetrics.create(registry), ConnectionConfig(max_outbound_buffer=300)
    )
    port = reactor.listenTCP(0, server, interface="127.0.0.1")
    readers: dict[str, tuple[ReplicationHandler, Recorder, ReplicationClientFactory, dict[str, Any]]] = {}
    for name in ("reader_a", "reader_b"):
        gens = {n: await streams_env.make(DEFINITIONS[n], instance=name, writers=("main",)) for n in NAMES}
        metrics = ReplicationMetrics.create(CollectorRegistry())
        handler = ReplicationHandler(
            name, TwistedScheduler(reactor), sources=stream_sources(DEFINITIONS, gens, db), metrics=metrics
        )
        recorder = Recorder()
        handler.add_row_handler(recorder)
        connect_streams(handler, gens)
        factory = ReplicationClientFactory(name, handler, reactor, metrics, ConnectionConfig(expected_server_name=SERVER))
        reactor.connectTCP("127.0.0.1", port.getHost().port, factory)
        readers[name] = (handler, recorder, factory, gens)
    try:
        await wait_until(
            lambda: all(r[2].protocol_instance and r[2].protocol_instance.peer_name for r in readers.values())
            and len(server.connections) == 2,
            10,
            "both readers connected",
        )
        b_client = readers["reader_b"][2].protocol_instance
        assert b_client is not None
        b_client.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # type: ignore[union-attr]
        for protocol in server.connections:
            if protocol.transport.getPeer().port == b_client.transport.getHost().port:  # type: ignore[union-attr]
                protocol.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # type: ignore[union-attr]
        def congested() -> bool:
            return registry.get_sample_value(
                "tributary_replication_disconnects_total", {"transport": "tcp_server", "reason": "congested"}
            ) == 1

        rng = random.Random(3)
        written = 0
        step = 0
        while written < 15_000:
            stream = NAMES[step % 3]
            step += 1
            written += await writer_gens[stream].run_interaction(
                "write_facts", write_facts_txn, writer_gens[stream], stream, 40, rng
            )
            if step == 10:
                b_client.transport.pauseProducing()  # type: ignore[union-attr]
            if step > 10 and congested():
                b_client.transport.resumeProducing()  # type: ignore[union-attr]
            if step == 60:
                a_client = readers["reader_a"][2].protocol_instance
                assert a_client is not None
                a_client.transport.abortConnection()  # type: ignore[union-attr]
        await wait_until(congested, 15, "reader B cut off for congestion")
        b_client.transport.resumeProducing()  # type: ignore[union-attr]
        expected: dict[str, list[tuple[int, Row]]] = {}
        for n in NAMES:
            position = writer_gens[n].get_position("main")
            rows, upto, limited = await DEFINITIONS[n].get_updates_between(db, "main", 0, position, 1_000_000)
            assert not limited
            expected[n] = [(token, row_to_wire(row)) for token, row in rows]
        assert sum(len(rows) for rows in expected.values()) == written
        for name, (handler, recorder, _, gens) in readers.items():
            await wait_until(
                lambda: all(gens[n].get_position("main") == writer_gens[n].get_position("main") for n in NAMES)
                and not handler.busy(),
                30,
                f"{name} to catch up",
            )
            for n in NAMES:
                assert recorder.rows.get((n, "main"), []) == expected[n], f"{name}: rows of {n}"
                tokens = recorder.tokens[(n, "main")]
                assert tokens == sorted(set(tokens))
                assert handler.position(n, "main") == writer_gens[n].get_position("main")
    finally:
        for _, _, factory, _ in readers.values():
            factory.stop()
        server.close_all("server stopping")
        await port.stopListening()
        await deferLater(reactor, 0.05)
