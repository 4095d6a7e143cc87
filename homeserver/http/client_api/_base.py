"""Shared helpers for client-server servlets: path prefixes and typed request fields.

Servlets parse with these and hand typed values to handlers; every helper
raises ``MatrixError`` with the field's name (``M_BAD_JSON`` for a wrong JSON
type, ``M_MISSING_PARAM`` for a missing field, ``M_INVALID_PARAM`` for a bad
value or query parameter), so no malformed input reaches a handler.
"""

# tests: tests/integration/test_client_fuzz.py

from __future__ import annotations

from typing import Any, Final, overload

from twisted.web.server import Request

from homeserver.events.validation import check_text
from storage.kernel.errors import bad_json, invalid_param, missing_param
from homeserver.http.server import JsonDict

# matrix-nio and older clients still use r0 for some endpoints; both are served.
CLIENT_PREFIX: Final = r"/_matrix/client/(?:r0|v3)"


def client_path(suffix: str) -> str:
    """A route pattern for ``suffix`` under both the r0 and v3 client prefixes."""
    return CLIENT_PREFIX + suffix


def optional_string(body: JsonDict, key: str, *, max_length: int, allow_empty: bool = True) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_json(f"'{key}' must be a string")
    return check_text(value, key, max_length=max_length, allow_empty=allow_empty)


def required_string(body: JsonDict, key: str, *, max_length: int, allow_empty: bool = True) -> str:
    if body.get(key) is None:
        raise missing_param(f"Missing '{key}'")
    value = optional_string(body, key, max_length=max_length, allow_empty=allow_empty)
    assert value is not None
    return value


def optional_bool(body: JsonDict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_json(f"'{key}' must be true or false")
    return value


def query_string(request: Request, name: str) -> str | None:
    """The first value of query parameter ``name``, decoded as UTF-8; None when absent."""
    args: dict[bytes, list[bytes]] = request.args or {}
    values = args.get(name.encode("ascii"))
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_param(f"Query parameter '{name}' is not valid UTF-8") from None


@overload
def query_bool(request: Request, name: str, default: bool) -> bool: ...


@overload
def query_bool(request: Request, name: str, default: None) -> bool | None: ...


def query_bool(request: Request, name: str, default: bool | None) -> bool | None:
    """Query parameter ``name`` as ``true`` or ``false`` (``default`` when absent); anything
    else is ``400 M_INVALID_PARAM``."""
    value = query_string(request, name)
    if value is None:
        return default
    if value not in ("true", "false"):
        raise invalid_param(f"Query parameter '{name}' must be 'true' or 'false', got {value[:20]!r}")
    return value == "true"


def query_int(request: Request, name: str, default: int, *, minimum: int = 0, maximum: int = 10**9) -> int:
    """Query parameter ``name`` as an integer clamped to [minimum, maximum]; ``default`` when absent."""
    text = query_string(request, name)
    if text is None:
        return default
    if not text.isascii() or not text.lstrip("-").isdigit() or len(text) > 12:
        raise invalid_param(f"Query parameter '{name}' must be an integer, got {text[:50]!r}")
    return max(minimum, min(int(text), maximum))


def empty() -> tuple[int, Any]:
    return 200, {}
