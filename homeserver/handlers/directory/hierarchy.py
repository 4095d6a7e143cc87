"""Spaces: ``GET /v1/rooms/{roomId}/hierarchy`` (clients) and
``GET /_matrix/federation/v1/hierarchy/{roomId}`` (other servers).

A space's children are its current ``m.space.child`` state events whose ``via`` is a
non-empty list. The client walk is breadth-first from the root, children in the
spec's order (``order``, then ``origin_server_ts``, then room ID); a room is shown
when the user may join or peek it (member or invited, public or knock join rule,
world-readable history, or a restricted room whose allowed rooms they are in), and
only shown rooms are walked further. Rooms this server is not in are asked of the
servers in the child event's ``via`` over federation. ``from`` tokens are ``h{n}``:
the walk resumed after its first ``n`` rooms.
"""

# tests: tests/unit/handlers/test_hierarchy.py, tests/integration/test_hierarchy.py

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from homeserver.events import constants as C
from homeserver.events.identifiers import is_valid_room_id, is_valid_server_name
from homeserver.remote.client import FederationClientError
from homeserver.handlers.directory.directory import summary_entry
from storage.kernel.errors import forbidden, invalid_param, not_found
from storage.stores.directory import DirectoryStore, SpaceChildRow

logger = logging.getLogger(__name__)

DEFAULT_LIMIT: Final = 50
MAX_LIMIT: Final = 100
MAX_DEPTH: Final = 10
# The most rooms one walk looks at, and the most servers asked about one remote room.
MAX_WALK: Final = 1000
MAX_VIA_TRIED: Final = 3
SPACE_CHILD: Final = "m.space.child"
JOINABLE: Final = frozenset({"public", "knock"})


def valid_via(content: Mapping[str, Any]) -> list[str]:
    via = content.get("via")
    if not isinstance(via, list):
        return []
    return [server for server in via if isinstance(server, str) and is_valid_server_name(server)]


def child_order_key(child: Mapping[str, Any]) -> tuple[int, str, int, str]:
    """The spec's ordering of a space's children: a valid ``order`` first (lexicographically),
    then ``origin_server_ts``, then room ID."""
    order = child.get("content", {}).get("order")
    valid = isinstance(order, str) and len(order) <= 50 and all(0x20 <= ord(ch) <= 0x7E for ch in order)
    ts = child.get("origin_server_ts")
    return (0 if valid else 1, order if valid and isinstance(order, str) else "",
            ts if isinstance(ts, int) else 0, str(child.get("state_key", "")))


def children_state(rows: Sequence[SpaceChildRow], suggested_only: bool) -> list[dict[str, Any]]:
    """The stripped ``m.space.child`` events a summary carries, in the spec's order."""
    out = [
        {"type": SPACE_CHILD, "state_key": row.child_id, "content": row.content, "sender": row.sender,
         "origin_server_ts": row.origin_server_ts}
        for row in rows
        if valid_via(row.content) and is_valid_room_id(row.child_id)
        and (not suggested_only or row.content.get("suggested") is True)
    ]
    return sorted(out, key=child_order_key)


def may_see(entry: Mapping[str, Any], membership: str | None, joined_rooms: set[str],
            allowed_rooms: Sequence[str] = ()) -> bool:
    """Whether a user may see a room's summary: they may join or peek it."""
    if membership in (C.JOIN, C.INVITE):
        return True
    if entry.get("join_rule") in JOINABLE or entry.get("world_readable") is True:
        return True
    if entry.get("join_rule") in ("restricted", "knock_restricted"):
        return any(room in joined_rooms for room in allowed_rooms)
    return False


def parse_hierarchy_token(text: str | None) -> int:
    if text is None:
        return 0
    digits = text[1:]
    if not text.startswith("h") or not digits.isascii() or not digits.isdigit() or len(digits) > 6:
        raise invalid_param(f"Invalid 'from' token {text[:50]!r}")
    return int(digits)


class HierarchyClient(Protocol):
    async def get_json(self, destination: str, path: str, query: Mapping[str, Any] | None = None) -> Any: ...


class HierarchyHandler:
    def __init__(
        self, *, store: DirectoryStore, server_name: str,
        memberships: Callable[[str], Awaitable[Mapping[str, tuple[str, str]]]],
        remote: HierarchyClient | None = None,
    ) -> None:
        self._store = store
        self._server_name = server_name
        self._memberships = memberships
        self._remote = remote

    async def _local(self, room_ids: Sequence[str], suggested_only: bool) -> dict[str, dict[str, Any]]:
        """Summaries (with ``children_state`` and ``allowed_room_ids``) of the rooms we have state of."""
        rows = await self._store.get_room_rows(room_ids)
        children: dict[str, list[SpaceChildRow]] = {}
        for child in await self._store.get_space_children([row.room_id for row in rows]):
            children.setdefault(child.room_id, []).append(child)
        out = {}
        for row in rows:
            entry = summary_entry(row)
            entry["children_state"] = children_state(children.get(row.room_id, []), suggested_only)
            allow = row.state.get(C.JOIN_RULES, {}).get("allow")
            entry["allowed_room_ids"] = [
                rule["room_id"] for rule in allow if isinstance(rule, Mapping) and isinstance(rule.get("room_id"), str)
            ] if isinstance(allow, list) else []
            out[row.room_id] = entry
        return out

    async def client_hierarchy(
        self, user_id: str, room_id: str, *, suggested_only: bool, max_depth: int | None, limit: int | None,
        from_token: str | None,
    ) -> dict[str, Any]:
        skip = parse_hierarchy_token(from_token)
        limit = min(max(DEFAULT_LIMIT if limit is None else limit, 1), MAX_LIMIT)
        depth_limit = MAX_DEPTH if max_depth is None else min(max(max_depth, 0), MAX_DEPTH)
        memberships = await self._memberships(user_id)
        joined = {room for room, (membership, _) in memberships.items() if membership == C.JOIN}

        def membership_of(room: str) -> str | None:
            entry = memberships.get(room)
            return None if entry is None else entry[0]

        root = (await self._local([room_id], suggested_only)).get(room_id)
        if root is None:
            raise not_found(f"Unknown room {room_id}")
        if not may_see(root, membership_of(room_id), joined, root["allowed_room_ids"]):
            raise forbidden("You may not see this room's hierarchy")
        remote_known: dict[str, dict[str, Any]] = {}
        shown: list[dict[str, Any]] = []
        queue: deque[tuple[str, int, list[str]]] = deque([(room_id, 0, [])])
        seen = {room_id}
        walked = 0
        more = False
        while queue and walked < MAX_WALK:
            current, depth, via = queue.popleft()
            walked += 1
            entry = root if current == room_id else await self._summary(current, via, suggested_only, remote_known)
            if entry is None:
                continue
            if current != room_id and not may_see(entry, membership_of(current), joined,
                                                  entry.get("allowed_room_ids", [])):
                continue
            if len(shown) >= skip + limit:
                more = True
                break
            shown.append(entry)
            if depth < depth_limit:
                for child in entry.get("children_state", []):
                    child_id = child["state_key"]
                    if child_id not in seen:
                        seen.add(child_id)
                        queue.append((child_id, depth + 1, valid_via(child["content"])))
        rooms = [{k: v for k, v in entry.items() if k != "allowed_room_ids"} for entry in shown[skip:]]
        out: dict[str, Any] = {"rooms": rooms}
        if more:
            out["next_batch"] = f"h{skip + limit}"
        return out

    async def _summary(self, room_id: str, via: Sequence[str], suggested_only: bool,
                       remote_known: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        local = (await self._local([room_id], suggested_only)).get(room_id)
        if local is not None and local["num_joined_members"] > 0:
            return local
        if room_id in remote_known:
            return remote_known[room_id]
        if self._remote is None:
            return local
        for server in [s for s in via if s != self._server_name][:MAX_VIA_TRIED]:
            try:
                answer = await self._remote.get_json(
                    server, f"/_matrix/federation/v1/hierarchy/{room_id}",
                    {"suggested_only": "true" if suggested_only else "false"},
                )
            except FederationClientError as e:
                logger.info("hierarchy of %s at %s: %s", room_id[:300], server[:300], e)
                continue
            parsed = remote_hierarchy(answer, room_id)
            if parsed is None:
                continue
            room, children = parsed
            for child in children:
                remote_known.setdefault(child["room_id"], child)
            return room
        return local

    async def federation_hierarchy(self, room_id: str, *, suggested_only: bool) -> dict[str, Any]:
        """This server's answer to another's ``/hierarchy``: the room, the children it may see
        (public or world-readable; restricted ones are listed as inaccessible) and the rest."""
        room = (await self._local([room_id], suggested_only)).get(room_id)
        if room is None or not may_see(room, None, set()):
            raise not_found(f"Room {room_id} is unknown here or not accessible")
        child_ids = [child["state_key"] for child in room["children_state"]]
        known = await self._local(child_ids, suggested_only)
        children, inaccessible = [], []
        for child_id in child_ids:
            entry = known.get(child_id)
            if entry is None:
                continue
            if may_see(entry, None, set()):
                children.append(_without_allowed(entry))
            else:
                inaccessible.append(child_id)
        return {"room": _without_allowed(room), "children": children, "inaccessible_children": inaccessible}


def _without_allowed(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "allowed_room_ids"}


def remote_hierarchy(answer: object, room_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """Another server's ``/hierarchy`` answer: its room (which must be ``room_id``) and the
    well-formed children summaries; None when malformed."""
    if not isinstance(answer, Mapping):
        return None
    raw_room = answer.get("room")
    if not isinstance(raw_room, Mapping) or not _summary_ok(raw_room) or raw_room.get("room_id") != room_id:
        return None
    room = dict(raw_room)
    state = room.get("children_state")
    room["children_state"] = sorted(
        [c for c in state if isinstance(c, Mapping) and c.get("type") == SPACE_CHILD
         and isinstance(c.get("state_key"), str) and is_valid_room_id(c["state_key"])
         and isinstance(c.get("content"), Mapping) and valid_via(c["content"])][:MAX_WALK],
        key=child_order_key,
    ) if isinstance(state, list) else []
    children = answer.get("children")
    summaries = [dict(c) for c in children if isinstance(c, Mapping) and _summary_ok(c)] \
        if isinstance(children, list) else []
    return room, summaries[:MAX_WALK]


def _summary_ok(value: Mapping[str, Any]) -> bool:
    return isinstance(value.get("room_id"), str) and isinstance(value.get("num_joined_members"), int)
