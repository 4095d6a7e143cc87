"""Prometheus metrics of the request handlers that are not the persistence path.

``SyncMetrics``: ``/sync`` long-polls (``homeserver.handlers.sync.sync``). Event
persistence declares its own next to its code
(``homeserver.handlers.rooms.event_persistence.PersistenceMetrics``). Labels come
from closed sets only: the kind of sync (``SYNC_KINDS``).
"""

# tests: tests/integration/test_metrics_doc.py

from __future__ import annotations

from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Gauge, Histogram

#: ``initial``: no ``since`` token (or ``full_state``); ``incremental``: everything else.
SYNC_KINDS: Final = ("initial", "incremental", "sliding_initial", "sliding_incremental")

SYNC_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAKE_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@attrs.frozen
class SyncMetrics:
    long_polls: Gauge
    wake_latency: Histogram
    duration: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> SyncMetrics:
        metrics = cls(
            long_polls=Gauge(
                "tributary_sync_long_polls_active",
                "/sync requests waiting for something to change for their user now.",
                registry=registry,
            ),
            wake_latency=Histogram(
                "tributary_sync_wake_latency_seconds",
                "Time from a stream advance waking a waiting /sync to its response being ready, "
                "for wake-ups that had something to send.",
                buckets=WAKE_BUCKETS,
                registry=registry,
            ),
            duration=Histogram(
                "tributary_sync_duration_seconds",
                "Time to compute one /sync response (not counting time spent waiting), by kind.",
                ["kind"],
                buckets=SYNC_BUCKETS,
                registry=registry,
            ),
        )
        for kind in SYNC_KINDS:
            metrics.duration.labels(kind)
        return metrics
