"""Reactor tick lag on a fake clock: on time is 0, a blocked loop shows as the time it was late."""

# tests: homeserver/metrics.py

from __future__ import annotations

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock

from homeserver.metrics import ReactorMetrics, ReactorTickMonitor


def test_tick_lag_is_how_late_the_timer_ran() -> None:
    registry = CollectorRegistry()
    clock = Clock()
    monitor = ReactorTickMonitor(clock, ReactorMetrics.create(registry), interval=0.5)
    monitor.start()
    clock.advance(0.5)  # on time
    assert registry.get_sample_value("tributary_reactor_tick_lag_seconds_count") == 1
    assert registry.get_sample_value("tributary_reactor_last_tick_lag_seconds") == 0
    clock.advance(2.0)  # the loop was busy for 1.5 s past the next tick
    assert registry.get_sample_value("tributary_reactor_tick_lag_seconds_count") == 2
    assert registry.get_sample_value("tributary_reactor_last_tick_lag_seconds") == 1.5
    assert registry.get_sample_value("tributary_reactor_tick_lag_seconds_bucket", {"le": "1.0"}) == 1
    monitor.stop()
    assert clock.getDelayedCalls() == []
    clock.advance(10)
    assert registry.get_sample_value("tributary_reactor_tick_lag_seconds_count") == 2
