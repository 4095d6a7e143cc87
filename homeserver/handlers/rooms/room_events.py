"""Creating events on this server: one event in an existing room, or a whole new room.

``RoomEventCreator.send`` builds an event on the room's forward extremities and
current state, checks the auth rules against that state, signs it and persists
it, all under the room's lock so two sends in one room never fork it.
``send_idempotent`` does the same for ``PUT /send/{txnId}``, recording the
transaction ID in the event's own database transaction.
``create_room`` sends ``/createRoom``'s initial events in the spec's order. HTTP
concerns (parsing, error JSON) stay in the servlets.
"""

# tests: tests/integration/test_room_events.py, tests/integration/test_client_membership.py, tests/unit/handlers/test_membership_precondition.py

from __future__ import annotations

import logging
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs

from signedjson.types import SigningKey

from homeserver.events import (
    AuthError,
    CreateRoomRequest,
    EventTemplate,
    FrozenEvent,
    RoomVersion,
    auth_types_for,
    check_auth_rules,
    build_template,
    encode_canonical,
    get_room_version,
    initial_room_events,
    sign_pdu,
)
from homeserver.events import constants as C
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister
from storage.kernel.errors import MatrixError
from storage.stores.events import DuplicateTxnId, EventsStore, SendTxn, StaleRoomContext, StateKey

logger = logging.getLogger(__name__)

# A send whose room changed under it (another writer: StaleRoomContext) is built again
# on a fresh read, at most this many times in all.
MAX_SEND_ATTEMPTS: Final = 3
# Create events tried, a millisecond apart, before a room ID not already taken is found.
_CREATE_ATTEMPTS: Final = 10



@attrs.frozen
class MembershipPrecondition:
    """A client-API rule stricter than the auth rules: ``user_id``'s current membership
    must be one of ``allowed``, or the send is refused with ``AuthError(message)``.

    Checked against the room's current state before the event is built, by the
    process that owns the room (it travels over the internal API as JSON).
    """

    user_id: str
    allowed: frozenset[str]
    message: str

    def check(self, state: Mapping[StateKey, FrozenEvent]) -> None:
        member = state.get((C.MEMBER, self.user_id))
        if member is None or member.membership not in self.allowed:
            raise AuthError(self.message)

    def to_json(self) -> dict[str, object]:
        return {"user_id": self.user_id, "allowed": sorted(self.allowed), "message": self.message}

    @classmethod
    def from_json(cls, raw: object) -> MembershipPrecondition:
        """The inverse of ``to_json``; anything else is a ValueError."""
        if not isinstance(raw, Mapping):
            raise ValueError("precheck must be an object")
        user_id, allowed, message = raw.get("user_id"), raw.get("allowed"), raw.get("message")
        if not isinstance(user_id, str) or not isinstance(message, str) or not isinstance(allowed, list) \
                or not all(isinstance(m, str) for m in allowed):
            raise ValueError("precheck needs user_id, allowed (strings) and message")
        return cls(user_id, frozenset(allowed), message)


class RoomNotFound(Exception):
    """The room is not known to this server."""

    def __init__(self, room_id: str) -> None:
        super().__init__(f"room {room_id} is not known to this server")
        self.room_id = room_id


class RoomEventCreator:
    def __init__(
        self,
        *,
        persister: EventPersister,
        loader: EventLoader,
        store: EventsStore,
        server_name: str,
        signing_key: SigningKey,
        default_room_version: str,
        clock_ms: Callable[[], int],
    ) -> None:
        self._persister = persister
        self._loader = loader
        self._store = store
        self._server_name = server_name
        self._signing_key = signing_key
        self._default_room_version = default_room_version
        self._clock_ms = clock_ms

    async def room_version(self, room_id: str) -> RoomVersion:
        identifier = await self._store.get_room_version(room_id)
        if identifier is None:
            raise RoomNotFound(room_id)
        return get_room_version(identifier)

    async def send(
        self, room_id: str, template: EventTemplate, sender: str, *, precheck: MembershipPrecondition | None = None
    ) -> FrozenEvent:
        """Create, authorise, sign and persist one event; raises AuthError or RoomNotFound.

        ``precheck``, when given, is checked against the room's current state before
        anything is built (a client-API rule stricter than the auth rules).
        A state event equal to the current one (same type, state key, sender and
        content) is not sent again: the current event is returned, as Synapse does.
        """
        return await self._send(room_id, template, sender, None, precheck)

    async def send_idempotent(self, room_id: str, template: EventTemplate, sender: str, txn: SendTxn) -> str:
        """``send``, recording the client's transaction ID in the event's own transaction.

        Returns the new event's ID or, when ``txn`` was used already (a retried
        request), the ID of the event it was used for; then nothing is sent.
        """
        try:
            return (await self._send(room_id, template, sender, txn, None)).event_id
        except DuplicateTxnId:
            existing = await self._store.get_txn_event(txn.access_token_id, txn.txn_id)
            if existing is None:
                raise
            return existing

    async def _send(
        self, room_id: str, template: EventTemplate, sender: str, txn: SendTxn | None, precheck: MembershipPrecondition | None
    ) -> FrozenEvent:
        room_version = await self.room_version(room_id)
        keys = set(auth_types_for(room_version, template.type, template.state_key, sender, template.content))
        keys.add((C.CREATE, ""))
        own_key = None if template.state_key is None else (template.type, template.state_key)
        attempt = 1
        while True:
            async with self._persister.room_lock(room_id):
                context = await self._persister.send_context(room_id, keys if own_key is None else keys | {own_key})
                current = context.auth_state
                state = await self._load_state(current)
                if (C.CREATE, "") not in state:
                    raise AuthError("the room has no create event")
                if precheck is not None:
                    precheck.check(state)
                existing = None if own_key is None else state.get(own_key)
                if existing is not None and _same_state(existing, template, sender):
                    return existing
                pdu = build_template(
                    room_version,
                    template,
                    sender=sender,
                    room_id=room_id,
                    current_state=current,
                    forward_extremities=context.forward_extremities,
                    origin_server_ts=(template.origin_server_ts if template.origin_server_ts is not None
                                      else self._clock_ms()),
                    edge_hashes=await self._loader.edge_hashes(
                        room_version, [*context.forward_extremities, *current.values()]),
                )
                event = sign_pdu(room_version, pdu, self._server_name, self._signing_key)
                check_auth_rules(room_version, event, {key: state[key] for key in keys if key in state})
                try:
                    await self._persister.persist_local_send(
                        room_version, event, context=context.persist_context(event.prev_event_ids), send_txn=txn
                    )
                except StaleRoomContext as e:
                    if attempt >= MAX_SEND_ATTEMPTS:
                        raise
                    logger.info("[%s] building the event again: %s", room_id, e)
                    attempt += 1
                    continue
            return event

    async def create_room(self, creator: str, request: CreateRoomRequest, *,
                          creator_join_content: Mapping[str, object] | None = None) -> str:
        """Create a room with ``request``'s initial events; return its room ID."""
        room_version = get_room_version(request.room_version or self._default_room_version)
        templates = initial_room_events(
            room_version, creator, request, server_name=self._server_name, creator_join_content=creator_join_content
        )
        return await self.create_room_from_templates(room_version, creator, templates)

    async def create_room_from_templates(
        self, room_version: RoomVersion, creator: str, templates: Sequence[EventTemplate]
    ) -> str:
        """Create a room whose first template is ``m.room.create``, then send the rest as
        ``creator`` (``/createRoom``, and room upgrades); return its room ID."""
        room_id = None if room_version.room_id_is_create_event_id else self._new_room_id()
        origin_server_ts = self._clock_ms()
        for _ in range(_CREATE_ATTEMPTS):
            pdu = build_template(room_version, templates[0], sender=creator, room_id=room_id, current_state={},
                                 forward_extremities={}, origin_server_ts=origin_server_ts)
            create = sign_pdu(room_version, pdu, self._server_name, self._signing_key)
            check_auth_rules(room_version, create, {})
            result = await self._persister.persist(room_version, create, is_local=True)
            if not result.already_persisted:
                break
            # From room version 12 the room ID is the create event's hash: the same creator
            # making the same room in the same millisecond (a script, or two processes) would
            # be handed the other request's room. A later timestamp makes another room.
            origin_server_ts += 1
        else:
            raise MatrixError(500, "M_UNKNOWN", "Could not make a room ID that is not already taken")
        for template in templates[1:]:
            await self.send(create.room_id, template, creator)
        return create.room_id

    def _new_room_id(self) -> str:
        alphabet = string.ascii_letters
        return "!" + "".join(secrets.choice(alphabet) for _ in range(18)) + ":" + self._server_name

    async def _load_state(self, current: Mapping[StateKey, str]) -> dict[StateKey, FrozenEvent]:
        events = await self._loader.load_events(set(current.values()))
        return {key: events[event_id] for key, event_id in current.items() if event_id in events}


def _same_state(existing: FrozenEvent, template: EventTemplate, sender: str) -> bool:
    """Whether sending ``template`` would repeat ``existing`` (same sender and content)."""
    return (
        existing.sender == sender
        and template.redacts is None
        and encode_canonical(existing.content) == encode_canonical(template.content)
    )

