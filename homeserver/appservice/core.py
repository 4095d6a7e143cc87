"""One application service's sending state machine, sans I/O: events in, actions out.

The federation sender's discipline, for a service instead of a server (``RequestLink``:
one request outstanding, answered once; supervision after crashes; the backoff of
``federation_sender/backoff.py``). What differs is where events come from: a service's
transactions are read from the events stream above its stored position (``ReadEvents``),
never queued in memory, so nothing is dropped while it is down and a restart loses nothing.

A transaction is recorded before it is sent (``RecordTransaction``: its ID and the position
it covers) and the position moves only once the service accepts it (``Advance``). A failed
transaction is resent, with the same ID and the same events, after the backoff; a restart
with a recorded transaction re-reads exactly its events and resends it under its ID. Every
failure is retried (a service, unlike a server, has no other way to get what it missed).

To-device messages (MSC2409) are read the same way, from the to_device stream above the
service's own to-device position, in the same read as the events (``ReadEvents``), recorded
with the transaction and moved past only once it is accepted: a bridge's encrypted sessions
need every key it is sent. Ephemeral events (typing, receipts) are held in memory, bounded,
and ride on the next transaction: lossy by design, as their worth is in being now.

It does not read the clock, log, count metrics, or know about Twisted, Postgres or HTTP.
"""

# tests: tests/unit/appservice/test_core.py

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

import attrs

from federation_sender.backoff import HEALTHY, BackoffPolicy, Jitter, RetryState, after_failure
from federation_sender.link import RequestLink, ScheduleWake

# Ephemeral events kept for a service, the oldest dropped beyond it.
MAX_HELD_EPHEMERAL: Final = 1_000


@attrs.frozen
class Pending:
    """A transaction recorded but not yet accepted: its ID and the positions it covers (None:
    it carries nothing of that stream)."""

    txn_id: int
    upto: int | None
    to_device_upto: int | None = None


@attrs.frozen
class Transaction:
    """One ``PUT /_matrix/app/v1/transactions/{txn_id}``."""

    txn_id: int
    events: tuple[Mapping[str, Any], ...]
    ephemeral: tuple[Mapping[str, Any], ...] = ()
    to_device: tuple[Mapping[str, Any], ...] = ()
    # The events stream position it covers once accepted (None: it carries no events' worth).
    upto: int | None = None
    # The to_device stream position it covers once accepted (None: no to-device messages' worth).
    to_device_upto: int | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"events": [dict(e) for e in self.events]}
        if self.ephemeral:
            body["ephemeral"] = body["de.sorunome.msc2409.ephemeral"] = [dict(e) for e in self.ephemeral]
        if self.to_device:
            body["de.sorunome.msc2409.to_device"] = [dict(m) for m in self.to_device]
        return body


# --- requests: the loop carries each out and answers with one call ------------------------------


@attrs.frozen
class ReadEvents:
    """The events in (after, upto] the service is interested in, in client format, reading at
    most ``limit`` events of the stream (``upto`` None: the stream's position now); with
    ``to_device_after``, also the to-device messages for its users in (to_device_after,
    to_device_upto] of the to_device stream, at most ``limit`` stream positions of them
    → ``on_events_read(events, covered, more, to_device=..., to_device_covered=..., to_device_more=...)``."""

    after: int
    upto: int | None
    limit: int
    to_device_after: int | None = None
    to_device_upto: int | None = None


@attrs.frozen
class RecordTransaction:
    """Store the transaction's ID (and, if it covers events or to-device messages, that it is
    pending, with the positions it covers) → ``on_recorded``."""

    txn: Transaction


@attrs.frozen
class SendTransaction:
    """``PUT {url}/_matrix/app/v1/transactions/{txn_id}`` → ``on_sent`` for a 2xx answer,
    else ``on_send_failed(status, error)`` (status None: no answer)."""

    txn: Transaction


@attrs.frozen
class Advance:
    """Store the position ``upto`` and the to-device position ``to_device_upto`` (None:
    unchanged), clear the pending transaction and, with ``clear_retry``, the backoff
    → ``on_advanced``."""

    upto: int | None
    clear_retry: bool
    to_device_upto: int | None = None


@attrs.frozen
class PersistRetry:
    """Store the backoff → ``on_retry_persisted``."""

    retry: RetryState


Request: TypeAlias = ReadEvents | RecordTransaction | SendTransaction | Advance | PersistRetry


# --- notices (metrics and logs) ---------------------------------------------------------------


@attrs.frozen
class Sent:
    txn: Transaction


@attrs.frozen
class Failed:
    txn: Transaction
    status: int | None
    error: str
    retry: RetryState


@attrs.frozen
class Recovered:
    """The service answered again after failures."""


Notice: TypeAlias = Sent | Failed | Recovered
Action: TypeAlias = Request | ScheduleWake | Notice


class ServiceLink(RequestLink[Request]):
    """Everything about pushing to one service (see the module docstring)."""

    def __init__(
        self,
        service_id: str,
        *,
        position: int,
        last_txn_id: int,
        pending: Pending | None,
        retry: RetryState,
        policy: BackoffPolicy,
        jitter: Jitter,
        max_events: int,
        to_device_position: int | None = None,
    ) -> None:
        super().__init__(service_id)
        self._position = position
        # None: the service takes no to-device messages.
        self._to_device_position = to_device_position
        self._last_txn_id = last_txn_id
        # A recorded transaction to re-read and resend under its ID.
        self._replay = pending
        self.retry = retry
        self._policy = policy
        self._jitter = jitter
        self._max_events = max_events
        # The streams may hold events or messages above the positions (start-up: assume so).
        self._events_pending = True
        self._to_device_pending = to_device_position is not None
        self._ephemeral: deque[Mapping[str, Any]] = deque(maxlen=MAX_HELD_EPHEMERAL)
        # Recorded and not yet accepted: resent as it is.
        self._retained: Transaction | None = None

    # --- what the loop may look at ---------------------------------------------------------

    @property
    def position(self) -> int:
        return self._position

    @property
    def to_device_position(self) -> int | None:
        return self._to_device_position

    @property
    def in_flight(self) -> Transaction | None:
        return self._retained

    # --- events from outside -----------------------------------------------------------------

    def on_new_events(self, now_ms: int) -> list[Action]:
        """The events stream's position moved."""
        self._events_pending = True
        return self._next(now_ms)

    def on_ephemeral(self, items: Sequence[Mapping[str, Any]], now_ms: int) -> list[Action]:
        self._ephemeral.extend(items)
        return self._next(now_ms)

    def on_to_device(self, now_ms: int) -> list[Action]:
        """The to_device stream's position moved."""
        if self._to_device_position is None:
            return []
        self._to_device_pending = True
        return self._next(now_ms)

    def on_wake(self, now_ms: int) -> list[Action]:
        self._woken(now_ms)
        return self._next(now_ms)

    def on_crashed(self, now_ms: int) -> list[Action]:
        """Carrying out the outstanding request raised: it is redone after a rest."""
        step, wake = self._crashed(now_ms)
        if isinstance(step, ReadEvents):
            self._events_pending = True
            self._to_device_pending = self._to_device_position is not None
        elif isinstance(step, SendTransaction):
            self._retained = step.txn
        elif isinstance(step, (RecordTransaction, Advance)):
            self._resume = step
        elif isinstance(step, PersistRetry):
            self._retry_dirty = True
        return wake

    # --- answers to requests -------------------------------------------------------------------

    def on_events_read(self, events: Sequence[Mapping[str, Any]], covered: int, more: bool,
                       now_ms: int, *, to_device: Sequence[Mapping[str, Any]] = (),
                       to_device_covered: int | None = None, to_device_more: bool = False) -> list[Action]:
        """``covered``/``to_device_covered``: how far each read went (None: to-device not read);
        ``more``/``to_device_more``: it stopped at its limit."""
        step = self._answer(ReadEvents)
        if more:
            self._events_pending = True
        if to_device_more:
            self._to_device_pending = True
        replay, self._replay = self._replay, None
        if step.upto is not None and replay is not None:
            # The recorded transaction, again: its ID, what it covered (``more`` cannot be true
            # with the same limit, but the positions it covers are the recorded ones anyway).
            txn = Transaction(replay.txn_id, tuple(events), to_device=tuple(to_device), upto=replay.upto,
                              to_device_upto=replay.to_device_upto)
            self._events_pending = True
            self._to_device_pending = self._to_device_position is not None
            return self._begin(SendTransaction(self._hold(txn)))
        to_device_upto = (to_device_covered if to_device_covered is not None and self._to_device_position is not None
                          and to_device_covered > self._to_device_position else None)
        if not events and not to_device and not self._ephemeral:
            if covered <= self._position and to_device_upto is None:
                return self._next(now_ms)
            return self._begin(Advance(covered if covered > self._position else None, clear_retry=False,
                                       to_device_upto=to_device_upto))
        return self._begin(RecordTransaction(self._build(tuple(events), covered, tuple(to_device), to_device_upto)))

    def on_recorded(self, now_ms: int) -> list[Action]:
        step = self._answer(RecordTransaction)
        self._last_txn_id = max(self._last_txn_id, step.txn.txn_id)
        self._retained = step.txn
        return self._next(now_ms)

    def on_sent(self, now_ms: int) -> list[Action]:
        step = self._answer(SendTransaction)
        txn = step.txn
        self._retained = None
        actions: list[Action] = [Sent(txn)]
        recovered = not self.retry.healthy
        if recovered:
            self.retry = HEALTHY
            self._retry_dirty = False  # the advance clears it
            actions.append(Recovered())
        return actions + self._begin(Advance(txn.upto, clear_retry=recovered, to_device_upto=txn.to_device_upto))

    def on_send_failed(self, status: int | None, error: str, now_ms: int) -> list[Action]:
        step = self._answer(SendTransaction)
        self._retained = step.txn
        self.retry = after_failure(self._policy, self.retry, now_ms, self._jitter)
        self._retry_dirty = True
        return [Failed(step.txn, status, error, self.retry), *self._next(now_ms)]

    def on_advanced(self, now_ms: int) -> list[Action]:
        step = self._answer(Advance)
        if step.upto is not None:
            self._position = max(self._position, step.upto)
        if step.to_device_upto is not None and self._to_device_position is not None:
            self._to_device_position = max(self._to_device_position, step.to_device_upto)
        return self._next(now_ms)

    def on_retry_persisted(self, now_ms: int) -> list[Action]:
        self._answer(PersistRetry)
        return self._next(now_ms)

    # --- deciding what to do next -----------------------------------------------------------------

    def _hold(self, txn: Transaction) -> Transaction:
        self._retained = txn
        return txn

    def _build(self, events: tuple[Mapping[str, Any], ...], covered: int,
               to_device: tuple[Mapping[str, Any], ...] = (), to_device_upto: int | None = None) -> Transaction:
        ephemeral = tuple(self._ephemeral)
        self._ephemeral.clear()
        upto = covered if covered > self._position else None
        return Transaction(self._last_txn_id + 1, events, ephemeral, to_device, upto, to_device_upto)

    def _persist_retry(self) -> Request:
        return PersistRetry(self.retry)

    def _next(self, now_ms: int) -> list[Action]:
        first = self._before_deciding(now_ms)
        if first is not None:
            return first
        if self.retry.backing_off(now_ms):
            return self._schedule_wake(self.retry.retry_at)
        if self._retained is not None:
            return self._begin(SendTransaction(self._retained))
        if self._replay is not None:
            replay = self._replay
            with_to_device = replay.to_device_upto is not None and self._to_device_position is not None
            return self._begin(ReadEvents(
                self._position, self._position if replay.upto is None else replay.upto, self._max_events,
                self._to_device_position if with_to_device else None,
                replay.to_device_upto if with_to_device else None))
        if self._events_pending or self._to_device_pending:
            events, to_device = self._events_pending, self._to_device_pending
            self._events_pending = self._to_device_pending = False
            return self._begin(ReadEvents(self._position, None if events else self._position, self._max_events,
                                          self._to_device_position if to_device else None))
        if self._ephemeral:
            return self._begin(RecordTransaction(self._build((), self._position)))
        return []
