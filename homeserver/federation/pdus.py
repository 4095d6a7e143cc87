"""Checks every received PDU goes through, whichever endpoint it came by.

"Checks performed on receipt of a PDU": a valid event for the room version (else
``InvalidEvent``), signatures of every required server (else ``SignatureError``),
the content hash (a mismatch means we continue with the redacted copy), then the
auth rules against the event's auth events, the state before it, and the current
state. Keys come from the ``Keyring``; events from the ``EventLoader``.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from homeserver.events import (
    FrozenEvent,
    KeyRing,
    ReceivedPdu,
    RoomVersion,
    StateKey,
    auth_types_for_event,
    check_auth_rules,
    receive_pdu,
    required_signers,
    verify_received,
)
from homeserver.events import constants as C
from homeserver.events.auth import auth_state_from_auth_events, check_auth_events_list
from homeserver.events.errors import AuthError, EventsError, InvalidEvent, MissingEventsError
from homeserver.events.hashing import create_event_id_from_room_id
from homeserver.federation.keys import Keyring
from homeserver.handlers.rooms.event_loader import EventLoader


async def parse_and_verify(keyring: Keyring, room_version: RoomVersion, pdu: object) -> FrozenEvent:
    """A verified event (redacted when its content hash does not match).

    Raises ``InvalidEvent`` or ``SignatureError``.
    """
    received, keys = await parse_with_keys(keyring, room_version, pdu)
    return verify_received(received, keys)


async def parse_with_keys(keyring: Keyring, room_version: RoomVersion, pdu: object) -> tuple[ReceivedPdu, KeyRing]:
    """The first half of ``parse_and_verify``: the validated PDU and the keys of the servers that
    must have signed it (``verify_received`` does the rest, on any thread). Raises ``InvalidEvent``."""
    if not isinstance(pdu, Mapping):
        raise InvalidEvent("a PDU must be a JSON object")
    received = receive_pdu(room_version, pdu)
    event = received.event
    wanted: dict[str, list[str]] = {}
    for server in required_signers(event):
        sigs = event.signatures.get(server)
        # A frozen event's objects are MappingProxyType (freeze): tested by type, an isinstance
        # against the Mapping ABC for every PDU was measurable here.
        wanted[server] = list(sigs) if type(sigs) is MappingProxyType else []
    # Known keys (every PDU after a server's first) are taken without a round of awaits.
    keys = keyring.cached_keyring(wanted, at_ms=event.origin_server_ts)
    if keys is None:
        keys = await keyring.keyring_for(wanted, at_ms=event.origin_server_ts)
    return received, keys


def verify_each(items: Sequence[tuple[ReceivedPdu, KeyRing]]) -> list[FrozenEvent | EventsError]:
    """``verify_received`` of each item: its event, or the error it raised. Pure and thread-safe
    (frozen events, read-only keys), so a caller may run it on a thread: the ed25519 checks
    release the GIL."""
    checked: list[FrozenEvent | EventsError] = []
    for received, keys in items:
        try:
            checked.append(verify_received(received, keys))
        except EventsError as e:
            checked.append(e)
    return checked


def _create_id(room_version: RoomVersion, event: FrozenEvent) -> str | None:
    if room_version.room_id_is_create_event_id:
        return create_event_id_from_room_id(event.room_id)
    return None


async def _load(loader: EventLoader, ids: set[str],
                known: Mapping[str, FrozenEvent] | None) -> dict[str, FrozenEvent]:
    """Events by ID from ``known`` (a batch not stored yet) or the loader."""
    found = {i: known[i] for i in ids if i in known} if known else {}
    found.update(await loader.load_events(ids - set(found)))
    return found


async def check_against_auth_events(loader: EventLoader, room_version: RoomVersion, event: FrozenEvent,
                                    known: Mapping[str, FrozenEvent] | None = None) -> dict[StateKey, str]:
    """Auth rules against the event's own auth events; raises AuthError or MissingEventsError.
    Returns the state it passed on (key -> event ID), for ``check_against_state``'s ``passed``.

    ``known``: events not stored yet that the auth events may be among (a backfill batch)."""
    if event.type == C.CREATE:
        check_auth_rules(room_version, event, {})
        return {}
    wanted = set(event.auth_event_ids)
    create_id = _create_id(room_version, event)
    if create_id is not None:
        wanted.add(create_id)
    loaded = await _load(loader, wanted, known)
    check_auth_events_list(room_version, event, loaded)
    create = loaded.get(create_id) if create_id is not None else None
    if create_id is not None and create is None:
        raise MissingEventsError(frozenset({create_id}), "the room's create event")
    state = auth_state_from_auth_events(
        room_version, [loaded[e] for e in event.auth_event_ids], create_event=create
    )
    check_auth_rules(room_version, event, state)
    return {k: e.event_id for k, e in state.items()}


def auth_state_keys(room_version: RoomVersion, events: Iterable[FrozenEvent]) -> set[StateKey]:
    """The state keys the auth rules read for any of ``events`` (the create event's included): all
    of a state map that ``check_against_state`` of them depends on, however big the room."""
    keys: set[StateKey] = {(C.CREATE, "")}
    for event in events:
        keys.update(auth_types_for_event(room_version, event))
    return keys


def auth_state_ids(room_version: RoomVersion, event: FrozenEvent,
                   state_ids: Mapping[StateKey, str]) -> dict[StateKey, str]:
    """The part of a state map the auth rules read for ``event``: all ``check_against_state``
    depends on, so two maps that agree on it give the same verdict."""
    return {k: state_ids[k] for k in auth_state_keys(room_version, (event,)) if k in state_ids}


async def check_against_state(
    loader: EventLoader, room_version: RoomVersion, event: FrozenEvent, state_ids: Mapping[StateKey, str],
    known: Mapping[str, FrozenEvent] | None = None, *, passed: Mapping[StateKey, str] | None = None,
) -> None:
    """Auth rules against a state map (the state before the event, or the current state).

    ``passed``: a state the event passed the rules on (``check_against_auth_events``' answer). When
    the part of ``state_ids`` the rules read is that same map, create event included, the rules
    would read the same events and give the same verdict: it is not worked out twice."""
    ids = auth_state_ids(room_version, event, state_ids)
    if passed is not None and (C.CREATE, "") in ids and ids == passed:
        return
    loaded = await _load(loader, set(ids.values()), known)
    auth_state = {k: loaded[i] for k, i in ids.items() if i in loaded}
    if (C.CREATE, "") not in auth_state:
        raise AuthError("no create event in the state the event is checked against")
    check_auth_rules(room_version, event, auth_state)


async def verified_in_room(keyring: Keyring, room_version: RoomVersion, room_id: str, pdus: Iterable[object],
                           *, source: str, logger: logging.Logger) -> dict[str, FrozenEvent]:
    """The PDUs a server sent (``source``, for the log) that verify and belong to ``room_id``, by
    event ID; each one that does not is dropped with a warning on ``logger``."""
    found: dict[str, FrozenEvent] = {}
    for pdu in pdus:
        try:
            event = await parse_and_verify(keyring, room_version, pdu)
        except EventsError as e:
            logger.warning("[%s] dropping an event from %s: %s", room_id, source, e)
            continue
        if event.room_id == room_id:
            found[event.event_id] = event
        else:
            logger.warning("[%s] dropping %s from %s: it is of room %s", room_id, event.event_id, source,
                           event.room_id)
    return found


def by_depth(events: Iterable[FrozenEvent]) -> list[FrozenEvent]:
    """Events oldest first: by depth, then by ID, so auth events come before what cites them."""
    return sorted(events, key=lambda e: (e.depth, e.event_id))
