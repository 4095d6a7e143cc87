"""The room directory (``/directory/list/room``, ``/publicRooms``, here and over federation)
and the user directory (``/user_directory/search``).

The pure part decides what a published room's entry says, which entries a filter keeps,
their order (most joined members first, then room ID) and the pages (``since`` tokens
are ``o{offset}``); ``DirectoryHandler`` reads the store, checks who may publish, and asks
another server for its list over federation. Rooms are listed only while their join
rule is ``public`` or ``knock`` or their history is ``world_readable``, and someone is
joined.
"""

# tests: tests/unit/handlers/test_directory.py, tests/integration/test_directory.py

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

from homeserver.events import constants as C
from homeserver.events import get_room_version
from homeserver.events.auth import get_send_level, get_user_power_level
from homeserver.remote.client import FederationClientError, HttpResponseError
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.event_loader import EventLoader
from storage.kernel.errors import MatrixError, forbidden, invalid_param, not_found
from storage.stores.directory import DirectoryStore, PublicRoomRow
from storage.stores.events import EventsStore
from storage.stores.user_directory import UserDirectoryStore

logger = logging.getLogger(__name__)

DEFAULT_PUBLIC_ROOMS_LIMIT: Final = 100
MAX_PUBLIC_ROOMS_LIMIT: Final = 500
MAX_SEARCH_TERM: Final = 256
DEFAULT_USER_SEARCH_LIMIT: Final = 10
MAX_USER_SEARCH_LIMIT: Final = 100
LISTABLE_JOIN_RULES: Final = frozenset({"public", "knock"})
# The listable entries are built from every published room's state; a list this process
# built less than this long ago is served again (its own publishes clear it at once).
PUBLIC_ROOMS_CACHE_MS: Final = 10_000


@attrs.frozen
class PublicRoomsFilter:
    search_term: str | None = None
    # None: any room type; otherwise the allowed types, None standing for "no type".
    room_types: frozenset[str | None] | None = None


def parse_public_rooms_filter(value: object) -> PublicRoomsFilter:
    """``filter`` of ``POST /publicRooms``; 400 ``M_BAD_JSON`` / ``M_INVALID_PARAM`` when malformed."""
    if value is None:
        return PublicRoomsFilter()
    if not isinstance(value, Mapping):
        raise MatrixError(400, "M_BAD_JSON", "'filter' must be an object")
    term = value.get("generic_search_term")
    if term is not None and not isinstance(term, str):
        raise MatrixError(400, "M_BAD_JSON", "'filter.generic_search_term' must be a string")
    if term is not None and len(term) > MAX_SEARCH_TERM:
        raise invalid_param(f"'filter.generic_search_term' is longer than {MAX_SEARCH_TERM} characters")
    types = value.get("room_types")
    room_types: frozenset[str | None] | None = None
    if types is not None:
        if not isinstance(types, list) or len(types) > 50 or not all(t is None or isinstance(t, str) for t in types):
            raise MatrixError(400, "M_BAD_JSON", "'filter.room_types' must be a list of strings or nulls")
        room_types = frozenset(types)
    return PublicRoomsFilter(term.strip() or None if term is not None else None, room_types)


def parse_since(since: str | None) -> int:
    """``o{offset}`` -> offset (0 when absent); 400 ``M_INVALID_PARAM`` otherwise."""
    if since is None or since == "":
        return 0
    digits = since[1:]
    if not since.startswith("o") or not digits.isascii() or not digits.isdigit() or len(digits) > 9:
        raise invalid_param(f"Invalid 'since' token {since[:50]!r}")
    return int(digits)


def room_entry(row: PublicRoomRow) -> dict[str, Any] | None:
    """The ``/publicRooms`` entry of a published room, or None when it may not be listed."""
    entry = summary_entry(row)
    if row.joined_members <= 0 or (entry["join_rule"] not in LISTABLE_JOIN_RULES and not entry["world_readable"]):
        return None
    return entry


def summary_entry(row: PublicRoomRow) -> dict[str, Any]:
    """A room's summary as ``/publicRooms`` and ``/hierarchy`` show it (``PublicRoomsChunk``)."""
    state = row.state
    join_rule = _str(state.get(C.JOIN_RULES, {}), "join_rule") or "invite"
    history = _str(state.get(C.HISTORY_VISIBILITY, {}), "history_visibility") or "shared"
    entry: dict[str, Any] = {
        "room_id": row.room_id,
        "num_joined_members": row.joined_members,
        "world_readable": history == C.WORLD_READABLE,
        "guest_can_join": _str(state.get(C.GUEST_ACCESS, {}), "guest_access") == "can_join",
        "join_rule": join_rule,
    }
    for key, (event_type, field) in {
        "name": (C.NAME, "name"), "topic": (C.TOPIC, "topic"), "avatar_url": ("m.room.avatar", "url"),
        "canonical_alias": (C.CANONICAL_ALIAS, "alias"), "room_type": (C.CREATE, "type"),
    }.items():
        value = _str(state.get(event_type, {}), field)
        if value:
            entry[key] = value
    return entry


def _str(content: Mapping[str, Any], key: str) -> str | None:
    value = content.get(key)
    return value if isinstance(value, str) else None


def matches(entry: Mapping[str, Any], room_filter: PublicRoomsFilter) -> bool:
    if room_filter.room_types is not None and entry.get("room_type") not in room_filter.room_types:
        return False
    term = room_filter.search_term
    if term is None:
        return True
    needle = term.casefold()
    return any(
        isinstance(entry.get(key), str) and needle in entry[key].casefold()
        for key in ("name", "topic", "canonical_alias", "room_id")
    )


def page(entries: Sequence[dict[str, Any]], *, since: int, limit: int | None) -> dict[str, Any]:
    """One page of ``entries``, ordered most joined members first (then room ID)."""
    ordered = sorted(entries, key=lambda e: (-int(e["num_joined_members"]), str(e["room_id"])))
    size = len(ordered) if limit is None else limit
    chunk = ordered[since:since + size]
    out: dict[str, Any] = {"chunk": chunk, "total_room_count_estimate": len(ordered)}
    if since + size < len(ordered):
        out["next_batch"] = f"o{since + size}"
    if since > 0:
        out["prev_batch"] = f"o{max(0, since - size)}"
    return out


class PublicRoomsClient(Protocol):
    """What the directory needs of ``FederationClient``."""

    async def get_json(self, destination: str, path: str, query: Mapping[str, Any] | None = None) -> Any: ...

    async def post_json(self, destination: str, path: str, content: Any) -> Any: ...


class DirectoryHandler:
    def __init__(
        self, *, store: DirectoryStore, events_store: EventsStore, loader: EventLoader, server_name: str,
        clock_ms: Callable[[], int], remote: PublicRoomsClient | None = None,
        is_joined: Callable[[str, str], Awaitable[bool]],
        users: UserDirectoryStore,
        search_all_users: bool = False,
    ) -> None:
        self._store = store
        self._events_store = events_store
        self._loader = loader
        self._server_name = server_name
        self._clock_ms = clock_ms
        self._remote = remote
        self._is_joined = is_joined
        self._users = users
        self._search_all_users = search_all_users
        self._cached: tuple[int, list[dict[str, Any]]] | None = None

    async def get_visibility(self, room_id: str) -> dict[str, str]:
        if await self._events_store.get_room_version(room_id) is None:
            raise not_found(f"Unknown room {room_id}")
        return {"visibility": "public" if await self._store.is_published(room_id) else "private"}

    async def set_visibility(self, requester: Requester, room_id: str, visibility: str) -> None:
        """Publish or unpublish; the user must be joined and allowed to set the room's
        ``m.room.canonical_alias`` (as Synapse)."""
        version = await self._events_store.get_room_version(room_id)
        if version is None:
            raise not_found(f"Unknown room {room_id}")
        if not await self._is_joined(requester.user_id, room_id):
            raise forbidden("You must be joined to the room to change its directory visibility")
        keys = [(C.POWER_LEVELS, ""), (C.CREATE, "")]
        ids = await self._events_store.get_current_state_for_keys(room_id, keys)
        loaded = await self._loader.load_events(set(ids.values()))
        state = {key: loaded[eid] for key, eid in ids.items() if eid in loaded}
        if get_user_power_level(get_room_version(version), requester.user_id, state) < get_send_level(
            state, C.CANONICAL_ALIAS, True
        ):
            raise forbidden("You may not change this room's directory visibility")
        await self.publish(room_id, visibility == "public")

    async def publish(self, room_id: str, published: bool = True) -> None:
        await self._store.set_published(room_id, published, self._clock_ms())
        self._cached = None

    async def _entries(self) -> list[dict[str, Any]]:
        """Every listable entry, most joined members first (cached for PUBLIC_ROOMS_CACHE_MS)."""
        now = self._clock_ms()
        if self._cached is not None and now - self._cached[0] < PUBLIC_ROOMS_CACHE_MS:
            return self._cached[1]
        entries = [entry for entry in map(room_entry, await self._store.get_public_rooms()) if entry is not None]
        entries.sort(key=lambda e: (-int(e["num_joined_members"]), str(e["room_id"])))
        self._cached = (now, entries)
        return entries

    async def local_public_rooms(
        self, *, since: str | None, limit: int | None, room_filter: PublicRoomsFilter
    ) -> dict[str, Any]:
        offset = parse_since(since)
        if limit is not None:
            limit = min(max(limit, 1), MAX_PUBLIC_ROOMS_LIMIT)
        entries = [entry for entry in await self._entries() if matches(entry, room_filter)]
        return page(entries, since=offset, limit=limit)

    async def public_rooms(
        self, *, server: str | None, since: str | None, limit: int | None, room_filter: PublicRoomsFilter,
        raw_filter: object = None,
    ) -> dict[str, Any]:
        """Our list, or (``server`` another server) theirs over federation ``/publicRooms``."""
        if server is None or server == self._server_name:
            return await self.local_public_rooms(since=since, limit=limit, room_filter=room_filter)
        if self._remote is None:
            raise MatrixError(502, "M_UNKNOWN", "This process cannot reach other servers")
        body: dict[str, Any] = {}
        if limit is not None:
            body["limit"] = limit
        if since is not None:
            body["since"] = since
        if raw_filter is not None:
            body["filter"] = raw_filter
        try:
            if raw_filter is None:
                query = {key: str(value) for key, value in body.items()}
                answer = await self._remote.get_json(server, "/_matrix/federation/v1/publicRooms", query)
            else:
                answer = await self._remote.post_json(server, "/_matrix/federation/v1/publicRooms", body)
        except HttpResponseError as e:
            logger.info("publicRooms of %s: %s", server[:300], e)
            raise MatrixError(502, "M_UNKNOWN", f"{server[:255]} answered /publicRooms with {e.code}") from None
        except FederationClientError as e:
            logger.info("publicRooms of %s: %s", server[:300], e)
            raise MatrixError(502, "M_UNKNOWN", f"Could not reach {server[:255]}") from None
        return remote_public_rooms(answer)

    async def search_users(self, requester: Requester, term: str, limit: int) -> dict[str, Any]:
        limit = min(max(limit, 1), MAX_USER_SEARCH_LIMIT)
        rows = await self._users.search_users(
            requester.user_id, term, limit=limit + 1, search_all_local=self._search_all_users
        )
        results = []
        for row in rows[:limit]:
            result: dict[str, Any] = {"user_id": row.user_id}
            if row.display_name is not None:
                result["display_name"] = row.display_name
            if row.avatar_url is not None:
                result["avatar_url"] = row.avatar_url
            results.append(result)
        return {"results": results, "limited": len(rows) > limit}


def remote_public_rooms(answer: object) -> dict[str, Any]:
    """Another server's ``/publicRooms`` answer, kept to the spec's shape (malformed entries dropped)."""
    if not isinstance(answer, Mapping) or not isinstance(answer.get("chunk"), list):
        raise MatrixError(502, "M_UNKNOWN", "The other server's /publicRooms answer is malformed")
    chunk = [
        entry for entry in answer["chunk"][:MAX_PUBLIC_ROOMS_LIMIT]
        if isinstance(entry, Mapping) and isinstance(entry.get("room_id"), str)
        and isinstance(entry.get("num_joined_members"), int)
    ]
    out: dict[str, Any] = {"chunk": chunk}
    for key in ("next_batch", "prev_batch"):
        if isinstance(answer.get(key), str):
            out[key] = answer[key]
    if isinstance(answer.get("total_room_count_estimate"), int):
        out["total_room_count_estimate"] = answer["total_room_count_estimate"]
    return out
