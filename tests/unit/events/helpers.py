"""Hand-built rooms for the events tests: signed events, linear or forked, by room version.

``RoomBuilder`` keeps the current state of one branch of a room; ``fork()`` starts a
second branch from the same point, sharing the event map, so tests can build forked
DAGs for state resolution and reason about each branch's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from signedjson.key import decode_signing_key_base64, get_verify_key

from homeserver.events import constants as C
from homeserver.events.builder import (
    EventTemplate,
    build_pdu,
    compute_depth,
    edge_hashes_of,
    select_auth_event_ids,
    sign_pdu,
)
from homeserver.events.event import FrozenEvent, StateKey
from homeserver.events.room_versions import RoomVersion
from homeserver.events.signing import ServerKey

SEED = "YJDBA9Xnr2sVqXD9Vj7XVUnmFZcZrlw8Md7kMW+3XA1"
SIGNING_KEY = decode_signing_key_base64("ed25519", "1", SEED)
VERIFY_KEY = get_verify_key(SIGNING_KEY)
KEY_ID = "ed25519:1"

ALICE = "@alice:a.test"
BOB = "@bob:b.test"
CAROL = "@carol:c.test"
EVE = "@eve:e.test"


def keyring_for(*servers: str, valid_until_ts: int = 2**50) -> dict[str, dict[str, ServerKey]]:
    """Every test server signs with the same key; this says so for each of ``servers``."""
    return {s: {KEY_ID: ServerKey(VERIFY_KEY, valid_until_ts)} for s in servers}


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def tick(self) -> int:
        self.now += 1000
        return self.now


class RoomBuilder:
    """One branch of a hand-built room."""

    def __init__(
        self,
        room_version: RoomVersion,
        *,
        events: dict[str, FrozenEvent] | None = None,
        clock: _Clock | None = None,
    ) -> None:
        self.room_version = room_version
        self.events: dict[str, FrozenEvent] = {} if events is None else events
        self.clock = clock or _Clock()
        self.state: dict[StateKey, str] = {}
        self.last: list[str] = []
        self.room_id: str | None = None

    def fork(self) -> RoomBuilder:
        other = RoomBuilder(self.room_version, events=self.events, clock=self.clock)
        other.state = dict(self.state)
        other.last = list(self.last)
        other.room_id = self.room_id
        return other

    def state_events(self) -> dict[StateKey, FrozenEvent]:
        return {k: self.events[v] for k, v in self.state.items()}

    def build(
        self,
        event_type: str,
        sender: str,
        content: Mapping[str, object],
        state_key: str | None = None,
        *,
        prev: Sequence[str] | None = None,
        auth_ids: Sequence[str] | None = None,
        ts: int | None = None,
        redacts: str | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> FrozenEvent:
        """Build and sign an event on this branch without adding it to the state."""
        template = EventTemplate(type=event_type, content=content, state_key=state_key, redacts=redacts)
        prev_ids = list(self.last if prev is None else prev)
        if auth_ids is None:
            auth_ids = select_auth_event_ids(self.room_version, template, sender, self.state)
        pdu = build_pdu(
            self.room_version,
            template,
            sender=sender,
            room_id=self.room_id,
            prev_event_ids=prev_ids,
            auth_event_ids=list(auth_ids),
            depth=compute_depth(self.events[p].depth for p in prev_ids if p in self.events),
            origin_server_ts=self.clock.tick() if ts is None else ts,
            edge_hashes=edge_hashes_of(
                self.room_version, [self.events[e] for e in {*prev_ids, *auth_ids} if e in self.events]
            ),
        )
        if extra:
            pdu.update(extra)
        server = sender.partition(":")[2]
        return sign_pdu(self.room_version, pdu, server, SIGNING_KEY)

    def add(self, event_type: str, sender: str, content: Mapping[str, object], state_key: str | None = None, **kw: object) -> FrozenEvent:
        """Build an event and append it to this branch (state and extremity updated)."""
        event = self.build(event_type, sender, content, state_key, **kw)  # type: ignore[arg-type]
        self.events[event.event_id] = event
        if event.state_key is not None:
            self.state[(event.type, event.state_key)] = event.event_id
        self.last = [event.event_id]
        return event

    def create(self, creator: str = ALICE, **content: object) -> FrozenEvent:
        body: dict[str, object] = {"room_version": self.room_version.identifier, **content}
        if self.room_version.create_content_has_creator:
            body.setdefault("creator", creator)
        if not self.room_version.room_id_is_create_event_id:
            self.room_id = "!room:" + creator.partition(":")[2]
        event = self.add(C.CREATE, creator, body, "")
        self.room_id = event.room_id
        return event

    def join(self, user: str, *, ts: int | None = None, **content: object) -> FrozenEvent:
        return self.add(C.MEMBER, user, {"membership": C.JOIN, **content}, user, ts=ts)

    def member(self, sender: str, target: str, membership: str, *, ts: int | None = None,
               **content: object) -> FrozenEvent:
        return self.add(C.MEMBER, sender, {"membership": membership, **content}, target, ts=ts)

    def power_levels(self, sender: str, users: Mapping[str, int], *, ts: int | None = None,
                     **content: object) -> FrozenEvent:
        return self.add(C.POWER_LEVELS, sender, {"users": dict(users), **content}, "", ts=ts)

    def join_rules(self, sender: str, rule: str, *, ts: int | None = None, **content: object) -> FrozenEvent:
        return self.add(C.JOIN_RULES, sender, {"join_rule": rule, **content}, "", ts=ts)


def standard_room(room_version: RoomVersion, join_rule: str = C.PUBLIC, *, bob_level: int | None = None) -> RoomBuilder:
    """Alice creates and joins; power levels (alice 100, bob ``bob_level`` if given); join rules."""
    room = RoomBuilder(room_version)
    room.create(ALICE)
    room.join(ALICE)
    users: dict[str, int] = {}
    if not room_version.privileged_creators:
        users[ALICE] = 100
    if bob_level is not None:
        users[BOB] = bob_level
    room.power_levels(ALICE, users)
    room.join_rules(ALICE, join_rule)
    return room
