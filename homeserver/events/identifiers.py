"""Matrix identifier checks used by the event format and the auth rules.

User IDs follow the spec's *historical* grammar, which servers must still accept over
federation: any localpart without ``:`` or NUL, then a valid server name.
"""

# tests: tests/unit/events/test_event.py

from __future__ import annotations

import re

from homeserver.events.constants import MAX_ID_BYTES

_SERVER_NAME = re.compile(
    r"""
    (?:
        [0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}   # IPv4 literal
      | \[[0-9A-Fa-f:.]{2,45}\]                          # IPv6 literal
      | [A-Za-z0-9.\-]{1,255}                            # DNS name
    )
    (?::[0-9]{1,5})?                                     # optional port
    """,
    re.VERBOSE,
)


def is_valid_server_name(name: str) -> bool:
    """True when ``name`` matches the appendix's server_name grammar."""
    return _SERVER_NAME.fullmatch(name) is not None


def is_valid_user_id(user_id: object) -> bool:
    """True for ``@localpart:server_name`` at most 255 bytes long (historical localparts allowed)."""
    if not isinstance(user_id, str) or not user_id.startswith("@"):
        return False
    if len(user_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return False
    localpart, sep, server = user_id[1:].partition(":")
    if not sep or "\x00" in localpart:
        return False
    return is_valid_server_name(server)


def server_name_of(matrix_id: str) -> str:
    """The domain part of a user ID, room ID (pre-v12) or alias: everything after the first ``:``."""
    return matrix_id.partition(":")[2]
