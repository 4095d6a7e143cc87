"""Simplified sliding sync (MSC4186) requests: parsing, room configs and range slicing, all pure.

A request body becomes a frozen ``SlidingSyncRequest`` or a ``MatrixError`` naming the field
(``M_BAD_JSON`` for a wrong JSON type, ``M_INVALID_PARAM`` for a bad value), so the handler
never sees a malformed request. Both request shapes clients send are read: Synapse's (and
today's clients': ``ranges``, ``required_state`` as ``[type, state_key]`` pairs with ``*``,
``$LAZY`` and ``$ME``, ``is_invite``, ``pos``/``timeout`` in the query) and the MSC's latest
text (``range``, ``required_state`` as ``include``/``exclude``/``lazy_members``, ``is_invited``,
``pos``/``timeout`` in the body). Nothing here reads the database or knows a room.
"""

# tests: tests/unit/handlers/test_sliding_sync_request.py

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from homeserver.events import constants as C
from homeserver.events.validation import check_room_id
from storage.kernel.errors import MatrixError, bad_json, invalid_param

MAX_LISTS: Final = 100
MAX_SUBSCRIPTIONS: Final = 1000
MAX_RANGES: Final = 100
MAX_RANGE_INDEX: Final = 1_000_000
MAX_TIMELINE_LIMIT: Final = 1000
MAX_REQUIRED_STATE: Final = 200
MAX_FILTER_ITEMS: Final = 100
MAX_KEY_LENGTH: Final = 255
MAX_TIMEOUT_MS: Final = 300_000
WILDCARD: Final = "*"
LAZY: Final = "$LAZY"
ME: Final = "$ME"
PRESENCE_VALUES: Final = ("online", "offline", "unavailable")
DEFAULT_TO_DEVICE_LIMIT: Final = 100
MAX_TO_DEVICE_LIMIT: Final = 1000
EXTENSIONS: Final = ("to_device", "e2ee", "account_data", "receipts", "typing")


@attrs.frozen
class StateSpec:
    """One ``required_state`` as asked: ``include`` (type, state_key) pairs where either may be
    ``*`` and the state key ``$ME`` or ``$LAZY``; ``exclude`` pairs (``*`` for any) win over it.
    A type named in ``include`` is matched by its own entries only: ``[["*", "*"],
    ["m.room.member", "$LAZY"]]`` is all state with lazy-loaded members (MSC3575's example)."""

    include: frozenset[tuple[str, str]] = frozenset()
    exclude: frozenset[tuple[str, str]] = frozenset()

    @property
    def lazy(self) -> bool:
        return (C.MEMBER, LAZY) in self.include or (WILDCARD, LAZY) in self.include

    def _explicit(self, event_type: str) -> bool:
        return any(t == event_type for t, _ in self.include)

    def matches(self, event_type: str, state_key: str, user_id: str) -> bool:
        def keyed(kind: str) -> bool:
            return ((kind, state_key) in self.include or (kind, WILDCARD) in self.include
                    or (state_key == user_id and (kind, ME) in self.include))

        hit = keyed(event_type) if self._explicit(event_type) else keyed(WILDCARD)
        if not hit:
            return False
        return not any((t in (WILDCARD, event_type)) and (k in (WILDCARD, state_key)) for t, k in self.exclude)

    def all_members(self) -> bool:
        """Whether every member event may match (so all must be read)."""
        if self._explicit(C.MEMBER):
            return (C.MEMBER, WILDCARD) in self.include
        return (WILDCARD, WILDCARD) in self.include

    def member_keys(self, user_id: str) -> set[str]:
        """The member state keys named (``$ME`` as ``user_id``)."""
        kind = C.MEMBER if self._explicit(C.MEMBER) else WILDCARD
        keys = {k for t, k in self.include if t == kind and k not in (WILDCARD, LAZY)}
        return {user_id if k == ME else k for k in keys}


@attrs.frozen
class RoomConfig:
    """A room's combined config: the largest timeline limit, and every ``required_state`` asked
    (a state event is returned when any of them matches it)."""

    timeline_limit: int
    required_state: frozenset[StateSpec] = frozenset()

    def combine(self, other: RoomConfig) -> RoomConfig:
        return RoomConfig(max(self.timeline_limit, other.timeline_limit), self.required_state | other.required_state)

    @property
    def lazy(self) -> bool:
        return any(spec.lazy for spec in self.required_state)

    def matches(self, event_type: str, state_key: str, user_id: str) -> bool:
        return any(spec.matches(event_type, state_key, user_id) for spec in self.required_state)

    def all_members(self) -> bool:
        return any(spec.all_members() for spec in self.required_state)

    def member_keys(self, user_id: str) -> set[str]:
        return {key for spec in self.required_state for key in spec.member_keys(user_id)}

    def needs_all_members(self, user_id: str) -> bool:
        """Whether it asks for member events beyond the user's own and the lazy ones: a room
        joined with partial state could not answer it right until its state is whole."""
        return self.all_members() or bool(self.member_keys(user_id) - {user_id})

    @classmethod
    def from_json(cls, text: str) -> RoomConfig:
        """The config ``to_json`` wrote (a stored subscription)."""
        data = json.loads(text)
        return cls(int(data["timeline_limit"]), frozenset(
            StateSpec(frozenset(map(tuple, inc)), frozenset(map(tuple, exc))) for inc, exc in data["required_state"]))

    def to_json(self) -> str:
        """A canonical text, stored per room to tell when the config changed."""
        specs = sorted([sorted(map(list, s.include)), sorted(map(list, s.exclude))] for s in self.required_state)
        return json.dumps({"timeline_limit": self.timeline_limit, "required_state": specs}, sort_keys=True)

    def timeline_expanded_from(self, stored: str) -> bool:
        """Whether this config's timeline limit is larger than that of the config stored as ``stored``."""
        try:
            old_limit = json.loads(stored)["timeline_limit"]
        except (ValueError, KeyError, TypeError):
            return False
        return isinstance(old_limit, int) and self.timeline_limit > old_limit

    def state_expanded_from(self, stored: str) -> bool:
        """Whether this config may return state the config stored as ``stored`` did not."""
        try:
            old = json.loads(stored)
            specs = {StateSpec(frozenset(map(tuple, inc)), frozenset(map(tuple, exc)))
                     for inc, exc in old["required_state"]}
        except (ValueError, KeyError, TypeError):
            return True
        return not self.required_state <= specs


@attrs.frozen
class ListFilters:
    is_dm: bool | None = None
    is_encrypted: bool | None = None
    is_invite: bool | None = None
    room_types: tuple[str | None, ...] | None = None
    not_room_types: tuple[str | None, ...] = ()
    spaces: tuple[str, ...] | None = None
    # Room tags (the m.tag room account data): any of ``tags``, none of ``not_tags``.
    tags: tuple[str, ...] | None = None
    not_tags: tuple[str, ...] = ()


@attrs.frozen
class ListConfig:
    ranges: tuple[tuple[int, int], ...] | None  # None: the whole list
    config: RoomConfig
    filters: ListFilters = ListFilters()


@attrs.frozen
class Extensions:
    to_device: bool = False
    to_device_since: int | None = None
    to_device_limit: int = DEFAULT_TO_DEVICE_LIMIT
    e2ee: bool = False
    account_data: bool = False
    receipts: bool = False
    typing: bool = False

    def any(self) -> bool:
        return self.to_device or self.e2ee or self.account_data or self.receipts or self.typing


@attrs.frozen
class SlidingSyncRequest:
    conn_id: str = ""
    pos: int | None = None
    timeout_ms: int = 0
    set_presence: str = "online"
    lists: Mapping[str, ListConfig] = attrs.Factory(dict)
    subscriptions: Mapping[str, RoomConfig] = attrs.Factory(dict)
    # Subscriptions of earlier requests to drop (they hold until then).
    unsubscribe: frozenset[str] = frozenset()
    extensions: Extensions = Extensions()


def _object(value: object, field: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_json(f"'{field}' must be an object")
    return value


def _array(value: object, field: str, max_items: int) -> Sequence[Any]:
    if not isinstance(value, list):
        raise bad_json(f"'{field}' must be an array")
    if len(value) > max_items:
        raise invalid_param(f"'{field}' has {len(value)} items; at most {max_items} are allowed")
    return value


def _bool(value: object, field: str) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_json(f"'{field}' must be true or false")
    return value


def _int(value: object, field: str, *, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_json(f"'{field}' must be an integer")
    if not minimum <= value <= maximum:
        raise invalid_param(f"'{field}' must be between {minimum} and {maximum}, got {value}")
    return value


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise bad_json(f"'{field}' must be a string")
    if len(value) > MAX_KEY_LENGTH:
        raise invalid_param(f"'{field}' is longer than {MAX_KEY_LENGTH} characters")
    return value


def parse_pos(value: object, field: str = "pos") -> int:
    """A ``pos`` token: the decimal position this server handed out."""
    text = _text(value, field)
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise unknown_pos(f"'{field}' {text[:50]!r} is not a position this server handed out")
    return int(text)


def unknown_pos(error: str) -> MatrixError:
    """MSC4186: a ``pos`` the server does not know (or no longer keeps): start again without one."""
    return MatrixError(400, "M_UNKNOWN_POS", error)


def parse_timeout(value: object, *, query: bool) -> int:
    """Milliseconds to wait (capped): an integer in the body, decimal text in the query string."""
    if query:
        text = str(value)
        if not text.isascii() or not text.isdigit() or len(text) > 10:
            raise invalid_param("'timeout' must be a non-negative integer")
        return min(int(text), MAX_TIMEOUT_MS)
    return min(_int(value, "timeout", minimum=0, maximum=2**53), MAX_TIMEOUT_MS)


def parse_required_state(value: object, field: str) -> StateSpec:
    if isinstance(value, Mapping):  # the MSC's latest shape
        def elements(key: str) -> frozenset[tuple[str, str]]:
            out = set()
            raw = value.get(key)
            for i, item in enumerate(_array(raw, f"{field}.{key}", MAX_REQUIRED_STATE) if raw is not None else []):
                item = _object(item, f"{field}.{key}[{i}]")
                kind = _text(item["type"], f"{field}.{key}[{i}].type") if item.get("type") is not None else WILDCARD
                key_ = (_text(item["state_key"], f"{field}.{key}[{i}].state_key")
                        if item.get("state_key") is not None else WILDCARD)
                out.add((kind, key_))
            return frozenset(out)

        include = elements("include")
        if _bool(value.get("lazy_members"), f"{field}.lazy_members"):
            include |= {(C.MEMBER, LAZY)}
        return StateSpec(include, elements("exclude"))
    pairs = set()
    for i, item in enumerate(_array(value, field, MAX_REQUIRED_STATE)):
        pair = item
        if not isinstance(pair, list) or len(pair) != 2:
            raise bad_json(f"'{field}[{i}]' must be a [type, state_key] pair")
        pairs.add((_text(pair[0], f"{field}[{i}][0]"), _text(pair[1], f"{field}[{i}][1]")))
    return StateSpec(frozenset(pairs))


def parse_room_config(value: Mapping[str, Any], field: str) -> RoomConfig:
    limit = value.get("timeline_limit")
    timeline_limit = 0 if limit is None else _int(limit, f"{field}.timeline_limit", minimum=0, maximum=2**31)
    state = value.get("required_state")
    specs = frozenset() if state is None else frozenset({parse_required_state(state, f"{field}.required_state")})
    return RoomConfig(min(timeline_limit, MAX_TIMELINE_LIMIT), specs)


def _types(value: object, field: str) -> tuple[str | None, ...]:
    return tuple(None if t is None else _text(t, f"{field}[{i}]")
                 for i, t in enumerate(_array(value, field, MAX_FILTER_ITEMS)))


def _strings(value: object, field: str) -> tuple[str, ...]:
    return tuple(_text(t, f"{field}[{i}]") for i, t in enumerate(_array(value, field, MAX_FILTER_ITEMS)))


def parse_filters(value: object, field: str) -> ListFilters:
    raw = _object(value, field)
    is_invite = raw.get("is_invited", raw.get("is_invite"))
    spaces = raw.get("spaces")
    room_types = raw.get("room_types")
    return ListFilters(
        is_dm=_bool(raw.get("is_dm"), f"{field}.is_dm"),
        is_encrypted=_bool(raw.get("is_encrypted"), f"{field}.is_encrypted"),
        is_invite=_bool(is_invite, f"{field}.is_invite"),
        room_types=None if room_types is None else _types(room_types, f"{field}.room_types"),
        not_room_types=() if raw.get("not_room_types") is None else _types(raw["not_room_types"],
                                                                           f"{field}.not_room_types"),
        spaces=None if spaces is None else tuple(
            check_room_id(_text(s, f"{field}.spaces[{i}]"))
            for i, s in enumerate(_array(spaces, f"{field}.spaces", MAX_FILTER_ITEMS))
        ),
        tags=None if raw.get("tags") is None else _strings(raw["tags"], f"{field}.tags"),
        not_tags=() if raw.get("not_tags") is None else _strings(raw["not_tags"], f"{field}.not_tags"),
    )


def _range(value: object, field: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise bad_json(f"'{field}' must be a [start, end] pair")
    pair = value
    start = _int(pair[0], f"{field}[0]", minimum=0, maximum=MAX_RANGE_INDEX)
    end = _int(pair[1], f"{field}[1]", minimum=0, maximum=MAX_RANGE_INDEX)
    if end < start:
        raise invalid_param(f"'{field}' ends ({end}) before it starts ({start})")
    return start, end


def parse_list(value: object, field: str) -> ListConfig:
    raw = _object(value, field)
    ranges: tuple[tuple[int, int], ...] | None = None
    if raw.get("ranges") is not None:
        ranges = tuple(_range(r, f"{field}.ranges[{i}]")
                       for i, r in enumerate(_array(raw["ranges"], f"{field}.ranges", MAX_RANGES)))
    elif raw.get("range") is not None:
        ranges = (_range(raw["range"], f"{field}.range"),)
    return ListConfig(ranges, parse_room_config(raw, field), parse_filters(raw.get("filters"), f"{field}.filters"))


def parse_extensions(value: object) -> Extensions:
    raw = _object(value, "extensions")
    enabled: dict[str, bool] = {}
    since: int | None = None
    limit = DEFAULT_TO_DEVICE_LIMIT
    for name in EXTENSIONS:
        config = _object(raw.get(name), f"extensions.{name}")
        enabled[name] = _bool(config.get("enabled"), f"extensions.{name}.enabled") is True
        if name == "to_device" and config.get("since") is not None:
            text = _text(config["since"], "extensions.to_device.since")
            if not text.isascii() or not text.isdigit() or len(text) > 18:
                raise invalid_param(f"'extensions.to_device.since' {text[:50]!r} is not a to-device position")
            since = int(text)
        if name == "to_device" and config.get("limit") is not None:
            limit = _int(config["limit"], "extensions.to_device.limit", minimum=1, maximum=2**31)
    return Extensions(to_device=enabled["to_device"], to_device_since=since,
                      to_device_limit=min(limit, MAX_TO_DEVICE_LIMIT), e2ee=enabled["e2ee"],
                      account_data=enabled["account_data"], receipts=enabled["receipts"], typing=enabled["typing"])


def parse_request(body: Mapping[str, Any], *, query_pos: str | None = None,
                  query_timeout: str | None = None) -> SlidingSyncRequest:
    """The request ``body`` (with ``pos`` and ``timeout`` from the query string when the body has
    none, as Synapse takes them)."""
    conn_id = "" if body.get("conn_id") is None else _text(body["conn_id"], "conn_id")
    pos_value: object = body.get("pos", query_pos)
    timeout_value: object = body.get("timeout", query_timeout)
    timeout_in_query = "timeout" not in body
    set_presence = "online" if body.get("set_presence") is None else _text(body["set_presence"], "set_presence")
    if set_presence not in PRESENCE_VALUES:
        raise invalid_param("'set_presence' must be one of online, offline, unavailable")
    lists_raw = _object(body.get("lists"), "lists")
    if len(lists_raw) > MAX_LISTS:
        raise invalid_param(f"at most {MAX_LISTS} lists are allowed, got {len(lists_raw)}")
    lists = {_text(name, "lists key"): parse_list(value, f"lists.{name}") for name, value in lists_raw.items()}
    subs_raw = _object(body.get("room_subscriptions"), "room_subscriptions")
    if len(subs_raw) > MAX_SUBSCRIPTIONS:
        raise invalid_param(f"at most {MAX_SUBSCRIPTIONS} room subscriptions are allowed, got {len(subs_raw)}")
    subscriptions = {
        check_room_id(_text(room_id, "room_subscriptions key")):
            parse_room_config(_object(value, f"room_subscriptions.{room_id}"), f"room_subscriptions.{room_id}")
        for room_id, value in subs_raw.items()
    }
    return SlidingSyncRequest(
        conn_id=conn_id,
        pos=None if pos_value is None or pos_value == "" else parse_pos(pos_value),
        timeout_ms=0 if timeout_value is None or timeout_value == "" else parse_timeout(timeout_value,
                                                                                         query=timeout_in_query),
        set_presence=set_presence,
        lists=lists,
        subscriptions=subscriptions,
        unsubscribe=frozenset() if body.get("unsubscribe_rooms") is None else frozenset(
            check_room_id(_text(r, f"unsubscribe_rooms[{i}]"))
            for i, r in enumerate(_array(body["unsubscribe_rooms"], "unsubscribe_rooms", MAX_SUBSCRIPTIONS))),
        extensions=parse_extensions(body.get("extensions")),
    )


def range_limit(ranges: tuple[tuple[int, int], ...] | None, total_cap: int) -> int:
    """How many rooms of the ordered list a list's ranges reach (``total_cap`` for the whole list)."""
    if ranges is None:
        return total_cap
    return min(total_cap, max((end for _, end in ranges), default=-1) + 1)


def in_ranges(items: Sequence[str], ranges: tuple[tuple[int, int], ...] | None) -> list[str]:
    """The items at the indices the (inclusive) ranges cover, in list order, each once."""
    if ranges is None:
        return list(items)
    return [item for index, item in enumerate(items) if any(start <= index <= end for start, end in ranges)]
