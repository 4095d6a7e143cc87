"""State resolution v1 (room version 1), v2 (versions 2-11) and v2's v12 revision, as one
pure function.

``resolve_state`` takes the state sets to merge (maps of (type, state_key) -> event ID)
and an ``event_map`` holding the events it may need: every event in the state sets and
the auth chains of the conflicted ones (for the default auth difference: of all state
events). It never fetches anything; a missing state-set event is a
``MissingEventsError``, a missing auth-chain event is treated as not part of the chain.
"""

# tests: tests/unit/events/test_state_res.py

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from homeserver.events import constants as C
from homeserver.events.auth import (
    auth_types_for_event,
    check_auth_rules,
    get_user_power_level,
)
from homeserver.events.errors import AuthError, MissingEventsError
from homeserver.events.event import FrozenEvent, StateKey
from homeserver.events.hashing import create_event_id_from_room_id
from homeserver.events.room_versions import RoomVersion, StateResAlgorithm

EventMap = Mapping[str, FrozenEvent]
AuthDifference = Callable[[Sequence[Set[str]]], Set[str]]
"""Given the event IDs of each state set, return their auth difference (∪Cᵢ − ∩Cᵢ)."""


def auth_chain(event_ids: Iterable[str], event_map: EventMap) -> set[str]:
    """All events reachable through ``auth_events`` links from ``event_ids`` (not including
    them unless reachable). Events absent from ``event_map`` end the walk there."""
    chain: set[str] = set()
    stack = [a for e in event_ids if e in event_map for a in event_map[e].auth_event_ids]
    while stack:
        event_id = stack.pop()
        if event_id in chain:
            continue
        chain.add(event_id)
        event = event_map.get(event_id)
        if event is not None:
            stack.extend(a for a in event.auth_event_ids if a not in chain)
    return chain


def default_auth_difference(event_map: EventMap) -> AuthDifference:
    """An ``AuthDifference`` that walks the auth chains in ``event_map``."""

    def difference(state_sets: Sequence[Set[str]]) -> Set[str]:
        chains = [auth_chain(ids, event_map) for ids in state_sets]
        if not chains:
            return set()
        union: set[str] = set().union(*chains)
        common: set[str] = set(chains[0]).intersection(*chains[1:])
        return union - common

    return difference


def is_power_event(event: FrozenEvent) -> bool:
    """Power levels, join rules, or a kick/ban (a leave or ban of someone else)."""
    if not event.is_state():
        return False
    if event.type in (C.POWER_LEVELS, C.JOIN_RULES):
        return True
    return (
        event.type == C.MEMBER
        and event.membership in (C.LEAVE, C.BAN)
        and event.sender != event.state_key
    )


def conflicted_state_subgraph(conflicted: Set[str], event_map: EventMap) -> set[str]:
    """v12: events on some ``auth_events`` path between two conflicted events (endpoints included)."""
    # Forward: everything reachable from the conflicted set, with reverse edges recorded.
    reachable: set[str] = set()
    children: dict[str, list[str]] = {}
    stack = [e for e in conflicted if e in event_map]
    while stack:
        event_id = stack.pop()
        if event_id in reachable:
            continue
        reachable.add(event_id)
        event = event_map.get(event_id)
        if event is None:
            continue
        for parent in event.auth_event_ids:
            children.setdefault(parent, []).append(event_id)
            if parent not in reachable:
                stack.append(parent)
    # Backward: those reachable nodes from which a conflicted event can be reached.
    result: set[str] = set()
    stack = [e for e in conflicted if e in reachable]
    while stack:
        event_id = stack.pop()
        if event_id in result:
            continue
        result.add(event_id)
        stack.extend(c for c in children.get(event_id, ()) if c not in result)
    return result


def resolve_state(
    room_version: RoomVersion,
    state_sets: Sequence[Mapping[StateKey, str]],
    event_map: EventMap,
    *,
    rejected_event_ids: Set[str] = frozenset(),
    auth_difference: AuthDifference | None = None,
) -> dict[StateKey, str]:
    """Resolve ``state_sets`` into one state per the room version's algorithm.

    ``rejected_event_ids``: events rejected on their auth chain; they are not used as
    auth events during the iterative auth checks. ``auth_difference``: an optional
    faster way (e.g. an auth chain index in storage) to compute the auth difference;
    by default it is computed by walking ``event_map``.
    """
    if not state_sets:
        return {}
    if room_version.state_res is StateResAlgorithm.V1:
        return resolve_state_v1(room_version, state_sets, event_map)
    unconflicted, conflicted_keys = _split(state_sets)
    if not conflicted_keys:
        return dict(unconflicted)

    conflicted: set[str] = {s[k] for s in state_sets for k in conflicted_keys if k in s}
    missing = frozenset(e for e in conflicted if e not in event_map)
    if missing:
        raise MissingEventsError(missing, "conflicted state events")

    differ = auth_difference or default_auth_difference(event_map)
    full_conflicted = set(conflicted) | set(differ([set(s.values()) for s in state_sets]))
    if room_version.state_res is StateResAlgorithm.V2_1:
        full_conflicted |= conflicted_state_subgraph(conflicted, event_map)
    full_conflicted &= set(event_map)  # auth-chain events we were not given cannot take part

    resolver = _Resolver(room_version, event_map, rejected_event_ids)

    # Step 1: power events and their auth chains within the full conflicted set.
    power = {e for e in full_conflicted if is_power_event(event_map[e])}
    selected = set(power)
    for event_id in power:
        selected |= auth_chain([event_id], event_map) & full_conflicted
    power_order = resolver.reverse_topological_power_order(selected)

    # Step 2: iterative auth checks from the unconflicted state (v2) or empty state (v2.1).
    start: dict[StateKey, str] = (
        {} if room_version.state_res is StateResAlgorithm.V2_1 else dict(unconflicted)
    )
    partial = resolver.iterative_auth_checks(power_order, start)

    # Steps 3 and 4: the rest, in mainline order of the resolved power levels.
    rest = [e for e in full_conflicted if e not in selected]
    ordered = resolver.mainline_order(rest, partial.get((C.POWER_LEVELS, "")))
    resolved = resolver.iterative_auth_checks(ordered, partial)

    # Step 5: the unconflicted state wins.
    resolved.update(unconflicted)
    return resolved


def _split(state_sets: Sequence[Mapping[StateKey, str]]) -> tuple[dict[StateKey, str], set[StateKey]]:
    unconflicted: dict[StateKey, str] = {}
    conflicted: set[StateKey] = set()
    keys = set().union(*(s.keys() for s in state_sets))
    for key in keys:
        values = {s.get(key) for s in state_sets}
        if len(values) == 1 and None not in values:
            unconflicted[key] = state_sets[0][key]
        else:
            conflicted.add(key)
    return unconflicted, conflicted


class _Resolver:
    """The orderings and the iterative auth checks over one ``event_map``."""

    def __init__(self, room_version: RoomVersion, event_map: EventMap, rejected: Set[str]) -> None:
        self.room_version = room_version
        self.event_map = event_map
        self.rejected = rejected
        self._power_cache: dict[str, int] = {}

    def _create_event_for(self, event: FrozenEvent) -> FrozenEvent | None:
        if not self.room_version.room_id_is_create_event_id:
            return None
        return self.event_map.get(create_event_id_from_room_id(event.room_id))

    def _state_from_auth_events(self, event: FrozenEvent) -> dict[StateKey, FrozenEvent]:
        state: dict[StateKey, FrozenEvent] = {}
        for auth_id in event.auth_event_ids:
            auth_event = self.event_map.get(auth_id)
            if auth_event is None or auth_id in self.rejected:
                continue
            key = auth_event.state_key_tuple
            if key is not None:
                state[key] = auth_event
        create = self._create_event_for(event)
        if create is not None:
            state[(C.CREATE, "")] = create
        return state

    def sender_power(self, event_id: str) -> int:
        """The sender's power level as given by the event's own auth events."""
        cached = self._power_cache.get(event_id)
        if cached is None:
            event = self.event_map[event_id]
            state = self._state_from_auth_events(event)
            cached = get_user_power_level(self.room_version, event.sender, state)
            self._power_cache[event_id] = cached
        return cached

    def reverse_topological_power_order(self, event_ids: Set[str]) -> list[str]:
        """Kahn's algorithm over the auth DAG restricted to ``event_ids``, always taking the
        smallest ready event by (higher sender power, lower origin_server_ts, lower ID)."""
        blockers: dict[str, int] = {}
        dependants: dict[str, list[str]] = {e: [] for e in event_ids}
        for event_id in event_ids:
            parents = {a for a in self.event_map[event_id].auth_event_ids if a in event_ids}
            blockers[event_id] = len(parents)
            for parent in parents:
                dependants[parent].append(event_id)

        def key(event_id: str) -> tuple[int, int, str]:
            event = self.event_map[event_id]
            return (-self.sender_power(event_id), event.origin_server_ts, event_id)

        ready = [key(e) for e, n in blockers.items() if n == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            _, _, event_id = heapq.heappop(ready)
            order.append(event_id)
            for child in dependants[event_id]:
                blockers[child] -= 1
                if blockers[child] == 0:
                    heapq.heappush(ready, key(child))
        return order

    def _pl_parent(self, event: FrozenEvent) -> str | None:
        for auth_id in event.auth_event_ids:
            auth_event = self.event_map.get(auth_id)
            if auth_event is not None and auth_event.state_key_tuple == (C.POWER_LEVELS, ""):
                return auth_id
        return None

    def mainline_order(self, event_ids: Iterable[str], power_levels_id: str | None) -> list[str]:
        """Sort by mainline position of ``power_levels_id`` (greater first), then ts, then ID."""
        mainline: dict[str, int] = {}
        current = power_levels_id
        index = 0
        while current is not None and current in self.event_map and current not in mainline:
            mainline[current] = index
            index += 1
            current = self._pl_parent(self.event_map[current])

        positions: dict[str, int | None] = {}

        def position(event_id: str) -> int | None:
            """Mainline index of the first mainline PL event up e's PL chain; None = ∞."""
            walked: list[str] = []
            found: int | None = None
            current_id: str | None = self._pl_parent(self.event_map[event_id])
            while current_id is not None:
                if current_id in positions:
                    found = positions[current_id]
                    break
                if current_id in mainline:
                    found = mainline[current_id]
                    break
                walked.append(current_id)
                parent_event = self.event_map.get(current_id)
                current_id = None if parent_event is None else self._pl_parent(parent_event)
            # Every PL event walked resolves to the same mainline position (its own chain
            # continues the same way): cache it as the position *of events citing it*.
            for walked_id in walked:
                positions[walked_id] = found
            return found

        def sort_key(event_id: str) -> tuple[int, int, int, str]:
            pos = position(event_id)
            event = self.event_map[event_id]
            if pos is None:
                return (0, 0, event.origin_server_ts, event_id)
            return (1, -pos, event.origin_server_ts, event_id)

        return sorted(event_ids, key=sort_key)

    def iterative_auth_checks(
        self, event_ids: Sequence[str], start: Mapping[StateKey, str]
    ) -> dict[StateKey, str]:
        """Apply each state event in turn when the auth rules allow it against the state so far."""
        state = dict(start)
        for event_id in event_ids:
            event = self.event_map[event_id]
            key = event.state_key_tuple
            if key is None:
                continue
            auth_state = self._state_from_auth_events(event)
            for auth_key in auth_types_for_event(self.room_version, event):
                current_id = state.get(auth_key)
                if current_id is not None and current_id in self.event_map:
                    auth_state[auth_key] = self.event_map[current_id]
            try:
                check_auth_rules(self.room_version, event, auth_state)
            except AuthError:
                continue
            state[key] = event_id
        return state


# --- state resolution v1 (room version 1) ------------------------------------------------

_V1_AUTH_TYPES: tuple[str, ...] = (C.POWER_LEVELS, C.JOIN_RULES, C.MEMBER)
"""The order in which v1 resolves conflicts among the events that affect authorization."""


def _sha1(event_id: str) -> str:
    return hashlib.sha1(event_id.encode("utf-8")).hexdigest()


def resolve_state_v1(
    room_version: RoomVersion, state_sets: Sequence[Mapping[StateKey, str]], event_map: EventMap
) -> dict[StateKey, str]:
    """Room version 1's algorithm, step by step as its spec page gives it.

    R starts as the union of the states minus every key on which they disagree (a key
    present in only some states is not a conflict in v1). Then, for the conflicted
    ``m.room.power_levels``, ``m.room.join_rules`` and ``m.room.member`` keys, in that order:
    sort the candidates by ascending depth, then descending ``sha1(event_id)``; take the
    first, then each next one while it passes the auth rules against R. Every other
    conflicted key takes the candidate with the highest depth (then lowest sha1) that
    passes against R (the last candidate when none does, as Synapse does).
    """
    candidates: dict[StateKey, set[str]] = {}
    for state in state_sets:
        for key, event_id in state.items():
            candidates.setdefault(key, set()).add(event_id)
    resolved: dict[StateKey, str] = {k: next(iter(ids)) for k, ids in candidates.items() if len(ids) == 1}
    conflicted = {k: ids for k, ids in candidates.items() if len(ids) > 1}
    missing = frozenset(e for ids in conflicted.values() for e in ids if e not in event_map)
    if missing:
        raise MissingEventsError(missing, "conflicted state events")

    def allowed(event_id: str) -> bool:
        event = event_map[event_id]
        auth_state: dict[StateKey, FrozenEvent] = {}
        for key in [(C.CREATE, ""), *auth_types_for_event(room_version, event)]:
            current = resolved.get(key)
            if current is not None and current in event_map:
                auth_state[key] = event_map[current]
        try:
            check_auth_rules(room_version, event, auth_state)
        except AuthError:
            return False
        return True

    for event_type in _V1_AUTH_TYPES:
        for key in sorted(k for k in conflicted if k[0] == event_type):
            ordered = sorted(conflicted[key], key=lambda e: (event_map[e].depth, _neg_hex(_sha1(e))))
            resolved[key] = ordered[0]
            for event_id in ordered[1:]:
                if not allowed(event_id):
                    break
                resolved[key] = event_id

    for key in sorted(k for k in conflicted if k[0] not in _V1_AUTH_TYPES):
        ordered = sorted(conflicted[key], key=lambda e: (-event_map[e].depth, _sha1(e)))
        resolved[key] = next((e for e in ordered if allowed(e)), ordered[-1])
    return resolved


def _neg_hex(digest: str) -> tuple[int, ...]:
    """Sorts hex digests in descending order when used as an ascending key."""
    return tuple(-int(c, 16) for c in digest)
