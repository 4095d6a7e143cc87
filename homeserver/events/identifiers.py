"""Matrix identifier grammar: server names, user, room and event IDs, checked once, here.

Every identifier that arrives from outside (a path or query parameter, an X-Matrix origin,
a PDU's sender or room ID) goes through these before it is looked up, stored or used to
reach another server. Common to all: at most 255 bytes of UTF-8, no NUL or other control
character, no lone surrogate. Server names follow the appendix's grammar, with DNS's own
limits on top (labels of 1-63 characters, 255 in all; a port in 1-65535). User IDs follow
the *historical* grammar, which servers must still accept over federation: any localpart
without ``:`` or control characters, then a valid server name. Room and event IDs are opaque
after their sigil; when one carries a ``:domain`` (room IDs before v12, event IDs of v1 and
v2) the domain must be a server name. This module knows nothing of HTTP or storage.
"""

# tests: tests/unit/events/test_identifiers.py, tests/unit/federation/test_client.py

from __future__ import annotations

import functools
import ipaddress
import re
from typing import Final

import attrs

from homeserver.events.constants import MAX_ID_BYTES

_DNS_LABEL: Final = re.compile(r"[A-Za-z0-9-]{1,63}")
MAX_DNS_NAME_LENGTH: Final = 255
# C0 controls, DEL, C1 controls, and UTF-16 surrogates (which are not Unicode scalar values).
_FORBIDDEN: Final = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


@attrs.frozen(slots=True)
class ServerName:
    host: str
    port: int | None

    @property
    def is_ip_literal(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
            return True
        except ValueError:
            return False


def check_hostname(host: str) -> None:
    """Raise ValueError unless ``host`` is an IPv4 literal or a DNS name of the spec's grammar with
    labels of 1-63 letters, digits and hyphens (DNS's limit), at most 255 characters in all."""
    if len(host) > MAX_DNS_NAME_LENGTH:
        raise ValueError(f"host name of {len(host)} characters, over {MAX_DNS_NAME_LENGTH}")
    for label in host.split("."):
        if not _DNS_LABEL.fullmatch(label) or not label.isascii():
            shown = label if len(label) <= 70 else label[:70] + "..."
            raise ValueError(f"host name label {shown!r} ({len(label)} characters) is not 1-63 letters, "
                             "digits and hyphens")


@functools.lru_cache(maxsize=4096)
def parse_server_name(name: str) -> ServerName:
    """Split ``host[:port]`` (IPv6 literals in brackets); raises ValueError unless it is a server
    name by the spec's grammar, with DNS labels of at most 63 characters. Answers for valid
    names are remembered (a bounded cache: the federation client checks the destination of
    every request; a refusal is not cached, so hostile names cannot fill it)."""
    if len(name) > MAX_DNS_NAME_LENGTH:
        raise ValueError(f"server name of {len(name)} characters, over {MAX_DNS_NAME_LENGTH}")
    if name.startswith("["):
        end = name.find("]")
        if end < 0:
            raise ValueError(f"server name {name!r}: unterminated IPv6 literal")
        host, rest = name[1:end], name[end + 1:]
        ipaddress.IPv6Address(host)
    else:
        host, sep, port_text = name.rpartition(":")
        if not sep:
            host, rest = name, ""
        else:
            rest = ":" + port_text
    if not host:
        raise ValueError(f"server name {name!r} has no host")
    if rest:
        port = rest[1:]
        if not rest.startswith(":") or not port.isascii() or not port.isdigit() or len(port) > 5 \
                or not 0 < int(port) < 65536:
            raise ValueError(f"server name {name[:300]!r}: bad port {port[:10]!r}")
    if not name.startswith("["):
        check_hostname(host)
    return ServerName(host, int(rest[1:]) if rest else None)


def is_valid_server_name(name: object) -> bool:
    """True when ``name`` matches the appendix's server_name grammar (with DNS's length limits)."""
    if not isinstance(name, str):
        return False
    try:
        parse_server_name(name)
    except ValueError:
        return False
    return True


def _is_id_text(value: object, sigil: str) -> bool:
    """A string with ``sigil``, something after it, at most 255 bytes, no control characters."""
    return (
        isinstance(value, str)
        and len(value) > 1
        and value.startswith(sigil)
        and len(value) <= MAX_ID_BYTES
        and _FORBIDDEN.search(value) is None
        and len(value.encode("utf-8")) <= MAX_ID_BYTES
    )


def is_valid_user_id(user_id: object) -> bool:
    """True for ``@localpart:server_name`` at most 255 bytes long (historical localparts allowed)."""
    if not isinstance(user_id, str) or not _is_id_text(user_id, "@"):
        return False
    localpart, sep, server = user_id[1:].partition(":")
    return bool(sep) and is_valid_server_name(server)


def _domain_ok(opaque_id: str) -> bool:
    _, sep, domain = opaque_id.partition(":")
    return not sep or is_valid_server_name(domain)


def is_valid_room_id(room_id: object) -> bool:
    """True for ``!opaque:server_name`` (room versions 1-11) or ``!opaque`` (v12's hash form)."""
    return isinstance(room_id, str) and _is_id_text(room_id, "!") and _domain_ok(room_id)


def is_valid_event_id(event_id: object) -> bool:
    """True for ``$opaque:server_name`` (room versions 1 and 2) or ``$hash`` (v3 onwards)."""
    return isinstance(event_id, str) and _is_id_text(event_id, "$") and _domain_ok(event_id)


def is_valid_room_alias(alias: object) -> bool:
    """True for ``#opaque:server_name``."""
    return isinstance(alias, str) and _is_id_text(alias, "#") and ":" in alias and _domain_ok(alias)


_KEY_ID: Final = re.compile(r"[A-Za-z0-9_]{1,64}:[A-Za-z0-9_]{1,128}")


def is_valid_key_id(key_id: object) -> bool:
    """True for a signing key ID, ``algorithm:identifier`` with identifiers of ``[a-zA-Z0-9_]``."""
    return isinstance(key_id, str) and _KEY_ID.fullmatch(key_id) is not None


def is_safe_text(value: str) -> bool:
    """No NUL, control character or lone surrogate: text PostgreSQL and logs can take as it is."""
    return _FORBIDDEN.search(value) is None


def server_name_of(matrix_id: str) -> str:
    """The domain part of a user ID, room ID (pre-v12) or alias: everything after the first ``:``."""
    return matrix_id.partition(":")[2]
