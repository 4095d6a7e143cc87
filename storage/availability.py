"""Whether the database can be reached: the pool's own knowledge, as a pure state.

``Availability`` is told of each connection that could not be made (``failed``) and of
each transaction that worked (``succeeded``), with the time as an argument. From that it
says whether the database is up, when the pool may try to connect again while it is down
(the kernel's ``BackoffPolicy``: no connection storm against a server that is starting),
how long a client should wait (``retry_after``) and whether a health check should probe
with ``SELECT 1`` (at most one probe per ``probe_interval``, shared by every caller, and
none while transactions keep telling the truth anyway). It returns the transitions; the
caller logs them, once each, and feeds the metrics. It knows nothing of psycopg2, threads
or logging.
"""

# tests: tests/unit/storage/test_availability.py

from __future__ import annotations

import enum
import math
import random

import attrs

from storage.kernel.backoff import BackoffPolicy, Jitter

#: Reconnect attempts while the database is down: quick at first, at most every 5 s, so
#: the process is back within seconds of the server.
RECONNECT_BACKOFF = BackoffPolicy(initial=0.25, multiplier=2.0, maximum=5.0, jitter=(0.8, 1.2))


class Transition(enum.Enum):
    DOWN = "down"
    UP = "up"


@attrs.define
class Availability:
    policy: BackoffPolicy = RECONNECT_BACKOFF
    probe_interval: float = 1.0
    up: bool = True
    reason: str = ""
    last_success: float | None = None
    down_since: float | None = None
    _retry_at: float = 0.0
    _interval: float | None = None
    _probe_started: float | None = None
    _probing: bool = False

    def succeeded(self, now: float, started: float | None = None) -> Transition | None:
        """A transaction that ``started`` then committed (or a probe answered): the database is
        up. One that started before the outage was noticed says nothing of it (it may have
        finished on a connection made before), so it ends no outage: no flapping."""
        self.last_success = now
        if self.up:
            return None
        if started is not None and self.down_since is not None and started < self.down_since:
            return None
        self.up = True
        self.reason = ""
        self._interval = None
        self._retry_at = 0.0
        return Transition.UP

    def failed(self, now: float, reason: str, jitter: Jitter = random.uniform) -> Transition | None:
        """A connection could not be made: down, and no new attempt before the backoff's wait."""
        self._interval = self.policy.next_interval(self._interval, jitter)
        self._retry_at = now + self._interval
        self.reason = reason
        if not self.up:
            return None
        self.up = False
        self.down_since = now
        return Transition.DOWN

    def may_connect(self, now: float) -> bool:
        """Whether to try to connect now: always while up, else once the backoff's wait is over."""
        return self.up or now >= self._retry_at

    def retry_after(self, now: float) -> int:
        """Whole seconds a client should wait before trying again (at least 1)."""
        return max(1, math.ceil(self._retry_at - now))

    def should_probe(self, now: float) -> bool:
        """Whether a health check should run a probe now, and if so note that one started:
        not when a transaction worked within ``probe_interval``, nor within ``probe_interval``
        of the last probe, nor while one runs (``probe_finished`` ends it): one for every caller."""
        if self._probing:
            return False
        if self.up and self.last_success is not None and now - self.last_success < self.probe_interval:
            return False
        if self._probe_started is not None and now - self._probe_started < self.probe_interval:
            return False
        self._probe_started = now
        self._probing = True
        return True

    def probe_finished(self) -> None:
        self._probing = False
