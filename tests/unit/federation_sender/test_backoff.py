"""The backoff policy: the defaults operators know, jitter bounds, the cap, and which failures count."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from federation_sender.backoff import HEALTHY, RetryState, after_failure, is_unhealthy, policy_from_config
from federation_sender.config import BackoffConfig

MINUTE = 60_000
DEFAULT = policy_from_config(BackoffConfig())


def fixed(value: float):  # type: ignore[no-untyped-def]
    return lambda low, high: value


def test_defaults_start_at_ten_minutes_and_double() -> None:
    first = after_failure(DEFAULT, HEALTHY, 1_000, fixed(1.0))
    assert first == RetryState(retry_last_ts=1_000, retry_interval=10 * MINUTE, failure_ts=1_000)
    second = after_failure(DEFAULT, first, 5_000, fixed(1.0))
    assert second.retry_interval == 20 * MINUTE
    assert second.failure_ts == 1_000, "failure_ts stays at the first failure of the run"
    assert second.retry_last_ts == 5_000


def test_backing_off_until_the_interval_has_passed() -> None:
    state = after_failure(DEFAULT, HEALTHY, 0, fixed(1.0))
    assert state.backing_off(10 * MINUTE - 1)
    assert not state.backing_off(10 * MINUTE)
    assert not HEALTHY.backing_off(0)


def test_capped_at_seven_days() -> None:
    state = HEALTHY
    for i in range(40):
        state = after_failure(DEFAULT, state, i, fixed(1.4))
    assert state.retry_interval == int(timedelta(days=7).total_seconds() * 1000)


@given(st.lists(st.floats(min_value=0.8, max_value=1.4), min_size=1, max_size=30))
def test_interval_grows_within_the_jitter_bounds(draws: list[float]) -> None:
    state = after_failure(DEFAULT, HEALTHY, 0, fixed(1.0))
    for draw in draws:
        grown = after_failure(DEFAULT, state, 0, fixed(draw))
        low = min(int(state.retry_interval * 2 * 0.8), DEFAULT.maximum)
        high = min(int(state.retry_interval * 2 * 1.4), DEFAULT.maximum)
        assert low <= grown.retry_interval <= high
        state = grown


@pytest.mark.parametrize(
    ("status", "unhealthy"),
    [(None, True), (500, True), (502, True), (503, True), (401, True), (429, True),
     (400, False), (403, False), (404, False), (413, False)],
)
def test_only_health_failures_back_off(status: int | None, unhealthy: bool) -> None:
    assert is_unhealthy(status) is unhealthy
