"""``POST /search``: full-text search of the rooms a user is joined to (``room_events``).

The request is parsed into a ``RoomEventsSearch`` by pure functions (every malformed
field a 400 naming it); ``SearchHandler`` asks the search store for a page of hits in
the user's joined rooms (narrowed by the filter), keeps only the events history
visibility lets the user see, and adds what was asked for: ``event_context``,
``include_state``, ``groupings``. ``next_batch`` is ``r{offset}`` when ordering by rank
and ``s{n}`` (hits older than stream ordering ``n``) when ordering by recent.
"""

# tests: tests/unit/handlers/test_search.py, tests/integration/test_search.py

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.rooms.messages import room_token
from storage.kernel.errors import bad_json, invalid_param, missing_param
from storage.stores.events import EventsStore
from storage.stores.search import SearchHit, SearchQuery, SearchStore
from storage.stores.timeline import TimelineStore

# The searchable keys (the spec's) and the one event type each is indexed for.
KEY_TYPES: Final = {"content.body": "m.room.message", "content.name": C.NAME, "content.topic": C.TOPIC}
DEFAULT_LIMIT: Final = 10
MAX_LIMIT: Final = 100
MAX_CONTEXT: Final = 20
MAX_TERM_LENGTH: Final = 1000
MAX_LIST: Final = 500
# Rounds of hits one request reads to fill a page when some are hidden from the user.
FILL_ROUNDS: Final = 3


@attrs.frozen
class RoomEventsSearch:
    term: str
    types: tuple[str, ...]
    rooms: tuple[str, ...] | None = None
    not_rooms: tuple[str, ...] = ()
    senders: tuple[str, ...] | None = None
    not_senders: tuple[str, ...] = ()
    limit: int = DEFAULT_LIMIT
    by_rank: bool = True
    before_limit: int | None = None  # event_context wanted when not None
    after_limit: int = 0
    include_profile: bool = False
    include_state: bool = False
    group_by: tuple[str, ...] = ()


def _type_matches(pattern: str, event_type: str) -> bool:
    return event_type.startswith(pattern[:-1]) if pattern.endswith("*") else pattern == event_type


def _strings(value: object, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_LIST or not all(isinstance(v, str) for v in value):
        raise bad_json(f"'{name}' must be a list of at most {MAX_LIST} strings")
    return tuple(value)


def _int(value: object, name: str, default: int, maximum: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad_json(f"'{name}' must be a non-negative integer")
    return min(value, maximum)


def _bool(value: object, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_json(f"'{name}' must be true or false")
    return value


def parse_search_request(body: Mapping[str, Any]) -> RoomEventsSearch:
    categories = body.get("search_categories")
    if not isinstance(categories, Mapping):
        raise missing_param("'search_categories' must be an object")
    criteria = categories.get("room_events")
    if criteria is None:
        raise missing_param("Only the 'room_events' search category is supported, and it is missing")
    if not isinstance(criteria, Mapping):
        raise bad_json("'search_categories.room_events' must be an object")
    term = criteria.get("search_term")
    if not isinstance(term, str):
        raise missing_param("'search_term' is required and must be a string")
    if len(term) > MAX_TERM_LENGTH:
        raise invalid_param(f"'search_term' is longer than {MAX_TERM_LENGTH} characters")
    keys = _strings(criteria.get("keys"), "keys") or tuple(KEY_TYPES)
    unknown = [k for k in keys if k not in KEY_TYPES]
    if unknown:
        raise invalid_param(f"'keys' may hold only {sorted(KEY_TYPES)}, got {unknown[0][:50]!r}")
    types = [KEY_TYPES[k] for k in dict.fromkeys(keys)]
    event_filter = criteria.get("filter")
    if event_filter is None:
        event_filter = {}
    if not isinstance(event_filter, Mapping):
        raise bad_json("'filter' must be an object")
    wanted = _strings(event_filter.get("types"), "filter.types")
    unwanted = _strings(event_filter.get("not_types"), "filter.not_types") or ()
    types = [t for t in types if (wanted is None or any(_type_matches(p, t) for p in wanted))
             and not any(_type_matches(p, t) for p in unwanted)]
    order_by = criteria.get("order_by", "rank")
    if order_by not in ("rank", "recent"):
        raise invalid_param("'order_by' must be 'rank' or 'recent'")
    context = criteria.get("event_context")
    before_limit: int | None = None
    after_limit = 0
    include_profile = False
    if context is not None:
        if not isinstance(context, Mapping):
            raise bad_json("'event_context' must be an object")
        before_limit = _int(context.get("before_limit"), "event_context.before_limit", 5, MAX_CONTEXT)
        after_limit = _int(context.get("after_limit"), "event_context.after_limit", 5, MAX_CONTEXT)
        include_profile = _bool(context.get("include_profile"), "event_context.include_profile")
    groupings = criteria.get("groupings")
    group_by: list[str] = []
    if groupings is not None:
        if not isinstance(groupings, Mapping) or not isinstance(groupings.get("group_by", []), list):
            raise bad_json("'groupings.group_by' must be a list")
        for group in groupings.get("group_by", []):
            key = group.get("key") if isinstance(group, Mapping) else None
            if key not in ("room_id", "sender"):
                raise invalid_param("'groupings.group_by' keys must be 'room_id' or 'sender'")
            group_by.append(key)
    return RoomEventsSearch(
        term=term,
        types=tuple(types),
        rooms=_strings(event_filter.get("rooms"), "filter.rooms"),
        not_rooms=_strings(event_filter.get("not_rooms"), "filter.not_rooms") or (),
        senders=_strings(event_filter.get("senders"), "filter.senders"),
        not_senders=_strings(event_filter.get("not_senders"), "filter.not_senders") or (),
        limit=max(1, _int(event_filter.get("limit"), "filter.limit", DEFAULT_LIMIT, MAX_LIMIT)),
        by_rank=order_by == "rank",
        before_limit=before_limit,
        after_limit=after_limit,
        include_profile=include_profile,
        include_state=_bool(criteria.get("include_state"), "include_state"),
        group_by=tuple(dict.fromkeys(group_by)),
    )


def parse_batch(token: str | None, by_rank: bool) -> tuple[int | None, int]:
    """``next_batch`` -> (before stream ordering, offset); 400 for a token of another ordering."""
    if token is None:
        return None, 0
    prefix, digits = token[:1], token[1:]
    if prefix != ("r" if by_rank else "s") or not digits.isascii() or not digits.isdigit() or len(digits) > 18:
        raise invalid_param(f"Invalid 'next_batch' token {token[:50]!r}")
    return (None, int(digits)) if by_rank else (int(digits), 0)


class SearchHandler:
    def __init__(
        self, *, store: SearchStore, events_store: EventsStore, timeline: TimelineStore, client_events: ClientEvents,
    ) -> None:
        self._store = store
        self._events_store = events_store
        self._timeline = timeline
        self._client_events = client_events

    async def search(self, requester: Requester, request: RoomEventsSearch, next_batch: str | None) -> dict[str, Any]:
        before, offset = parse_batch(next_batch, request.by_rank)
        memberships = await self._timeline.get_rooms_for_user(requester.user_id)
        rooms = {room_id for room_id, (membership, _) in memberships.items() if membership == C.JOIN}
        if request.rooms is not None:
            rooms &= set(request.rooms)
        rooms -= set(request.not_rooms)
        query = SearchQuery(request.term, tuple(sorted(rooms)), request.types, request.senders, request.not_senders)
        # Hits the user may not see are skipped, and the page filled from the next ones (a few rounds).
        shown: list[SearchHit] = []
        visible: dict[str, FrozenEvent] = {}
        count = 0
        more = False
        fetch = request.limit + 1
        for _ in range(FILL_ROUNDS):
            hits, count = await self._store.search(
                query, by_rank=request.by_rank, before=None if request.by_rank else before,
                offset=offset if request.by_rank else 0, limit=fetch,
            )
            events = await self._client_events.load([hit.event_id for hit in hits])
            seen = {e.event_id: e for e in await self._client_events.filter_visible(
                requester.user_id, events, joined_now=True)}
            consumed = 0
            for hit in hits:
                if len(shown) == request.limit:
                    break
                consumed += 1
                offset += 1
                before = hit.stream_ordering
                if hit.event_id in seen:
                    shown.append(hit)
                    visible[hit.event_id] = seen[hit.event_id]
            more = consumed < len(hits) or len(hits) == fetch
            if len(shown) == request.limit or len(hits) < fetch:
                break
        served = await self._client_events.serialize(
            [visible[hit.event_id] for hit in shown], access_token_id=requester.access_token_id,
            bundle_for=requester.user_id,
        )
        results = []
        for hit, event in zip(shown, served):
            result: dict[str, Any] = {"rank": hit.rank, "result": event}
            if request.before_limit is not None:
                result["context"] = await self._context(requester, hit.room_id, hit.stream_ordering, request,
                                                        visible[hit.event_id])
            results.append(result)
        out: dict[str, Any] = {
            "count": count,
            "results": results,
            "highlights": sorted(set(await self._store.highlight_words(request.term))),
        }
        if more and before is not None:
            out["next_batch"] = f"r{offset}" if request.by_rank else f"s{before}"
        if request.include_state:
            out["state"] = {room_id: await self._client_events.serialize(await self._client_events.load(
                sorted((await self._events_store.get_current_state_ids(room_id)).values())))
                for room_id in sorted({hit.room_id for hit in shown})}
        if request.group_by:
            out["groups"] = _groups(request.group_by, [(hit.room_id, visible[hit.event_id]) for hit in shown],
                                    out.get("next_batch"))
        return {"search_categories": {"room_events": out}}

    async def _context(
        self, requester: Requester, room_id: str, ordering: int, request: RoomEventsSearch, event: FrozenEvent,
    ) -> dict[str, Any]:
        before_rows = await self._timeline.get_room_events(
            room_id, start=ordering - 1, end=None, limit=request.before_limit or 0, backwards=True
        ) if request.before_limit else []
        after_rows = await self._timeline.get_room_events(
            room_id, start=ordering, end=None, limit=request.after_limit, backwards=False
        ) if request.after_limit else []
        before = await self._client_events.filter_visible(
            requester.user_id, await self._client_events.load([r[0] for r in before_rows]), joined_now=True)
        after = await self._client_events.filter_visible(
            requester.user_id, await self._client_events.load([r[0] for r in after_rows]), joined_now=True)
        context: dict[str, Any] = {
            "start": room_token((before_rows[-1][1] - 1) if before_rows else ordering - 1),
            "end": room_token(after_rows[-1][1] if after_rows else ordering),
            "events_before": await self._client_events.serialize(before, access_token_id=requester.access_token_id),
            "events_after": await self._client_events.serialize(after, access_token_id=requester.access_token_id),
        }
        if request.include_profile:
            context["profile_info"] = await self._profiles(room_id, {e.sender for e in [*before, event, *after]})
        return context

    async def _profiles(self, room_id: str, senders: set[str]) -> dict[str, Any]:
        ids = await self._events_store.get_current_state_for_keys(room_id, [(C.MEMBER, s) for s in sorted(senders)])
        members = await self._client_events.load(sorted(ids.values()))
        out: dict[str, Any] = {}
        for member in members:
            profile: dict[str, Any] = {}
            for key in ("displayname", "avatar_url"):
                value = member.content.get(key)
                if isinstance(value, str):
                    profile[key] = value
            if member.state_key is not None:
                out[member.state_key] = profile
        return out


def _groups(group_by: Sequence[str], hits: Sequence[tuple[str, FrozenEvent]],
            next_batch: str | None) -> dict[str, Any]:
    """The spec's ``groups``: per key, per value, the result event IDs in order, and the
    order of the groups (by their best result)."""
    out: dict[str, Any] = {}
    for key in group_by:
        groups: dict[str, dict[str, Any]] = {}
        for room_id, event in hits:
            value = room_id if key == "room_id" else event.sender
            group = groups.setdefault(value, {"results": [], "order": len(groups) + 1})
            group["results"].append(event.event_id)
            if next_batch is not None:
                group["next_batch"] = next_batch
        out[key] = groups
    return out

