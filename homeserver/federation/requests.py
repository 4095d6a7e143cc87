"""Type checks for what another server sends: federation query parameters and request bodies.

Each function takes the parsed query (``{bytes: [bytes]}``) or the decoded JSON body and either
returns the typed values a handler needs or raises ``400``, naming the field: ``M_MISSING_PARAM``
or ``M_INVALID_PARAM`` for query parameters, ``M_BAD_JSON`` for bodies (the spec's "Common
error codes"; Synapse answers the same). Identifiers go through the grammar of
``homeserver/events/identifiers.py``, so no malformed ID reaches a lookup or a query. Nothing
here does I/O or knows about rooms.
"""

# tests: tests/unit/federation/test_requests.py, tests/integration/test_federation_input.py

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from homeserver.events.constants import MAX_ID_BYTES, MAX_RECEIVED_PREV_EVENTS
from homeserver.events.identifiers import is_safe_text
from storage.kernel.errors import bad_json, invalid_param, missing_param

QueryArgs = Mapping[bytes, list[bytes]]
Check = Callable[[object], bool]

MAX_QUERY_VALUES: Final = 50
"""At most this many values of one repeated query parameter (``v``, ``ver``)."""
MAX_MISSING_EVENTS_IDS: Final = 1000
"""At most this many IDs in ``earliest_events`` (a room's forward extremities, usually a few)."""


def query_values(args: QueryArgs, name: str, *, max_length: int = MAX_ID_BYTES) -> list[str]:
    """Every value of query parameter ``name``: UTF-8 text without NUL or control characters."""
    values = args.get(name.encode("ascii"), [])
    if len(values) > MAX_QUERY_VALUES:
        raise invalid_param(f"query parameter '{name}' is repeated {len(values)} times, at most {MAX_QUERY_VALUES}")
    out = []
    for raw in values:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid_param(f"query parameter '{name}' is not valid UTF-8") from None
        if len(text) > max_length or not is_safe_text(text):
            raise invalid_param(f"query parameter '{name}' is longer than {max_length} or holds control characters")
        out.append(text)
    return out


def query_one(args: QueryArgs, name: str, check: Check | None = None, what: str = "value") -> str | None:
    """The first value of ``name`` (None when absent), which must pass ``check``."""
    values = query_values(args, name)
    if not values:
        return None
    if check is not None and not check(values[0]):
        raise invalid_param(f"query parameter '{name}': {values[0][:100]!r} is not a valid {what}")
    return values[0]


def query_bool(args: QueryArgs, name: str) -> bool | None:
    """``true`` or ``false`` (None when absent); anything else is 400 ``M_INVALID_PARAM``."""
    value = query_one(args, name)
    if value is None:
        return None
    if value not in ("true", "false"):
        raise invalid_param(f"query parameter '{name}' must be 'true' or 'false', got {value[:20]!r}")
    return value == "true"


def query_required(args: QueryArgs, name: str, check: Check | None = None, what: str = "value") -> str:
    value = query_one(args, name, check, what)
    if value is None:
        raise missing_param(f"missing the '{name}' query parameter")
    return value


def query_list(args: QueryArgs, name: str, check: Check, what: str) -> list[str]:
    """Every value of a repeated parameter, each passing ``check``."""
    values = query_values(args, name)
    for value in values:
        if not check(value):
            raise invalid_param(f"query parameter '{name}': {value[:100]!r} is not a valid {what}")
    return values


def query_int(args: QueryArgs, name: str, *, default: int, minimum: int, maximum: int) -> int:
    """A non-negative decimal integer parameter, clamped to ``[minimum, maximum]``."""
    text = query_one(args, name)
    if text is None:
        return default
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise invalid_param(f"query parameter '{name}' must be a non-negative integer, got {text[:40]!r}")
    return max(minimum, min(int(text), maximum))


def body_object(body: Any, what: str = "request body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_json(f"{what} must be a JSON object, got {type(body).__name__}")
    return body


def body_int(body: Mapping[str, Any], key: str, *, default: int) -> int:
    """An optional integer field (booleans are not integers)."""
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_json(f"'{key}' must be an integer, got {type(value).__name__}")
    return value


def body_id_list(body: Mapping[str, Any], key: str, check: Check, what: str, *, max_count: int,
                 required: bool = True) -> list[str]:
    """A list of identifiers passing ``check``, at most ``max_count`` of them."""
    if key not in body:
        if required:
            raise bad_json(f"missing '{key}'")
        return []
    value = body[key]
    if not isinstance(value, list):
        raise bad_json(f"'{key}' must be a list of {what}s, got {type(value).__name__}")
    if len(value) > max_count:
        raise bad_json(f"'{key}' holds {len(value)} entries, at most {max_count}")
    for item in value:
        if not check(item):
            raise bad_json(f"'{key}' must hold {what}s, got {str(item)[:100]!r}")
    return list(value)


def missing_events_body(body: Any, check_event_id: Check) -> dict[str, Any]:
    """``POST /get_missing_events`` with every field typed: ``earliest_events`` and ``latest_events``
    lists of event IDs, ``limit`` and ``min_depth`` integers (defaults 10 and 0, as the spec says)."""
    obj = body_object(body)
    return {
        "earliest_events": body_id_list(obj, "earliest_events", check_event_id, "event ID",
                                        max_count=MAX_MISSING_EVENTS_IDS),
        "latest_events": body_id_list(obj, "latest_events", check_event_id, "event ID",
                                      max_count=MAX_RECEIVED_PREV_EVENTS),
        "limit": body_int(obj, "limit", default=10),
        "min_depth": body_int(obj, "min_depth", default=0),
    }


def invite_body(body: Any) -> dict[str, Any]:
    """``PUT /v2/invite``: an ``event`` object, a ``room_version`` string, ``invite_room_state``
    (when present) a list of objects."""
    obj = body_object(body)
    if not isinstance(obj.get("event"), dict):
        raise bad_json("'event' must be an object")
    if not isinstance(obj.get("room_version"), str):
        raise bad_json("'room_version' must be a string")
    state = obj.get("invite_room_state", [])
    if not isinstance(state, list) or not all(isinstance(e, dict) for e in state):
        raise bad_json("'invite_room_state' must be a list of objects")
    return obj
