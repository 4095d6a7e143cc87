"""One destination's outbound state: what to send next, its backoff, whether it is catching up.

Pure: no I/O, no clock reads (time is an argument), no logging. It is one part
of a destination's ``core.Destination``, which alone uses it: the core takes
transactions' contents from it, tells it how each went, and it decides what is
retried, what is dropped and when the destination falls back to catch-up. It
does not know how PDUs are fanned out or how catch-up finds the missed events
(``catch_up.py``).

Drop policy during long outages (also in docs/federation-sender.md): while a
destination backs off, PDUs and EDUs wait in memory. Once its retry interval
grows past the catch-up threshold, or more than ``max_pending_pdus`` PDUs
wait, the PDUs and the lossy EDUs (typing, receipts, presence) are dropped and
the destination is flagged to catch up: ``destination_rooms`` still says what
it missed. To-device messages and device-list updates never live here: they
are read for each transaction from the database (the ``device_federation_outbox``
table; the ``device_lists`` stream above ``destinations.device_lists_position``)
and stay there until a transaction carrying them is accepted.
"""

# tests: tests/unit/federation_sender/test_queue.py

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from canonicaljson import encode_canonical_json

from federation_sender.backoff import HEALTHY, BackoffPolicy, Jitter, RetryState, after_failure

JsonDict = dict[str, Any]

# EDUs that are worth nothing once stale: dropped with the PDUs when a destination catches up.
LOSSY_EDU_TYPES = frozenset({"m.typing", "m.receipt", "m.presence"})
# Read from the outbox table for each transaction, never held here.
TO_DEVICE_EDU_TYPE = "m.direct_to_device"
# Read from the device_lists stream for each transaction, never held here.
DEVICE_LIST_EDU_TYPE = "m.device_list_update"
# Read from the device_lists stream with the device-list updates (federation_sender/device_lists.py).
SIGNING_KEY_EDU_TYPE = "m.signing_key_update"
# EDUs a transaction carries from the database: dropped with it, read again.
DATABASE_EDU_TYPES = frozenset({TO_DEVICE_EDU_TYPE, DEVICE_LIST_EDU_TYPE, SIGNING_KEY_EDU_TYPE})


@attrs.frozen
class PendingPdu:
    event_id: str
    room_id: str
    # Position in the events stream; None for a remote server's event we forward
    # (a join we accepted as the resident server), which does not count for catch-up.
    stream_ordering: int | None
    # The PDU as canonical JSON, encoded once (``encode_pdu``) when it was read: every
    # destination's transactions join these bytes, none encodes the PDU again.
    encoded: bytes
    queued_at: float


def encode_pdu(pdu: Mapping[str, Any]) -> bytes:
    """A PDU's canonical JSON, as ``PendingPdu.encoded`` holds it."""
    return encode_canonical_json(pdu)


@attrs.frozen
class Edu:
    edu_type: str
    content: Mapping[str, Any]
    # EDUs with the same key replace each other while waiting (a user's typing in
    # a room, a user's presence): only the newest is worth sending.
    key: tuple[str, ...] | None = None

    def to_json(self) -> JsonDict:
        return {"edu_type": self.edu_type, "content": self.content}


@attrs.frozen
class PlannedTransaction:
    """One ``PUT /send`` body's worth, and what its success means."""

    txn_id: str
    pdus: tuple[PendingPdu, ...]
    edus: tuple[Edu, ...]
    # ``destinations.last_successful_stream_ordering`` after it is accepted (None: unchanged).
    advance_to: int | None = None
    # The to-device outbox rows it carries (delete up to this stream ID once accepted).
    to_device_upto: int | None = None
    # The device_lists stream position its device-list updates cover (``device_lists_position``
    # once accepted; None: it carries none).
    device_lists_upto: int | None = None
    catch_up: bool = False
    # Catch-up: the rooms this transaction finishes, with their destination_rooms positions.
    completed_rooms: tuple[tuple[str, int], ...] = ()

    def body(self, origin: str, now_ms: int) -> bytes:
        """The ``PUT /send`` body as canonical JSON, joined from the PDUs' pre-encoded bytes
        rather than encoded as a whole: only the EDUs and the envelope are encoded here. The
        keys are written in canonical (sorted) order, so the bytes are exactly what
        ``encode_canonical_json`` of the body as a dict would give, and the request signature
        can be made over them without encoding anything again."""
        return b"".join((
            b'{"edus":', encode_canonical_json([e.to_json() for e in self.edus]),
            b',"origin":', encode_canonical_json(origin),
            b',"origin_server_ts":', str(int(now_ms)).encode("ascii"),
            b',"pdus":[', b",".join(p.encoded for p in self.pdus), b"]}",
        ))


class Added(enum.Enum):
    QUEUED = "queued"
    # Not queued: the destination is catching up, and catch-up will find it in destination_rooms.
    SKIPPED = "skipped"
    # Too much waiting: the queue was emptied and the destination flagged to catch up.
    OVERFLOWED = "overflowed"


@attrs.frozen
class FailureOutcome:
    retry: RetryState
    backed_off: bool
    entered_catch_up: bool
    dropped_pdus: int


class PerDestinationQueue:
    """The state of one destination (see the module docstring)."""

    def __init__(
        self,
        destination: str,
        *,
        retry: RetryState = HEALTHY,
        catching_up: bool = False,
        max_pending_pdus: int = 10_000,
    ) -> None:
        self.destination = destination
        self.retry = retry
        self.catching_up = catching_up
        self._max_pending_pdus = max_pending_pdus
        self.pdus: deque[PendingPdu] = deque()
        self._keyed_edus: dict[tuple[str, ...], Edu] = {}
        self._edus: deque[Edu] = deque()
        # The newest stream ordering not queued because we were catching up:
        # catch-up is done only once it has looked at least that far.
        self.skipped_upto = 0
        # The to-device outbox may hold messages for this destination.
        self.outbox_pending = False
        # The device_lists stream may hold changes above this destination's position.
        self.device_lists_pending = False
        # A transaction that failed, resent as it was (same ID) before anything else.
        self.retained: PlannedTransaction | None = None

    # --- what waits ------------------------------------------------------------------

    def add_pdu(self, pdu: PendingPdu) -> Added:
        if self.catching_up and pdu.stream_ordering is not None:
            self.skipped_upto = max(self.skipped_upto, pdu.stream_ordering)
            return Added.SKIPPED
        self.pdus.append(pdu)
        if len(self.pdus) > self._max_pending_pdus:
            self._enter_catch_up()
            return Added.OVERFLOWED
        return Added.QUEUED

    def add_edu(self, edu: Edu) -> None:
        if edu.key is None:
            self._edus.append(edu)
        else:
            # Replace in place: the newest content, at the position of the first.
            self._keyed_edus[edu.key] = edu

    @property
    def pending_edu_count(self) -> int:
        return len(self._edus) + len(self._keyed_edus)

    def oldest_queued_at(self) -> float | None:
        return self.pdus[0].queued_at if self.pdus else None

    def has_work(self) -> bool:
        """Whether a transmission loop has anything to do (catch-up may find nothing)."""
        return bool(
            self.retained or self.pdus or self._edus or self._keyed_edus or self.catching_up or self.outbox_pending
            or self.device_lists_pending
        )

    # --- building transactions -------------------------------------------------------

    def take_edus(self, limit: int) -> list[Edu]:
        """Up to ``limit`` waiting EDUs, oldest first (keyed ones are the newest of their key)."""
        taken: list[Edu] = []
        while self._edus and len(taken) < limit:
            taken.append(self._edus.popleft())
        while self._keyed_edus and len(taken) < limit:
            key = next(iter(self._keyed_edus))
            taken.append(self._keyed_edus.pop(key))
        return taken

    def take_pdus(self, limit: int) -> list[PendingPdu]:
        taken: list[PendingPdu] = []
        while self.pdus and len(taken) < limit:
            taken.append(self.pdus.popleft())
        return taken

    def put_back_edus(self, edus: Iterable[Edu]) -> None:
        """Return EDUs of a transaction that will not be sent after all, ahead of newer ones."""
        unkeyed = [e for e in edus if e.key is None]
        self._edus.extendleft(reversed(unkeyed))
        for edu in edus:
            if edu.key is not None and edu.key not in self._keyed_edus:
                self._keyed_edus[edu.key] = edu

    # --- outcomes ----------------------------------------------------------------------

    def on_success(self) -> RetryState | None:
        """The retained transaction went through. Returns the retry state to
        persist when the destination was backing off (None: nothing to write)."""
        self.retained = None
        if self.retry.healthy:
            return None
        self.retry = HEALTHY
        return HEALTHY

    def on_rejected(self) -> None:
        """The destination refused the transaction outright (a 4xx that is not about its
        health): resending it would be refused again, so it is dropped, without backoff."""
        self.retained = None

    def on_failure(
        self,
        txn: PlannedTransaction,
        *,
        now_ms: int,
        unhealthy: bool,
        policy: BackoffPolicy,
        jitter: Jitter,
        catch_up_threshold_ms: int,
    ) -> FailureOutcome:
        """The transaction failed. An unhealthy failure grows the backoff; the
        transaction is kept to be resent with the same ID. Past the catch-up
        threshold the queue is emptied and the destination catches up."""
        if not unhealthy:
            self.on_rejected()
            return FailureOutcome(self.retry, backed_off=False, entered_catch_up=False, dropped_pdus=0)
        self.retained = txn
        self.retry = after_failure(policy, self.retry, now_ms, jitter)
        dropped = 0
        entered = False
        if self.retry.retry_interval > catch_up_threshold_ms:
            dropped = self._enter_catch_up()
            entered = True
        return FailureOutcome(self.retry, backed_off=True, entered_catch_up=entered, dropped_pdus=dropped)

    def on_remote_up(self) -> bool:
        """The destination talked to us: forget its backoff. Returns whether it was backing off."""
        was = not self.retry.healthy
        self.retry = HEALTHY
        return was

    def _enter_catch_up(self) -> int:
        """Drop what catch-up will recover (PDUs) or what is stale (lossy EDUs); keep the rest."""
        dropped = len(self.pdus)
        if self.retained is not None:
            dropped += len(self.retained.pdus)
            kept = [e for e in self.retained.edus if e.edu_type not in LOSSY_EDU_TYPES | DATABASE_EDU_TYPES]
            if self.retained.to_device_upto is not None:
                self.outbox_pending = True  # still in the outbox: the next transaction reads them again
            if self.retained.device_lists_upto is not None:
                self.device_lists_pending = True  # the position did not move: read again
            self.retained = None
            self.put_back_edus(kept)
        self.pdus.clear()
        self._edus = deque(e for e in self._edus if e.edu_type not in LOSSY_EDU_TYPES)
        self._keyed_edus = {k: e for k, e in self._keyed_edus.items() if e.edu_type not in LOSSY_EDU_TYPES}
        self.catching_up = True
        return dropped
