"""The one backoff policy: how long to wait after the n-th failure in a row.

Pure: the policy grows an interval, time and randomness are the caller's. The
first failure waits ``initial``; each later one the previous interval times
``multiplier``, times a jitter draw from ``jitter`` (so processes restarted
together do not retry in lock-step), capped at ``maximum``. Units are the
caller's (seconds for reconnects, milliseconds for the federation sender's
persisted intervals).
"""

# tests: tests/unit/storage/test_kernel.py

from __future__ import annotations

import random
from collections.abc import Callable

import attrs

# A draw from [low, high]: ``random.uniform`` in production, a constant in tests.
Jitter = Callable[[float, float], float]


@attrs.frozen
class BackoffPolicy:
    initial: float
    multiplier: float
    maximum: float
    jitter: tuple[float, float] = (1.0, 1.0)

    def __attrs_post_init__(self) -> None:
        if not (0 < self.initial <= self.maximum):
            raise ValueError(f"backoff needs 0 < initial <= maximum, got initial={self.initial} maximum={self.maximum}")
        if self.multiplier < 1:
            raise ValueError(f"backoff multiplier must be at least 1, got {self.multiplier}")
        low, high = self.jitter
        if not (0 < low <= high):
            raise ValueError(f"backoff jitter must be a range 0 < low <= high, got {self.jitter}")

    def next_interval(self, previous: float | None, jitter: Jitter = random.uniform) -> float:
        """The wait after one more failure, given the wait after the last one (``None``/0: the first)."""
        if not previous or previous <= 0:
            return self.initial
        return min(previous * self.multiplier * jitter(*self.jitter), self.maximum)

    def delay(self, attempt: int, jitter: Jitter = random.uniform) -> float:
        """The wait before retry ``attempt`` (1-based) of a run of failures, with one jitter draw."""
        # The exponent is capped: past it every multiplier over 1 has reached the maximum anyway.
        base = min(self.initial * self.multiplier ** min(max(0, attempt - 1), 256), self.maximum)
        return base * jitter(*self.jitter)
