"""The database's up/down state: transitions once each, backoff between attempts, probe rate limit;
and ``Database`` over a server that is not there (a socket folder with no PostgreSQL in it):
one warning for the outage, fast failures meanwhile, no connection attempt before the backoff."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock

from storage.availability import RECONNECT_BACKOFF, Availability, Transition
from storage.database import Database, DatabaseUnavailable
from storage.kernel.backoff import BackoffPolicy
from storage.metrics import StorageMetrics
from tests.twisted_plugin import reactor


def _no_jitter(low: float, high: float) -> float:
    return 1.0


def test_an_outage_is_one_down_and_one_up_whatever_happens_between() -> None:
    state = Availability(policy=BackoffPolicy(initial=1.0, multiplier=2.0, maximum=4.0))
    assert state.up and state.succeeded(0.0) is None
    assert state.failed(10.0, "refused", _no_jitter) is Transition.DOWN
    assert not state.up and state.reason == "refused" and state.down_since == 10.0
    assert state.failed(11.0, "refused again", _no_jitter) is None  # the same outage
    assert state.down_since == 10.0 and state.reason == "refused again"
    assert state.succeeded(20.0) is Transition.UP
    assert state.up and state.succeeded(21.0) is None
    assert state.failed(30.0, "refused", _no_jitter) is Transition.DOWN  # a new outage


def test_a_transaction_begun_before_the_outage_was_noticed_does_not_end_it() -> None:
    state = Availability()
    state.failed(10.0, "refused", _no_jitter)
    assert state.succeeded(10.5, started=9.0) is None and not state.up
    assert state.last_success == 10.5
    assert state.succeeded(11.0, started=10.8) is Transition.UP


def test_while_down_connections_wait_out_the_backoff_which_grows_to_its_cap_and_resets() -> None:
    state = Availability(policy=BackoffPolicy(initial=1.0, multiplier=2.0, maximum=4.0))
    assert state.may_connect(0.0)
    state.failed(0.0, "refused", _no_jitter)
    assert not state.may_connect(0.5) and state.retry_after(0.5) == 1
    assert state.may_connect(1.0)
    state.failed(1.0, "refused", _no_jitter)  # waits 2
    assert not state.may_connect(2.9) and state.may_connect(3.0)
    state.failed(3.0, "refused", _no_jitter)  # waits 4
    state.failed(7.0, "refused", _no_jitter)  # capped at 4
    assert state.retry_after(7.0) == 4 and not state.may_connect(10.9) and state.may_connect(11.0)
    state.succeeded(11.0)
    state.failed(12.0, "refused", _no_jitter)  # back to the first wait
    assert state.may_connect(13.0)


def test_probes_run_only_when_transactions_say_nothing_and_at_most_one_a_second() -> None:
    state = Availability(probe_interval=1.0)
    assert state.should_probe(0.0)  # nothing known yet
    assert not state.should_probe(5.0)  # that probe still runs
    state.probe_finished()
    state.succeeded(5.0)
    assert not state.should_probe(5.5)  # a transaction just worked
    assert state.should_probe(6.0)
    state.probe_finished()
    assert not state.should_probe(6.9)  # one a second, whoever asks
    assert state.should_probe(7.0)
    state.probe_finished()
    state.failed(7.1, "refused", _no_jitter)
    assert not state.should_probe(7.5) and state.should_probe(8.0)  # down: still one a second


def test_the_reconnect_policy_is_quick_at_first_and_capped_at_five_seconds() -> None:
    assert RECONNECT_BACKOFF.delay(1, _no_jitter) == 0.25
    assert RECONNECT_BACKOFF.delay(100, _no_jitter) == 5.0


def test_a_database_that_is_not_there_fails_fast_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No server listens in ``tmp_path``: the first connection fails and the outage is logged
    once; the next ones, inside the backoff's wait, fail at once without trying (the failure
    count does not move) and log nothing; each says how long to wait."""
    registry = CollectorRegistry()
    db = Database(MemoryReactorClock(), f"postgresql:///nothing?host={tmp_path}&port=5999",
                  metrics=StorageMetrics.create(registry))
    assert registry.get_sample_value("tributary_storage_database_up") == 1
    with caplog.at_level(logging.INFO, logger="storage.database"):
        for _ in range(20):
            with pytest.raises(DatabaseUnavailable) as failed:
                db._connection()
            assert failed.value.retry_after >= 1
    assert not db.up
    assert registry.get_sample_value("tributary_storage_database_up") == 0
    assert registry.get_sample_value("tributary_storage_connection_failures_total") == 1
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records)
    db.close()


async def test_a_health_check_never_waits_longer_than_its_timeout_and_shares_one_probe() -> None:
    """A server that accepts connections and never answers (the database host hangs): the
    health check says "down" once its timeout is over, a second check meanwhile waits on
    the same probe rather than starting one, and the probe ends when the server goes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    registry = CollectorRegistry()
    db = Database(reactor, f"postgresql://nobody@127.0.0.1:{port}/nothing", metrics=StorageMetrics.create(registry))
    try:
        first = Deferred.fromCoroutine(db.is_available(reactor, 0.2))
        second = Deferred.fromCoroutine(db.is_available(reactor, 0.2))
        assert await first is False and await second is False
        probe = db._probe
        assert probe is not None and not probe.called
        server.setblocking(False)
        accepted, _ = server.accept()  # the probe's connection, waiting for an answer
        with pytest.raises(BlockingIOError):
            server.accept()  # one probe for both checks
        accepted.close()
        server.close()
        assert await probe is False
    finally:
        server.close()
        db.close()
