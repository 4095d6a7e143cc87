"""The shared kernel: the backoff policy's numbers, and background work that never fails silently."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, fail, succeed

from storage.kernel.background import register_metrics, run_in_background
from storage.kernel.backoff import BackoffPolicy
from storage.kernel.errors import Unavailable


def fixed(value: float):  # type: ignore[no-untyped-def]
    return lambda low, high: value


def test_backoff_starts_at_initial_then_grows_to_the_cap() -> None:
    policy = BackoffPolicy(initial=0.5, multiplier=2.0, maximum=30.0)
    assert [policy.delay(n, fixed(1.0)) for n in range(1, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert policy.next_interval(None) == 0.5
    assert policy.next_interval(0.5, fixed(1.0)) == 1.0
    assert policy.next_interval(20.0, fixed(1.0)) == 30.0
    # A run of failures far longer than any real one neither overflows nor passes the cap.
    assert policy.delay(10_000, fixed(1.0)) == 30.0


def test_backoff_jitter_scales_the_delay() -> None:
    policy = BackoffPolicy(initial=1.0, multiplier=2.0, maximum=60.0, jitter=(0.8, 1.2))
    assert policy.delay(3, fixed(0.8)) == pytest.approx(3.2)
    assert policy.delay(3, fixed(1.2)) == pytest.approx(4.8)


@pytest.mark.parametrize("bad", [dict(initial=0), dict(initial=5, maximum=1), dict(multiplier=0.5),
                                 dict(jitter=(1.2, 0.8)), dict(jitter=(0.0, 1.0))])
def test_backoff_refuses_nonsense(bad: dict[str, object]) -> None:
    args: dict[str, object] = dict(initial=1.0, multiplier=2.0, maximum=10.0)
    args.update(bad)
    with pytest.raises(ValueError):
        BackoffPolicy(**args)  # type: ignore[arg-type]


def _failures(task: str) -> Callable[[], float]:
    """The failure count of ``task`` as a fresh registry serves it, read when called."""
    registry = CollectorRegistry()
    register_metrics(registry)
    return lambda: registry.get_sample_value("tributary_background_task_failures_total", {"task": task}) or 0.0


def test_background_failure_is_logged_counted_and_swallowed(caplog: pytest.LogCaptureFixture) -> None:
    failures = _failures("kernel_test")
    before = failures()

    async def boom() -> None:
        raise RuntimeError("the disk is on fire")

    with caplog.at_level(logging.ERROR, logger="storage.kernel.background"):
        d = run_in_background("kernel_test", boom())
    results: list[object] = []
    d.addBoth(results.append)
    assert results == [None], "the returned Deferred fires with None, never an error"
    assert "kernel_test" in caplog.text and "the disk is on fire" in caplog.text
    assert failures() == before + 1


def test_background_work_cut_short_by_an_outage_is_counted_without_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """The storage layer logs an outage once; each task that meets it adds no line of its own."""
    failures = _failures("kernel_outage")
    before = failures()

    async def outage() -> None:
        raise Unavailable("the database is unreachable")

    with caplog.at_level(logging.INFO, logger="storage.kernel.background"):
        run_in_background("kernel_outage", outage())
    assert caplog.records == []
    assert failures() == before + 1


def test_background_passes_results_through_and_accepts_deferreds() -> None:
    async def answer() -> int:
        return 42

    results: list[object] = []
    run_in_background("kernel_test_ok", answer()).addBoth(results.append)
    run_in_background("kernel_test_ok", succeed(7)).addBoth(results.append)
    run_in_background("kernel_test_ok", fail(ValueError("x"))).addBoth(results.append)
    assert results == [42, 7, None]


def test_cancelling_background_work_is_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    waiting: Deferred[None] = Deferred()
    with caplog.at_level(logging.ERROR, logger="storage.kernel.background"):
        d = run_in_background("kernel_test_cancel", waiting)
        d.cancel()
    assert "kernel_test_cancel" not in caplog.text


def _driven(coro: object) -> Deferred[object]:
    return Deferred.fromCoroutine(coro)  # type: ignore[arg-type]


def test_map_concurrently_caps_calls_in_flight_and_keeps_order() -> None:
    """Ten calls, limit three: never more than three wait at once, results in input order
    although the calls finish in reverse."""
    from storage.kernel.concurrency import map_concurrently

    gates: dict[int, Deferred[None]] = {}
    in_flight: list[int] = []
    peak = 0

    async def call(n: int) -> int:
        nonlocal peak
        in_flight.append(n)
        peak = max(peak, len(in_flight))
        gates[n] = Deferred()
        await gates[n]
        in_flight.remove(n)
        return n * 10

    result: list[object] = []
    _driven(map_concurrently(call, range(10), limit=3)).addBoth(result.append)
    while not result:
        assert len(in_flight) <= 3 and in_flight
        gates[max(in_flight)].callback(None)
    assert peak == 3
    assert result == [[n * 10 for n in range(10)]]


def test_map_concurrently_first_failure_cancels_the_rest() -> None:
    from twisted.internet.defer import CancelledError

    from storage.kernel.concurrency import map_concurrently

    waiting: list[Deferred[None]] = []
    cancelled: list[int] = []

    async def call(n: int) -> int:
        if n == 2:
            raise ValueError("boom")
        d: Deferred[None] = Deferred()
        waiting.append(d)
        try:
            await d
        except CancelledError:
            cancelled.append(n)
            raise
        return n

    result: list[object] = []
    _driven(map_concurrently(call, range(5), limit=3)).addBoth(result.append)
    assert len(result) == 1 and result[0].check(ValueError)  # type: ignore[attr-defined]
    assert sorted(cancelled) == [0, 1]
    assert _driven(map_concurrently(call, [], limit=2)).result == []
    refused: list[object] = []
    _driven(map_concurrently(call, [1], limit=0)).addErrback(lambda f: refused.append(f.value))
    assert isinstance(refused[0], ValueError)
