"""Checks on client-supplied identifiers and text before they reach storage.

Pure functions that raise ``MatrixError``: the user ID localpart grammar for new
accounts, local user IDs, room IDs, and "can PostgreSQL store this text"
(no NUL, no lone surrogates, bounded length). Anything a client sends goes
through one of these before it is written or used as a key.
"""

# tests: tests/unit/handlers/test_validation.py

from __future__ import annotations

import json
import re
from typing import Any, Final

from homeserver.events.constants import MAX_ID_BYTES
from homeserver.events.identifiers import is_valid_room_id, is_valid_user_id
from storage.kernel.errors import MatrixError, bad_json, invalid_param

# The localpart grammar for new user IDs (spec appendix, "User Identifiers").
_LOCALPART_RE: Final = re.compile(r"[a-z0-9._=\-/+]+")
MAX_PASSWORD_LENGTH: Final = 512
MAX_DEVICE_ID_LENGTH: Final = 255
MAX_DEVICE_DISPLAY_NAME_LENGTH: Final = 100
MAX_DISPLAYNAME_LENGTH: Final = 256
MAX_AVATAR_URL_LENGTH: Final = 1000
MAX_TYPE_LENGTH: Final = 255


def is_storable_text(value: str) -> bool:
    """True when PostgreSQL can store ``value`` as TEXT: no NUL and valid UTF-8 (no lone surrogates)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(value: str, name: str, *, max_length: int, allow_empty: bool = True) -> str:
    """``value`` unchanged, or 400 ``M_INVALID_PARAM`` naming ``name`` and the problem."""
    if len(value) > max_length:
        raise invalid_param(f"{name} is too long (at most {max_length} characters, got {len(value)})")
    if not allow_empty and not value:
        raise invalid_param(f"{name} must not be empty")
    if not is_storable_text(value):
        raise invalid_param(f"{name} contains a NUL character or invalid Unicode")
    return value


def check_localpart(localpart: str, server_name: str) -> str:
    """The localpart of a new account, or 400 ``M_INVALID_USERNAME``."""
    if not localpart:
        raise MatrixError(400, "M_INVALID_USERNAME", "The username must not be empty")
    if _LOCALPART_RE.fullmatch(localpart) is None:
        raise MatrixError(
            400, "M_INVALID_USERNAME", "The username may only contain a-z, 0-9 and the characters ._=-/+"
        )
    if len(f"@{localpart}:{server_name}".encode("utf-8")) > MAX_ID_BYTES:
        raise MatrixError(400, "M_INVALID_USERNAME", f"The user ID would be longer than {MAX_ID_BYTES} bytes")
    return localpart


def check_user_id(user_id: str) -> str:
    """A syntactically valid user ID (any server), or 400 ``M_INVALID_PARAM``."""
    if not is_valid_user_id(user_id) or not is_storable_text(user_id):
        raise invalid_param(f"{user_id[:100]!r} is not a valid user ID")
    return user_id


def is_local_user_id(user_id: str, server_name: str) -> bool:
    return user_id.startswith("@") and user_id.partition(":")[2] == server_name


def check_room_id(room_id: str) -> str:
    """A room ID (``!opaque:server``, or ``!hash`` from room version 12), or 400 ``M_INVALID_PARAM``."""
    if not is_valid_room_id(room_id):
        raise invalid_param(f"{room_id[:100]!r} is not a valid room ID")
    return room_id


def check_event_type(data_type: str) -> str:
    """An event or account data type: non-empty storable text of at most 255 characters."""
    return check_text(data_type, "type", max_length=MAX_TYPE_LENGTH, allow_empty=False)


def dump_json_object(content: dict[str, Any]) -> str:
    """``content`` as JSON text for storage; 400 ``M_BAD_JSON`` when it cannot round-trip.

    JSON from clients may hold lone surrogates or numbers too large for a float,
    which parse but cannot be stored or sent back as valid JSON.
    """
    try:
        text = json.dumps(content, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        text.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        raise bad_json("Content contains invalid Unicode or a number JSON cannot represent") from None
    # json.dumps escapes control characters, so the text holds no raw NUL for PostgreSQL to refuse.
    return text
