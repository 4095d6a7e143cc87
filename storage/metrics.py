"""Prometheus metrics of the storage layer, declared against a given registry."""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TXN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@attrs.frozen
class StorageMetrics:
    txn_duration: Histogram
    txn_total: Counter
    txn_retries: Counter
    pool_in_use: Gauge
    pool_waiting: Gauge
    migrations_applied: Counter

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
        )
