"""The resident server's ``send_join`` (v2) answer, encoded once from the stored JSON.

A big room's answer is tens of megabytes: the state before the join (every member
event) and its auth chain. Parsing each stored event only to serialise it again costs
seconds, so the answer is spliced from the events' stored PDU JSON (what we persisted
is what we serve: ``EventPersister`` stores ``get_pdu_json()`` as compact JSON), read in
bulk, into one ``bytes`` body.

With ``omit_members`` (MSC3706, in the spec since v1.? as send_join v2's
``omit_members``), the state leaves out member events except the joining user's own and
those among the join's auth events (so the joining server can check the join), and those
of the room's heroes when it has neither a name nor a canonical alias (the members a
client would name the room after: ``choose_heroes``), the auth chain is that of what is sent, without the
events already in the state, and the answer says ``members_omitted`` and
``servers_in_room`` (the servers of the members joined in the state before the join).
"""

# tests: tests/unit/federation/test_join_response.py, tests/integration/test_federation_big_join.py

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from typing import Final

from homeserver.events import FrozenEvent, StateKey
from homeserver.events import constants as C
from homeserver.events.canonical import encode_compact
from homeserver.events.identifiers import server_name_of
from homeserver.events.canonical import EncodedJson
from storage.stores.events import EventsStore
from storage.stores.room_state import RoomStateStore

# The spec's m.heroes: up to 5 members other than the joining user.
MAX_HEROES: Final = 5
# Without these the room has no name, and clients name it after its heroes.
NAMING_KEYS: Final = ((C.NAME, ""), (C.CANONICAL_ALIAS, ""))


def choose_heroes(members: Iterable[tuple[str, str, int]], joining: str, limit: int = MAX_HEROES) -> list[str]:
    """The heroes among ``members`` (user ID, membership, stream ordering of that membership):
    the first joined or invited members other than ``joining`` by stream ordering, else the
    first others (left, banned), as a client sync's ``m.heroes`` picks them."""
    others = sorted((order, user, membership) for user, membership, order in members if user != joining)
    present = [user for _, user, membership in others if membership in (C.JOIN, C.INVITE)]
    return (present or [user for _, user, _ in others])[:limit]


def partial_state(
    state: Mapping[StateKey, str], members: Mapping[str, tuple[str, str, int]], joining: str,
    join_auth_ids: Collection[str] = (),
) -> dict[StateKey, str]:
    """The state a resident sends with ``omit_members``: every non-member event; the member
    events the join needs (the joining user's own, such as an invite, and any other among its
    auth events ``join_auth_ids``, such as a restricted join's authoriser's), without which the
    joining server cannot check the join; plus the heroes' member events when the room has no
    name or canonical alias. ``members``: member event ID -> (user ID, membership, stream
    ordering) of the member events of ``state``."""
    kept = {key: event_id for key, event_id in state.items() if key[0] != C.MEMBER}
    needed = set(join_auth_ids)
    for key, event_id in state.items():
        if key[0] == C.MEMBER and (key[1] == joining or event_id in needed):
            kept[key] = event_id
    if not any(key in state for key in NAMING_KEYS):
        in_state = [members[i] for key, i in state.items() if key[0] == C.MEMBER and i in members]
        for hero in choose_heroes(in_state, joining):
            kept[(C.MEMBER, hero)] = state[(C.MEMBER, hero)]
    return kept


def joined_servers(members: Iterable[tuple[str, str, int]]) -> set[str]:
    return {server_name_of(user) for user, membership, _ in members if membership == C.JOIN}


def _json_list(ids: Collection[str], raw: Mapping[str, str]) -> bytes:
    return b"[" + ",".join(raw[i] for i in sorted(ids) if i in raw).encode("utf-8") + b"]"


async def encode_send_join_response(
    store: EventsStore, room_state: RoomStateStore, *, server_name: str, join: FrozenEvent,
    state_before: Mapping[StateKey, str], omit_members: bool,
) -> EncodedJson:
    """The body of our answer to a send_join of ``join`` (as we cosigned it), whose state
    before it is ``state_before``; see the module docstring."""
    head: dict[str, object] = {"origin": server_name, "members_omitted": omit_members}
    state = dict(state_before)
    if omit_members:
        member_ids = [i for key, i in state_before.items() if key[0] == C.MEMBER]
        members = await room_state.get_member_states(member_ids)
        state = partial_state(state_before, members, join.state_key or join.sender, join.auth_event_ids)
        head["servers_in_room"] = sorted(joined_servers(members.values()) | {server_name_of(join.sender)})
    state_ids = set(state.values())
    chain_ids = await store.get_auth_chain_ids(state_ids | set(join.auth_event_ids))
    if omit_members:
        chain_ids -= state_ids
    raw = await room_state.get_event_json(state_ids | chain_ids)
    event = encode_compact(join.pdu).encode("utf-8")
    opening = json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode("utf-8")[:-1]
    return EncodedJson(b"".join((
        opening, b',"event":', event, b',"state":', _json_list(state_ids, raw),
        b',"auth_chain":', _json_list(chain_ids, raw), b"}",
    )))
