"""Prometheus metrics of the storage layer, declared against a given registry.

``StorageMetrics``: the pool, transactions and migrations (``storage.database``,
``storage.prepare``). ``StreamMetrics``: stream positions and facts written,
fed by the ID generators' listeners (``storage.id_generators``), so the
generators themselves stay free of Prometheus. Labels: transaction names
(code constants), stream names and configured writer instances; nothing else.
"""

# tests: tests/unit/storage/test_stream_metrics.py

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)


class Children(dict[str | tuple[str, ...], M]):
    """A labelled metric's children by their label values (one value as a string, several as a
    tuple), each child made once. ``labels()`` takes a lock and builds its key on every call,
    which shows where a child is touched once an event (an inbound PDU, an event loaded)."""

    def __init__(self, metric: M) -> None:
        super().__init__()
        self._metric = metric

    def __missing__(self, values: str | tuple[str, ...]) -> M:
        child: M = self._metric.labels(values) if isinstance(values, str) else self._metric.labels(*values)
        self[values] = child
        return child


TXN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@attrs.frozen
class StorageMetrics:
    txn_duration: Histogram
    txn_total: Counter
    txn_retries: Counter
    pool_in_use: Gauge
    pool_waiting: Gauge
    migrations_applied: Counter
    database_up: Gauge
    connection_failures: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> StorageMetrics:
        return cls(
            txn_duration=Histogram(
                "tributary_storage_txn_duration_seconds",
                "Time a database transaction took on its pool thread, by transaction name.",
                ["txn"],
                buckets=TXN_BUCKETS,
                registry=registry,
            ),
            txn_total=Counter(
                "tributary_storage_txn_total",
                "Database transactions finished, by transaction name and outcome (ok or error).",
                ["txn", "outcome"],
                registry=registry,
            ),
            txn_retries=Counter(
                "tributary_storage_txn_retries_total",
                "Transactions retried after a serialization failure or deadlock, by transaction name.",
                ["txn"],
                registry=registry,
            ),
            pool_in_use=Gauge(
                "tributary_storage_pool_connections_in_use",
                "Database connections running a transaction now.",
                registry=registry,
            ),
            pool_waiting=Gauge(
                "tributary_storage_pool_transactions_waiting",
                "Transactions waiting for a free database connection.",
                registry=registry,
            ),
            migrations_applied=Counter(
                "tributary_storage_migrations_applied_total",
                "Schema migrations this process applied.",
                registry=registry,
            ),
            database_up=Gauge(
                "tributary_storage_database_up",
                "1 while the database can be reached, 0 from a failed connection until one works again.",
                registry=registry,
            ),
            connection_failures=Counter(
                "tributary_storage_connection_failures_total",
                "Connections to the database that could not be made.",
                registry=registry,
            ),
        )


class TrackedStream(Protocol):
    """What ``StreamMetrics.track`` needs of a ``storage.id_generators.StreamIdGenerator``."""

    stream_name: str

    @property
    def writers(self) -> tuple[str, ...]: ...

    def get_position(self, instance: str) -> int: ...

    def add_position_listener(self, listener: Callable[[str, str, int, int], None]) -> None: ...

    def add_written_listener(self, listener: Callable[[str, int], None]) -> None: ...


@attrs.frozen
class StreamMetrics:
    position: Gauge
    facts_written: Counter
    # Their children, touched each time a stream moves.
    _positions: Children[Gauge] = attrs.field(init=False, default=attrs.Factory(
        lambda self: Children(self.position), takes_self=True))
    _written: Children[Counter] = attrs.field(init=False, default=attrs.Factory(
        lambda self: Children(self.facts_written), takes_self=True))

    @classmethod
    def create(cls, registry: CollectorRegistry) -> StreamMetrics:
        return cls(
            position=Gauge(
                "tributary_stream_position",
                "Current position (stream ID) of each writer of each stream, as this process knows it.",
                ["stream", "writer"],
                registry=registry,
            ),
            facts_written=Counter(
                "tributary_stream_facts_written_total",
                "Stream facts (stream IDs) this process wrote and committed, by stream.",
                ["stream"],
                registry=registry,
            ),
        )

    def track(self, generator: TrackedStream) -> None:
        """Follow one stream's generator: its writers' positions now and as they move."""
        stream = generator.stream_name
        self.facts_written.labels(stream)
        for writer in generator.writers:
            self.position.labels(stream, writer).set(generator.get_position(writer))
        generator.add_position_listener(self._on_position)
        generator.add_written_listener(self._on_written)

    def _on_position(self, stream: str, writer: str, old: int, new: int) -> None:
        self._positions[stream, writer].set(new)

    def _on_written(self, stream: str, count: int) -> None:
        self._written[stream].inc(count)
