"""The state and auth chain of a ``send_join`` response, checked in bulk.

A big room's ``send_join`` answer holds tens of thousands of events. They are checked
as one batch, as "Checks performed on receipt of a PDU" asks of each: parsed for the
room version; signatures checked with keys fetched once per server for the whole batch
(``batch_keys``), not once per event; content hashes checked (a mismatch keeps the
redacted copy); then the auth rules of each event against its own auth events, in one
pass in topological order of the auth graph (``auth_order``), so every event's auth
events were decided before it. An event whose auth events are missing or rejected, or
that fails the rules, is rejected; a rejected event is not part of the room's state.

The pure parts (``auth_order``, ``check_auth_in_order``, ``state_map``, ``parse_batch``,
``verify_parsed``) know nothing of
keys or I/O; ``verify_batch`` fetches keys through the ``Keyring`` it is given.
Storing the result is ``EventPersister.persist_join`` (storage/stores/room_state.py).
"""

# tests: tests/unit/federation/test_join_state.py, tests/integration/test_federation_big_join.py

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from homeserver.events import FrozenEvent, RoomVersion, StateKey, check_auth_rules, make_event, required_signers
from homeserver.events import constants as C
from homeserver.events.auth import auth_state_from_auth_events, check_auth_events_list
from homeserver.events.errors import AuthError, EventsError, InvalidEvent, MissingEventsError, SignatureError
from homeserver.events.hashing import create_event_id_from_room_id
from homeserver.events.signing import KeyRing, verify_event
from homeserver.federation.gaps import topological_order
from homeserver.federation.keys import Keyring
from homeserver.federation.pdus import parse_and_verify

logger = logging.getLogger(__name__)


@attrs.frozen
class CheckedState:
    """A ``send_join`` response's events once checked.

    ``events``: every event that parsed and verified (state and auth chain), by ID;
    ``order``: the same, auth events first; ``rejected``: event ID -> why, for those that
    failed the auth rules; ``state``: the room's state (the non-rejected state events).
    """

    events: Mapping[str, FrozenEvent]
    order: Sequence[FrozenEvent]
    rejected: Mapping[str, str]
    state: Mapping[StateKey, str]


def _auth_events(event: FrozenEvent) -> Iterable[str]:
    return event.auth_event_ids


def auth_order(events: Iterable[FrozenEvent]) -> list[FrozenEvent]:
    """``events`` ordered so that each comes after every one of its auth events that is among
    them (ties, and events caught in a cycle, by depth then event ID): ``topological_order``
    over auth events instead of prev events."""
    return topological_order(events, _auth_events)


def check_auth_in_order(
    room_version: RoomVersion, ordered: Sequence[FrozenEvent], known: Mapping[str, FrozenEvent] | None = None,
) -> dict[str, str]:
    """The auth rules of each event of ``ordered`` (``auth_order``) against its own auth events,
    taken from the batch or ``known`` (events stored already, accepted); event ID -> why it was
    rejected, for each one rejected. An event citing a rejected or unknown event is rejected."""
    decided: dict[str, FrozenEvent] = dict(known or {})
    rejected: dict[str, str] = {}
    for event in ordered:
        try:
            _check_one(room_version, event, decided, rejected)
        except EventsError as e:
            rejected[event.event_id] = str(e) or type(e).__name__
            continue
        decided[event.event_id] = event
    return rejected


def _check_one(room_version: RoomVersion, event: FrozenEvent, decided: Mapping[str, FrozenEvent],
               rejected: Mapping[str, str]) -> None:
    """Raise ``EventsError`` unless ``event`` passes the auth rules against its auth events."""
    if event.type == C.CREATE and event.state_key == "":
        check_auth_rules(room_version, event, {})
        return
    wanted = event.auth_event_ids
    bad = sorted(i for i in wanted if i in rejected)
    if bad:
        raise AuthError(f"auth event {bad[0]} was rejected")
    missing = sorted(i for i in wanted if i not in decided)
    if missing:
        raise MissingEventsError(frozenset(missing), f"auth events of {event.event_id} (not in the response)")
    found = {i: decided[i] for i in wanted}
    check_auth_events_list(room_version, event, found)
    create = None
    if room_version.room_id_is_create_event_id:
        create = decided.get(create_event_id_from_room_id(event.room_id))
        if create is None:
            raise AuthError("the room's create event is not in the response")
    check_auth_rules(room_version, event, auth_state_from_auth_events(
        room_version, [found[i] for i in wanted], create_event=create))


def order_and_check(room_version: RoomVersion, events: Iterable[FrozenEvent],
                    known: Mapping[str, FrozenEvent]) -> tuple[list[FrozenEvent], dict[str, str]]:
    """``auth_order`` of ``events``, and ``check_auth_in_order`` over it."""
    order = auth_order(events)
    return order, check_auth_in_order(room_version, order, known)


def state_map(state_events: Iterable[FrozenEvent], rejected: Mapping[str, str]) -> dict[StateKey, str]:
    """(type, state_key) -> event ID of the state events not rejected. Two events for one key
    (a resident server must not send that): the one of greater depth, then greater ID, wins."""
    best: dict[StateKey, FrozenEvent] = {}
    for event in state_events:
        key = event.state_key_tuple
        if key is None or event.event_id in rejected:
            continue
        held = best.get(key)
        if held is None or (event.depth, event.event_id) > (held.depth, held.event_id):
            best[key] = event
    return {key: event.event_id for key, event in best.items()}


def _wanted_keys(events: Iterable[FrozenEvent]) -> dict[str, set[str]]:
    """Server -> the key IDs its signatures on ``events`` name, for the servers that must sign."""
    wanted: dict[str, set[str]] = {}
    for event in events:
        for server in required_signers(event):
            sigs = event.signatures.get(server)
            ids = wanted.setdefault(server, set())
            if isinstance(sigs, Mapping):
                ids.update(k for k in sigs if isinstance(k, str))
    return wanted


async def batch_keys(keyring: Keyring, events: Sequence[FrozenEvent]) -> KeyRing:
    """The keys every event of the batch needs, asked of the keyring once per server (valid at
    the newest event's ``origin_server_ts``; older events can only need less)."""
    if not events:
        return {}
    newest = max(e.origin_server_ts for e in events)
    wanted = _wanted_keys(events)
    return await keyring.keyring_for({s: sorted(ids) for s, ids in wanted.items()}, at_ms=newest)


@attrs.frozen
class ParsedBatch:
    """``parse_batch``'s answer: the events that parsed, by ID; which came in ``state``; the ID of
    an event of another room, if any; and why each of the others was dropped."""

    events: dict[str, FrozenEvent]
    state_ids: set[str]
    foreign: str | None
    dropped: list[str]


def parse_batch(room_version: RoomVersion, room_id: str, state: Sequence[object],
                auth_chain: Sequence[object]) -> ParsedBatch:
    """Every PDU of ``state`` and ``auth_chain`` as an event of ``room_version``, each once."""
    parsed: dict[str, FrozenEvent] = {}
    state_ids: set[str] = set()
    foreign: str | None = None
    dropped: list[str] = []
    for in_state, pdus in ((True, state), (False, auth_chain)):
        for pdu in pdus:
            try:
                if not isinstance(pdu, Mapping):
                    raise InvalidEvent("a PDU must be a JSON object")
                event = make_event(room_version, pdu)
            except EventsError as e:
                dropped.append(str(e))
                continue
            if event.room_id != room_id:
                foreign = foreign or event.event_id
                continue
            parsed.setdefault(event.event_id, event)
            if in_state:
                state_ids.add(event.event_id)
    return ParsedBatch(parsed, state_ids, foreign, dropped)


def verify_parsed(events: Sequence[FrozenEvent], keys: KeyRing) -> tuple[list[FrozenEvent], list[FrozenEvent]]:
    """Signatures and hashes of ``events`` with ``keys``: (the verified, hash-checked events;
    those whose signatures do not verify with these keys)."""
    verified: list[FrozenEvent] = []
    failed: list[FrozenEvent] = []
    for event in events:
        try:
            verified.append(verify_event(event, keys))
        except SignatureError:
            failed.append(event)
    return verified, failed


RunInThread = Callable[..., Awaitable[Any]]
"""Runs ``func(*args)`` on a thread of the reactor's pool and gives its result."""

async def run_inline(func: Callable[..., Any], *args: Any) -> Any:
    return func(*args)


async def verify_batch(
    keyring: Keyring, room_version: RoomVersion, room_id: str, state: Sequence[object], auth_chain: Sequence[object],
    *, source: str, run_in_thread: RunInThread | None = None,
) -> tuple[dict[str, FrozenEvent], set[str], str | None]:
    """The events of a send_join response (``state`` and ``auth_chain``) that parse and verify
    (signatures, then hashes: a mismatch gives the redacted copy), by ID, each checked once;
    the IDs of those that came in ``state``; and the ID of an event of another room than
    ``room_id`` if there is one (the caller refuses the response). The others are dropped
    with a warning naming ``source``. ``run_in_thread``: where the CPU-bound work runs (off
    the reactor thread, so the server keeps answering meanwhile); inline when None."""
    run = run_in_thread or run_inline
    batch: ParsedBatch = await run(parse_batch, room_version, room_id, state, auth_chain)
    for reason in batch.dropped[:10]:
        logger.warning("[%s] dropping an event of %s's send_join response: %s", room_id, source, reason)
    if len(batch.dropped) > 10:
        logger.warning("[%s] ... and %d more events of %s's send_join response", room_id, len(batch.dropped) - 10,
                       source)
    events = list(batch.events.values())
    keys = await batch_keys(keyring, events)
    # One thread: the checks are mostly Python, so a second thread only fights for the GIL.
    good, failed = await run(verify_parsed, events, keys)
    verified = {e.event_id: e for e in good}
    for event in failed:
        # The batch's keys do not do for this one (an old key expired before the newest
        # event): ask for the keys at its own time.
        try:
            verified[event.event_id] = await parse_and_verify(keyring, room_version, event.pdu)
        except EventsError as e:
            logger.warning("[%s] dropping %s from %s: %s", room_id, event.event_id, source, e)
    return verified, batch.state_ids & set(verified), batch.foreign
