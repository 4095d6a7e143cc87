"""How long a failing destination is left alone, and which failures count.

Pure: the retry state of one destination and the policy that grows it. Time is
an argument (milliseconds) and the jitter draw is injected, so every decision
is reproducible in tests. Persisting the state (``destinations.retry_last_ts``,
``retry_interval``, ``failure_ts``) and deciding to catch up are the caller's.
"""

# tests: tests/unit/federation_sender/test_backoff.py

from __future__ import annotations

import attrs

from federation_sender.config import BackoffConfig
from storage.kernel.backoff import BackoffPolicy, Jitter

__all__ = ["BackoffPolicy", "Jitter", "RetryState", "HEALTHY", "after_failure", "is_unhealthy", "policy_from_config"]


@attrs.frozen
class RetryState:
    """A destination's backoff as stored in ``destinations``.

    ``retry_interval`` 0 means healthy. ``failure_ts`` is the first failure of
    the current run of failures (when the destination went down, as far as we know).
    """

    retry_last_ts: int = 0
    retry_interval: int = 0
    failure_ts: int | None = None

    @property
    def healthy(self) -> bool:
        return self.retry_interval == 0

    @property
    def retry_at(self) -> int:
        """The first moment (ms) another attempt may be made."""
        return self.retry_last_ts + self.retry_interval

    def backing_off(self, now_ms: int) -> bool:
        return self.retry_interval > 0 and now_ms < self.retry_at


HEALTHY = RetryState()


def policy_from_config(config: BackoffConfig) -> BackoffPolicy:
    """The kernel's policy in milliseconds, from ``federation_sender.backoff``."""
    return BackoffPolicy(
        initial=config.initial.total_seconds() * 1000,
        multiplier=config.multiplier,
        maximum=config.max.total_seconds() * 1000,
        jitter=config.jitter,
    )


def after_failure(policy: BackoffPolicy, state: RetryState, now_ms: int, jitter: Jitter) -> RetryState:
    """The state after one more failed attempt at ``now_ms``.

    The first failure waits exactly ``initial``; each later one multiplies the
    previous interval by ``multiplier`` and a jitter draw, capped at ``max``
    (``BackoffPolicy.next_interval``).
    """
    interval = max(1, int(policy.next_interval(state.retry_interval, jitter)))
    return RetryState(
        retry_last_ts=now_ms,
        retry_interval=interval,
        failure_ts=state.failure_ts if state.failure_ts is not None else now_ms,
    )


def is_unhealthy(status: int | None) -> bool:
    """Whether a failed request says the destination is unhealthy, so it backs off.

    ``None`` is a failure with no response at all (connection refused or reset,
    TLS failure, timeout). Of the answers, 5xx, 401 (it cannot check our
    signatures: its key store or clock is broken) and 429 (it asks us to slow
    down) count; other 4xx answers are about the request, and backing off would
    not change them.
    """
    if status is None:
        return True
    return status >= 500 or status in (401, 429)
