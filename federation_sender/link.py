"""The request discipline of a sans-I/O sending core, shared by every kind of link.

A link is one remote party we push to in order: a destination server (``core.Destination``)
or an application service (``homeserver/appservice/core.py``). Each is a state machine the
loop drives with ``on_<event>(..., now_ms)`` calls; ``RequestLink`` holds what they have in
common: at most one *request* outstanding, answered by exactly one call (``_answer`` raises
``ProtocolViolation`` for an answer to something else), a supervision delay that doubles per
crash in a row, one pending wake-up, and a backoff to store before anything else once it has
changed (``_retry_dirty``; each link says how, ``_persist_retry``). It knows nothing else of
what the requests are.
"""

# tests: tests/unit/federation_sender/test_link.py, tests/unit/federation_sender/test_core.py

from __future__ import annotations

from typing import Any, Final, Generic, TypeVar

import attrs

from storage.kernel.backoff import BackoffPolicy

# A link whose loop raised waits this long before going on, doubling per crash in a row.
SUPERVISION_FIRST_DELAY_MS: Final = 1_000
SUPERVISION_MAX_DELAY_MS: Final = 300_000
SUPERVISION_BACKOFF: Final = BackoffPolicy(
    initial=SUPERVISION_FIRST_DELAY_MS, multiplier=2.0, maximum=SUPERVISION_MAX_DELAY_MS)

R = TypeVar("R")


@attrs.frozen
class ScheduleWake:
    """Call ``on_wake`` at ``at_ms`` (not before)."""

    at_ms: int


class ProtocolViolation(Exception):
    """The loop called a result method that does not answer the outstanding request (a bug)."""


def supervision_delay_ms(crashes: int) -> int:
    """How long a link rests after its ``crashes``-th crash in a row (``SUPERVISION_BACKOFF``).

    Without jitter: a crash is a bug of ours, not a peer's load to spread, and the core
    stays free of randomness."""
    return int(SUPERVISION_BACKOFF.delay(crashes, lambda low, high: 1.0))


class RequestLink(Generic[R]):
    """One request at a time, supervision after crashes, one pending wake (module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._step: R | None = None
        self._wake_at: int | None = None
        # Crashes in a row, and no request before this moment after one.
        self._crashes = 0
        self._resting_until = 0
        # A request whose carrying out crashed and that must be made again as it was.
        self._resume: R | None = None
        # The backoff changed and is not stored yet: storing it comes before any other request.
        self._retry_dirty = False

    def _persist_retry(self) -> R:
        """The request that stores the link's backoff as it is now."""
        raise NotImplementedError
    @property
    def outstanding(self) -> R | None:
        """The request the loop is carrying out for this link."""
        return self._step

    def _begin(self, step: R) -> list[Any]:
        self._step = step
        return [step]

    def _schedule_wake(self, at_ms: int) -> list[Any]:
        if self._wake_at == at_ms:
            return []
        self._wake_at = at_ms
        return [ScheduleWake(at_ms)]

    def _woken(self, now_ms: int) -> None:
        """``on_wake``: a wake-up due by now is no longer pending."""
        if self._wake_at is not None and now_ms >= self._wake_at:
            self._wake_at = None

    def _resting(self, now_ms: int) -> bool:
        return now_ms < self._resting_until

    def _before_deciding(self, now_ms: int) -> list[Any] | None:
        """What comes before a link decides its next request: nothing while one is outstanding,
        a wake-up while it rests after a crash, the request to redo, storing a changed backoff.
        None: the link decides."""
        if self._step is not None:
            return []
        if self._resting(now_ms):
            return self._schedule_wake(self._resting_until)
        if self._resume is not None:
            resume, self._resume = self._resume, None
            return self._begin(resume)
        if self._retry_dirty:
            self._retry_dirty = False
            return self._begin(self._persist_retry())
        return None

    def _crashed(self, now_ms: int) -> tuple[R | None, list[Any]]:
        """Carrying out the outstanding request raised: forget it (the caller decides how it is
        redone), rest, and be woken after. Returns the request and the wake-up action."""
        step, self._step = self._step, None
        self._crashes += 1
        self._resting_until = now_ms + supervision_delay_ms(self._crashes)
        return step, self._schedule_wake(self._resting_until)

    def _answer(self, *kinds: type[Any]) -> Any:
        """The outstanding request, which must be one of ``kinds``; nothing is outstanding after."""
        step = self._step
        if not isinstance(step, kinds):
            names = "/".join(k.__name__ for k in kinds)
            raise ProtocolViolation(f"[{self.name}] got an answer to {names}, but the outstanding request is {step!r}")
        self._step = None
        self._crashes = 0  # carried out: the crashes are no longer in a row
        return step
