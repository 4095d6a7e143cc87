"""Filters: storing the /sync filters clients upload, and giving them back by ID.

``validate_filter`` checks the shape of a filter (the spec's Filter, RoomFilter,
EventFilter and RoomEventFilter objects: each known field of the right JSON
type, unknown fields ignored) and names the first bad field. What a filter
selects is /sync's business; this module only stores it.
"""

# tests: tests/unit/handlers/test_filters.py, tests/integration/test_client_accounts.py

from __future__ import annotations

import json
from typing import Any, Final

from homeserver.handlers.accounts.auth import Requester
from homeserver.events.validation import dump_json_object
from storage.kernel.errors import bad_json, forbidden, not_found
from storage.stores.filters import FilterStore

_MAX_FILTER_ID_DIGITS: Final = 18

_STRING_LISTS: Final = ("types", "not_types", "senders", "not_senders", "rooms", "not_rooms")
_BOOLEANS: Final = (
    "lazy_load_members",
    "include_redundant_members",
    "contains_url",
    "unread_thread_notifications",
    "include_leave",
)


def _check_event_filter(value: object, path: str) -> None:
    """EventFilter / RoomEventFilter / StateFilter: the fields they share are checked alike."""
    if not isinstance(value, dict):
        raise bad_json(f"{path} must be an object")
    for key in _STRING_LISTS:
        if key in value:
            items = value[key]
            if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                raise bad_json(f"{path}.{key} must be a list of strings")
    for key in _BOOLEANS:
        if key in value and not isinstance(value[key], bool):
            raise bad_json(f"{path}.{key} must be true or false")
    if "limit" in value:
        limit = value["limit"]
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise bad_json(f"{path}.limit must be a non-negative integer")


def validate_filter(value: object) -> dict[str, Any]:
    """The filter unchanged when its shape is right; 400 ``M_BAD_JSON`` naming the bad field otherwise."""
    if not isinstance(value, dict):
        raise bad_json("The filter must be a JSON object")
    if "event_fields" in value:
        fields = value["event_fields"]
        if not isinstance(fields, list) or not all(isinstance(item, str) for item in fields):
            raise bad_json("event_fields must be a list of strings")
    if "event_format" in value and value["event_format"] not in ("client", "federation"):
        raise bad_json("event_format must be 'client' or 'federation'")
    for key in ("presence", "account_data"):
        if key in value:
            _check_event_filter(value[key], key)
    if "room" in value:
        room = value["room"]
        _check_event_filter(room, "room")
        for key in ("state", "timeline", "ephemeral", "account_data"):
            if key in room:
                _check_event_filter(room[key], f"room.{key}")
    return value


def parse_filter_id(text: str) -> int | None:
    """The numeric filter ID, or None when ``text`` cannot be one of ours."""
    if not text.isascii() or not text.isdigit() or len(text) > _MAX_FILTER_ID_DIGITS:
        return None
    return int(text)


class FilterHandler:
    def __init__(self, store: FilterStore) -> None:
        self._store = store

    async def add_filter(self, requester: Requester, user_id: str, filter_json: object) -> str:
        if requester.user_id != user_id:
            raise forbidden("Cannot create filters for other users")
        text = dump_json_object(validate_filter(filter_json))
        return str(await self._store.add_filter(user_id, text))

    async def get_filter(self, requester: Requester, user_id: str, filter_id: str) -> Any:
        if requester.user_id != user_id:
            raise forbidden("Cannot get filters of other users")
        number = parse_filter_id(filter_id)
        text = None if number is None else await self._store.get_filter(user_id, number)
        if text is None:
            raise not_found("No such filter")
        return json.loads(text)
