# tests: helper for tests/integration/test_replication_tcp.py and test_replication_redis.py
"""Shared pieces of the replication integration tests (no tests here).

``Producer`` writes rows into in-memory streams the way a stream writer does
(several rows per stream ID sometimes, abandoned IDs sometimes) and tells the
writer's handler after each fact; ``Recorder`` is a reader's row handler that
remembers everything it was given; ``assert_exactly_once`` checks a reader
against the writers' streams: every row once, in order, same positions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry
from twisted.internet.task import deferLater

from replication.commands import Row
from replication.handler import MemoryStream, ReplicationHandler
from replication.metrics import ReplicationMetrics
from replication.transport import TwistedScheduler
from tests.twisted_plugin import reactor

STREAMS = ("events", "caches", "typing")


class Recorder:
    """A reader's ``RowHandler``: every call, per (stream, writer)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[tuple[int, Row]]] = {}
        self.tokens: dict[tuple[str, str], list[int]] = {}
        self.count = 0

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
        key = (stream, instance)
        self.tokens.setdefault(key, []).append(token)
        target = self.rows.setdefault(key, [])
        for row in rows:
            target.append((token, row))
        self.count += len(rows)


def make_handler(
    name: str,
    sources: dict[str, object],
    writes: Sequence[str] = (),
    **kwargs: object,
) -> tuple[ReplicationHandler, ReplicationMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = ReplicationMetrics.create(registry, sources)
    handler = ReplicationHandler(
        name, TwistedScheduler(reactor), sources=sources, writes=writes, metrics=metrics, **kwargs  # type: ignore[arg-type]
    )
    return handler, metrics, registry


class Producer:
    """Writes ``rows`` rows spread over ``(stream, writer)`` pairs, in facts of
    one to three rows, sometimes skipping IDs; yields to the reactor every
    ``yield_every`` rows so the transports run meanwhile."""

    def __init__(
        self,
        streams: dict[str, MemoryStream],
        writers: dict[str, tuple[ReplicationHandler, Sequence[str]]],
        seed: int = 8,
    ) -> None:
        self.streams = streams
        self.writers = writers
        self.rng = random.Random(seed)
        # One shared sequence per stream, as Postgres gives multi-writer streams.
        self.next_id = {name: 0 for name in streams}
        self.written = 0
        self.completed_at: dict[Row, float] = {}

    async def produce(self, rows: int, yield_every: int = 500, on_progress: Callable[[int], object] | None = None) -> None:
        pairs = [(stream, writer) for writer, (_, names) in self.writers.items() for stream in names]
        since_yield = 0
        while self.written < rows:
            stream, writer = self.rng.choice(pairs)
            handler = self.writers[writer][0]
            self.next_id[stream] += 1 + (self.rng.random() < 0.1)  # 10% abandoned IDs
            token = self.next_id[stream]
            count = min(self.rng.choice((1, 1, 1, 2, 3)), rows - self.written)
            new_rows = [(stream, writer, token, i, "x" * 40) for i in range(count)]
            self.streams[stream].write(writer, token, new_rows)
            handler.on_stream_advanced(stream)
            self.written += count
            since_yield += count
            if since_yield >= yield_every:
                since_yield = 0
                if on_progress is not None:
                    on_progress(self.written)
                await deferLater(reactor, 0)


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await deferLater(reactor, 0.02)


def converged(reader: ReplicationHandler, streams: dict[str, MemoryStream]) -> bool:
    for name, stream in streams.items():
        for writer in stream.instances():
            if reader.position(name, writer) != stream.current_position(writer):
                return False
    return not reader.busy()


def assert_exactly_once(recorder: Recorder, reader: ReplicationHandler, streams: dict[str, MemoryStream]) -> None:
    for name, stream in streams.items():
        for writer in stream.instances():
            key = (name, writer)
            assert recorder.rows.get(key, []) == stream.rows(writer), f"rows of {key} differ"
            tokens = recorder.tokens.get(key, [])
            assert tokens == sorted(set(tokens)), f"tokens of {key} not strictly ascending"
            assert reader.position(name, writer) == stream.current_position(writer)
