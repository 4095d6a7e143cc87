"""Supervision of the embedded PostgreSQL, on a fake clock: a death is noticed at the next look,
the first restart is at once, failed restarts back off, and giving up happens once, after
``give_up_after`` seconds down, with the cause."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from storage.embedded_supervisor import Decision, EmbeddedSupervisor, Supervision
from storage.kernel.backoff import BackoffPolicy

POLICY = BackoffPolicy(initial=1.0, multiplier=2.0, maximum=4.0)


def no_jitter(low: float, high: float) -> float:
    return 1.0


def test_an_alive_postmaster_needs_nothing() -> None:
    state = Supervision(POLICY, give_up_after=30.0, jitter=no_jitter)
    assert [state.observe(True, t) for t in (0.0, 1.0, 2.0)] == [Decision.NOTHING] * 3
    assert state.down_since is None


def test_a_death_is_restarted_at_once_then_with_backoff_until_it_gives_up() -> None:
    state = Supervision(POLICY, give_up_after=10.0, jitter=no_jitter)
    assert state.observe(False, 100.0) is Decision.RESTART
    assert state.observe(False, 100.5) is Decision.NOTHING  # a restart is in flight
    state.restarted(False, 101.0)
    assert state.observe(False, 101.5) is Decision.NOTHING  # 1 s after the failure
    assert state.observe(False, 102.0) is Decision.RESTART
    state.restarted(False, 102.0)
    assert state.observe(False, 103.9) is Decision.NOTHING  # 2 s now
    assert state.observe(False, 104.0) is Decision.RESTART
    state.restarted(False, 104.0)
    assert state.observe(False, 107.9) is Decision.NOTHING  # 4 s, the cap
    assert state.observe(False, 110.0) is Decision.GIVE_UP  # down since 100.0
    assert state.observe(False, 111.0) is Decision.NOTHING  # once
    assert state.failures == 3


def test_a_successful_restart_starts_the_count_again() -> None:
    state = Supervision(POLICY, give_up_after=10.0, jitter=no_jitter)
    assert state.observe(False, 0.0) is Decision.RESTART
    state.restarted(False, 0.0)
    assert state.observe(False, 1.0) is Decision.RESTART
    state.restarted(True, 1.5)
    assert state.observe(True, 2.0) is Decision.NOTHING
    # A second death, much later, is a new outage with its own give-up deadline.
    assert state.observe(False, 50.0) is Decision.RESTART
    assert state.down_since == 50.0 and state.failures == 0


class FakeCluster:
    def __init__(self) -> None:
        self.alive = True
        self.restarts_work = True
        self.restart_calls = 0
        self.log_path = "/data/postgres/postgres.log"

    def postmaster_running(self) -> bool:
        return self.alive

    def restart(self) -> None:
        self.restart_calls += 1
        if not self.restarts_work:
            raise RuntimeError("pg_ctl: could not start server")
        self.alive = True


def inline(func: Callable[[], None]) -> Deferred[Any]:
    try:
        func()
    except Exception as e:
        return fail(e)
    return succeed(None)


def test_the_loop_restarts_a_dead_postmaster_within_a_second(caplog: pytest.LogCaptureFixture) -> None:
    clock, cluster, fatal = Clock(), FakeCluster(), []
    supervisor = EmbeddedSupervisor(cluster, clock, fatal.append, restart_in_thread=inline)
    supervisor.start()
    clock.advance(0.5)
    assert cluster.restart_calls == 0
    cluster.alive = False
    clock.advance(0.5)
    assert cluster.restart_calls == 1 and cluster.alive and supervisor.restarts == 1
    clock.advance(5.0)
    assert cluster.restart_calls == 1 and fatal == []
    messages = [r.getMessage() for r in caplog.records if r.name == "storage.embedded_supervisor"]
    assert messages == ["embedded PostgreSQL has died; restarting it", "embedded PostgreSQL restarted"]
    supervisor.stop()


def test_the_loop_gives_up_once_naming_the_cause() -> None:
    clock, cluster, fatal = Clock(), FakeCluster(), []
    supervision = Supervision(POLICY, give_up_after=10.0, jitter=no_jitter)
    supervisor = EmbeddedSupervisor(cluster, clock, fatal.append, supervision=supervision, restart_in_thread=inline)
    supervisor.start()
    cluster.alive, cluster.restarts_work = False, False
    for _ in range(40):
        clock.advance(0.5)
    assert len(fatal) == 1
    assert "could not be restarted for 10s" in fatal[0] and "/data/postgres/postgres.log" in fatal[0]
    assert 3 <= cluster.restart_calls <= 5  # at once, then after 1, 2 and 4 s
