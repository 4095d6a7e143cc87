"""Process-wide metrics of a homeserver process: reactor tick lag.

CPU seconds, resident memory and open file descriptors come from
prometheus-client's process collector (``process_*``), added to every
process's registry by ``homeserver.app.new_registry``. ``ReactorTickMonitor``
measures how late the reactor runs a timer, which is how long callbacks (or
blocking code) held the event loop: every request, replication line and timer
waits that long too.
"""

# tests: tests/unit/test_process_metrics.py

from __future__ import annotations

from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Gauge, Histogram
from twisted.internet.interfaces import IDelayedCall, IReactorTime

#: Seconds between two reactor lag measurements.
TICK_INTERVAL: Final = 0.5
TICK_LAG_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@attrs.frozen
class ReactorMetrics:
    tick_lag: Histogram
    last_tick_lag: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ReactorMetrics:
        return cls(
            tick_lag=Histogram(
                "tributary_reactor_tick_lag_seconds",
                "How much later than scheduled the reactor ran a periodic timer (time the event loop was busy).",
                buckets=TICK_LAG_BUCKETS,
                registry=registry,
            ),
            last_tick_lag=Gauge(
                "tributary_reactor_last_tick_lag_seconds",
                "The most recent reactor tick lag measurement.",
                registry=registry,
            ),
        )


class ReactorTickMonitor:
    """Schedules a timer every ``interval`` seconds on ``clock`` and records how late it fired."""

    def __init__(self, clock: IReactorTime, metrics: ReactorMetrics, interval: float = TICK_INTERVAL) -> None:
        self._clock = clock
        self._metrics = metrics
        self._interval = interval
        self._call: IDelayedCall | None = None
        self._due = 0.0

    def start(self) -> None:
        if self._call is None:
            self._schedule()

    def stop(self) -> None:
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()

    def _schedule(self) -> None:
        self._due = self._clock.seconds() + self._interval
        self._call = self._clock.callLater(self._interval, self._tick)

    def _tick(self) -> None:
        lag = max(self._clock.seconds() - self._due, 0.0)
        self._metrics.tick_lag.observe(lag)
        self._metrics.last_tick_lag.set(lag)
        self._schedule()
