"""Rate limiting: token buckets keyed by client address, user, room or server.

``Ratelimiter`` is pure: every call takes ``now`` (seconds), so tests drive it
with a fake clock. A bucket holds up to ``burst_count`` actions and drains at
``per_second``; an action is allowed when it fits. Buckets that have drained
are forgotten, so memory stays bounded by the keys active recently.
The limits themselves come from the configuration (homeserver/handlers/ratelimit.py
builds one limiter per ``rc_*`` key); this module only knows a rate and a burst.
"""

# tests: tests/unit/handlers/test_ratelimit.py

from __future__ import annotations

import math
from collections.abc import Hashable

import attrs

from typing import Protocol

from storage.kernel.errors import MatrixError

_MIN_SWEEP_SIZE = 1024


class Rate(Protocol):
    """A configured limit: ``burst_count`` actions at once, then ``per_second`` on average."""

    @property
    def per_second(self) -> float: ...

    @property
    def burst_count(self) -> int: ...


@attrs.frozen
class RatelimitResult:
    allowed: bool
    # Seconds until the action would be allowed; 0 when it is allowed now.
    retry_after: float


@attrs.define
class _Bucket:
    level: float
    updated: float


class Ratelimiter:
    """A leaky bucket per key: ``burst_count`` actions at once, then ``per_second`` on average."""

    def __init__(self, per_second: float, burst_count: int) -> None:
        if per_second <= 0 or burst_count < 1:
            raise ValueError(f"need per_second > 0 and burst_count >= 1, got {per_second}, {burst_count}")
        self.per_second = per_second
        self.burst_count = burst_count
        self._buckets: dict[Hashable, _Bucket] = {}
        self._sweep_at = _MIN_SWEEP_SIZE

    @classmethod
    def from_config(cls, limit: Rate) -> Ratelimiter:
        return cls(limit.per_second, limit.burst_count)

    def _level(self, key: Hashable, now: float) -> float:
        bucket = self._buckets.get(key)
        if bucket is None:
            return 0.0
        # A clock that steps backwards must not refill or overfill the bucket.
        elapsed = max(0.0, now - bucket.updated)
        return max(0.0, bucket.level - elapsed * self.per_second)

    def check(self, key: Hashable, now: float, *, update: bool = True, n_actions: int = 1) -> RatelimitResult:
        """May ``key`` do ``n_actions`` now? With ``update``, an allowed action is counted."""
        level = self._level(key, now)
        if level + n_actions <= self.burst_count:
            if update:
                self._store(key, level + n_actions, now)
            return RatelimitResult(True, 0.0)
        return RatelimitResult(False, (level + n_actions - self.burst_count) / self.per_second)

    def record(self, key: Hashable, now: float, n_actions: int = 1) -> None:
        """Count actions whether or not they fit (a failed login is counted after the fact)."""
        self._store(key, self._level(key, now) + n_actions, now)

    def _store(self, key: Hashable, level: float, now: float) -> None:
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = _Bucket(level, now)
            if len(self._buckets) >= self._sweep_at:
                self._sweep(now)
        else:
            bucket.level = level
            bucket.updated = max(bucket.updated, now)

    def _sweep(self, now: float) -> None:
        drained = [key for key in self._buckets if self._level(key, now) == 0.0]
        for key in drained:
            del self._buckets[key]
        self._sweep_at = max(_MIN_SWEEP_SIZE, 2 * len(self._buckets))

    def __len__(self) -> int:
        return len(self._buckets)


def limit_exceeded(retry_after: float) -> MatrixError:
    return MatrixError(
        429, "M_LIMIT_EXCEEDED", "Too many requests", retry_after_ms=max(1, math.ceil(retry_after * 1000))
    )


def ratelimit(limiter: Ratelimiter, key: Hashable, now: float, *, update: bool = True) -> None:
    """Count an action, or raise 429 ``M_LIMIT_EXCEEDED`` with ``retry_after_ms``."""
    result = limiter.check(key, now, update=update)
    if not result.allowed:
        raise limit_exceeded(result.retry_after)
