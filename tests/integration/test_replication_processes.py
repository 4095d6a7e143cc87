# tests: replication/service.py replication/transport.py replication/redis_transport.py replication/handler.py replication/stream_sources.py
"""Replication between real OS processes, over real TCP and over real Redis,
on the real PostgreSQL streams.

The writer is this test process (the ``main`` instance, on the test reactor,
built with ``start_replication``); each reader is its own process
(tests/integration/replication_reader_proc.py) that records every row its row
handler is given in a file and starts, after a restart, from the last token in
that file. The test reads the files: across all of a reader's lives, every
row of every stream must be there exactly once, in token order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry
from twisted.internet.task import deferLater

from replication.config import RedisConfig, ReplicationConfig
from replication.stream_sources import connect_streams, row_to_wire, stream_sources
from replication.service import ReplicationService, start_replication
from storage.database import Database, Transaction
from storage.id_generators import StreamIdGenerator
from storage.metrics import StorageMetrics
from storage.stores.streams import (
    insert_cache_invalidations_txn,
    insert_device_list_changes_txn,
    insert_typing_txn,
)
from storage.streams import STREAMS, StreamName, create_id_generator
from tests.harness import free_port
from tests.twisted_plugin import reactor

REPO = Path(__file__).resolve().parents[2]
NAMES = ("caches", "typing", "device_lists")
DEFINITIONS = {name: STREAMS[StreamName(name)] for name in NAMES}
WRITER = "main"
TOTAL_ROWS = 50_000
FACTS_PER_TRANSACTION = 150
#: Rows written when reader B turns slow, reader A is killed the first time,
#: and the second time.
SLOW_AT, FIRST_KILL_AT, SECOND_KILL_AT = 4_000, 10_000, 30_000


def write_facts_txn(txn: Transaction, generator: StreamIdGenerator, stream: str, max_rows: int, seed: int) -> int:
    """Up to ``FACTS_PER_TRANSACTION`` facts of ``stream`` in one transaction,
    one to nine rows each (a third as many facts of one row for typing, whose
    store inserts a row at a time), ``max_rows`` rows at most; returns the
    rows written."""
    counts: list[int] = []
    facts = FACTS_PER_TRANSACTION // 3 if stream == "typing" else FACTS_PER_TRANSACTION
    while len(counts) < facts and sum(counts) < max_rows:
        count = 1 if stream == "typing" else 1 + (len(counts) * 7 + seed) % 9
        counts.append(min(count, max_rows - sum(counts)))
    for stream_id, count in zip(generator.get_next_mult_txn(txn, len(counts)), counts, strict=True):
        if stream == "caches":
            keys = [(f"@u{stream_id}_{i}:hs",) for i in range(count)]
            insert_cache_invalidations_txn(txn, stream_id, WRITER, "get_user_by_id", keys, 1000)
        elif stream == "typing":
            insert_typing_txn(txn, stream_id, WRITER, f"!room{stream_id % 7}:hs", [f"@u{stream_id}:hs"])
        else:
            insert_device_list_changes_txn(txn, stream_id, WRITER, [(f"@u{stream_id}:hs", f"D{i}") for i in range(count)])
    return sum(counts)


class Reader:
    """One reader instance: its output file, and its current process."""

    def __init__(self, name: str, spec: dict[str, Any], tmp: Path) -> None:
        self.name = name
        self.out = tmp / f"{name}.out"
        self.control = tmp / f"{name}.slow"
        self.stderr = tmp / f"{name}.err"
        self.spec = dict(spec, name=name, out=str(self.out), control=str(self.control))
        self.process: subprocess.Popen[bytes] | None = None
        self.lives = 0
        self._read = 0
        self.markers: list[str] = []
        self.last: dict[str, int] = {}

    def start(self) -> None:
        self.lives += 1
        with open(self.stderr, "ab") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.replication_reader_proc", json.dumps(self.spec)],
                cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self._read = 0  # the restart may cut a torn last line: read again
        self.markers, self.last = [], {}

    def poll(self) -> None:
        """Read what the process appended; fail if it died on its own."""
        if self.process is not None and self.process.poll() not in (None, -signal.SIGKILL):
            if not self.markers or not self.markers[-1].startswith("# end"):
                self.refresh()
                if not self.markers or not self.markers[-1].startswith("# end"):
                    raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.errors()}")
        self.refresh()

    def refresh(self) -> None:
        if not self.out.exists():
            return
        with open(self.out, "rb") as f:
            f.seek(self._read)
            data = f.read()
        complete = data.rfind(b"\n") + 1
        self._read += complete
        for line in data[:complete].decode().splitlines():
            if line.startswith("#"):
                self.markers.append(line)
            else:
                stream, _, token, _ = line.split(" ", 3)
                self.last[stream] = int(token)

    @property
    def ready(self) -> bool:
        """The current life has connected (its ``# start`` is the last one, with ``# ready`` after it)."""
        starts = [i for i, m in enumerate(self.markers) if m.startswith("# start")]
        return len(starts) == self.lives and "# ready" in self.markers[starts[-1]:]

    def errors(self) -> str:
        return self.stderr.read_text()[-3000:] if self.stderr.exists() else ""

    def records(self) -> tuple[dict[str, list[tuple[int, Any]]], dict[str, list[int]], list[str]]:
        """Rows and tokens per stream over all lives, and the markers; checks
        that each life started from the last tokens the lives before it recorded."""
        rows: dict[str, list[tuple[int, Any]]] = {n: [] for n in NAMES}
        tokens: dict[str, list[int]] = {n: [] for n in NAMES}
        markers = []
        for line in self.out.read_text().splitlines():
            if line.startswith("#"):
                markers.append(line)
                if line.startswith("# start "):
                    recorded = {f"{n} {WRITER}": t[-1] for n, t in tokens.items() if t}
                    assert json.loads(line.removeprefix("# start ")) == recorded, (
                        f"{self.name} restarted from {line}, but its file ends at {recorded}"
                    )
                continue
            stream, instance, token, payload = line.split(" ", 3)
            assert instance == WRITER, line
            tokens[stream].append(int(token))
            rows[stream].extend((int(token), row) for row in json.loads(payload))
        return rows, tokens, markers


async def wait_for(predicate: Any, timeout: float, what: str, readers: list[Reader], progress: Any = None) -> None:
    deadline = time.monotonic() + timeout
    report = time.monotonic() + 2
    while True:
        if progress is not None and time.monotonic() > report:
            report += 2
            progress()
        for r in readers:
            r.poll()
        if predicate():
            return
        if time.monotonic() > deadline:
            state = {r.name: (r.last, r.markers[-3:]) for r in readers}
            errors = "\n".join(f"--- {r.name} stderr:\n{r.errors()}" for r in readers)
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; readers: {state}\n{errors}")
        await deferLater(reactor, 0.05)


def kill_redis_clients(url: str, prefix: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        killed = 0
        for info in client.client_list():
            if info.get("name", "").startswith(prefix):
                client.client_kill_filter(_id=info["id"])
                killed += 1
        return killed
    finally:
        client.close()


def congestion_disconnects(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value(
        "tributary_replication_disconnects_total", {"transport": "tcp_server", "reason": "congested"}
    )
    return value or 0.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "redis"])
async def test_reader_processes_apply_every_row_once_through_kills_and_congestion(
    transport: str, database_dsn: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    """The writer (this process) writes 50,000 rows over caches, typing and
    device_lists, in transactions of up to 150 facts. Reader A is a process that is
    SIGKILLed at 10,000 and 30,000 rows and started again each time; it
    starts from the last token it recorded, and catches up from PostgreSQL.
    Reader B turns slow at 4,000 rows (its row handler blocks its reactor,
    so it stops reading its socket); over TCP the writer cuts it off for
    congestion; over Redis it is dropped as Redis drops a subscriber that does
    not keep up (the test kills its Redis connections: Redis itself would wait
    for megabytes of client-output-buffer-limit); then it
    is fast again, reconnects, and refills the gap from PostgreSQL. At the end
    each reader's file holds every row of the three streams once, in token
    order, and each reader stands at the writer's positions."""
    server_name = f"{unique_name}.example.com"
    spec: dict[str, Any] = {
        "server_name": server_name, "data_dir": str(tmp_path), "dsn": database_dsn,
        "streams": list(NAMES), "writer": WRITER,
    }  # fmt: skip
    if transport == "tcp":
        port = free_port()
        config = ReplicationConfig(max_outbound_buffer=500)
        listen = [("127.0.0.1", port)]
        spec["port"] = port
    else:
        config = ReplicationConfig(redis=RedisConfig(enabled=True, url=redis_url))
        listen = []
        spec.update(redis_url=redis_url, channel=unique_name)
    db = Database(reactor, database_dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=4)
    db.start()
    service: ReplicationService | None = None
    a = Reader(f"{unique_name}_a", spec, tmp_path)
    b = Reader(f"{unique_name}_b", spec, tmp_path)
    readers = [a, b]
    began = time.monotonic()

    def mark(what: str) -> None:
        print(f"{time.monotonic() - began:6.2f} s  {what}")

    gens: dict[str, StreamIdGenerator] = {}
    try:
        gens = {n: await create_id_generator(db, reactor, DEFINITIONS[n], instance_name=WRITER, writers=(WRITER,)) for n in NAMES}
        registry = CollectorRegistry()
        service = await start_replication(
            reactor, config, registry, server_name=server_name, instance_name=WRITER,
            sources=stream_sources(DEFINITIONS, gens, db), writes=NAMES, listen=listen, redis_channel=unique_name,
        )  # fmt: skip
        connect_streams(service.handler, gens)
        for r in readers:
            r.start()
        await wait_for(lambda: a.ready and b.ready, 30, "both readers to connect", readers)
        mark("readers connected")

        written = 0
        step = 0
        b_slow_since: int | None = None
        b_cut = False
        congested_before = 0.0
        kills = 0
        while written < TOTAL_ROWS:
            stream = NAMES[step % 3]
            written += await gens[stream].run_interaction(
                "write_facts", write_facts_txn, gens[stream], stream, TOTAL_ROWS - written, step
            )
            step += 1
            for r in readers:
                r.poll()
            if b_slow_since is None and written >= SLOW_AT:
                b.control.touch()
                if transport == "tcp":
                    # A small send buffer on B's connection here (and a small
                    # receive buffer in B while slow), so that B falling behind
                    # shows within hundreds of commands, not megabytes of kernel buffers.
                    assert service.server is not None
                    b_conns = [p for p in service.server.connections if p.peer_name == b.name]
                    assert len(b_conns) == 1
                    b_conns[0].transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # type: ignore[union-attr]
                    congested_before = congestion_disconnects(registry)
                mark(f"B slow at {written} rows")
                b_slow_since = written
            if b_slow_since is not None and not b_cut:
                if transport == "tcp":
                    b_cut = congestion_disconnects(registry) > congested_before
                elif written - b_slow_since >= 8_000:
                    assert kill_redis_clients(redis_url, f"tributary-replication-{b.name}") == 2
                    b_cut = True
                if b_cut:
                    b.control.unlink()
                    mark(f"B cut off at {written} rows")
            if kills < 2 and written >= (FIRST_KILL_AT, SECOND_KILL_AT)[kills]:
                await wait_for(lambda: a.ready, 30, f"reader A (life {a.lives}) to connect before kill", readers)
                a.kill()
                a.start()
                mark(f"A killed and restarted at {written} rows")
                kills += 1
        assert kills == 2
        if not b_cut:
            await wait_for(lambda: congestion_disconnects(registry) > congested_before, 30, "the writer to cut B off for congestion", readers)
            b.control.unlink()
        positions = {n: gens[n].get_position(WRITER) for n in NAMES}
        mark(f"all written: {positions}")
        await wait_for(
            lambda: all(r.last.get(n) == positions[n] for r in readers for n in NAMES), 40,
            f"readers to catch up with the writer at {positions}", readers,
            lambda: mark(f"sent {[service.handler.last_sent(n) for n in NAMES]} A {a.last} B {b.last}"),
        )
        mark("readers caught up")
        for r in readers:
            assert r.process is not None
            r.process.send_signal(signal.SIGTERM)
            assert r.process.wait(20) == 0, f"{r.name} did not stop cleanly:\n{r.errors()}"
        mark("readers stopped")

        mark("readers stopped")
        expected: dict[str, list[tuple[int, Any]]] = {}
        for n in NAMES:
            in_db, _, limited = await DEFINITIONS[n].get_updates_between(db, WRITER, 0, positions[n], 10 * TOTAL_ROWS)
            assert not limited
            expected[n] = [(token, json.loads(json.dumps(row_to_wire(row)))) for token, row in in_db]
        assert sum(len(rows) for rows in expected.values()) == written == TOTAL_ROWS
        mark("read the streams")
        all_markers = {}
        for r in readers:
            applied, tokens, markers = r.records()
            all_markers[r.name] = markers
            for n in NAMES:
                assert tokens[n] == sorted(set(tokens[n])), f"{r.name}: tokens of {n} repeat or go back"
                assert len(applied[n]) == len(expected[n]), (
                    f"{r.name}: {len(applied[n])} rows of {n}, expected {len(expected[n])}"
                )
                assert applied[n] == expected[n], f"{r.name}: rows of {n} differ"
            end = json.loads(markers[-1].removeprefix("# end "))
            assert end["positions"] == positions, f"{r.name} ends at {end['positions']}, the writer at {positions}"
            starts = [json.loads(m.removeprefix("# start ")) for m in markers if m.startswith("# start")]
            assert len(starts) == r.lives
        # A's second and third lives started where the previous one stopped recording, not at 0.
        a_starts = [json.loads(m.removeprefix("# start ")) for m in all_markers[a.name] if m.startswith("# start")]
        assert a.lives == 3 and a_starts[0] == {} and all(s for s in a_starts[1:]), a_starts
        b_end = json.loads(all_markers[b.name][-1].removeprefix("# end "))
        assert sum(v for k, v in b_end["counters"].items() if k.startswith("tributary_replication_gap_fill_rows_total")) > 0, (
            f"B never refilled from the database: {b_end}"
        )
        assert b_cut
        mark("checked")
    finally:
        for r in readers:
            if r.process is not None and r.process.poll() is None:
                r.process.kill()
                r.process.wait()
        if service is not None:
            await service.stop()
        for g in gens.values():
            await g.flush()
        db.close()
        mark("writer stopped")
