"""Server ACLs (``m.room.server_acl``): who may take part in a room over federation.

``server_allowed`` is the pure matcher of the client-server "Server Access Control
Lists" module: no ACL event allows everyone; else an IP literal is denied unless
``allow_ip_literals``, then ``deny`` wins over ``allow``, and a server matching
neither is denied. Globs (``*`` any run of characters, ``?`` one) match the server
name without its port, case-insensitively (as Synapse). Malformed content is read
as Synapse reads it: a non-list ``allow``/``deny`` is empty, non-string entries
are skipped, a non-boolean ``allow_ip_literals`` is true.

``ServerAcls`` applies it to a room's current ACL: ``check`` raises 403
``M_FORBIDDEN`` (the inbound endpoints that name a room), ``allows`` answers
(``/send``'s PDUs and EDUs, which are dropped rather than refused), ``filter``
keeps the destinations a room's events may go to.
"""

# tests: tests/unit/federation/test_acl.py tests/integration/test_federation_rules.py

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.events.identifiers import is_valid_room_id
from storage.kernel.errors import forbidden

ACL_KEY = (C.SERVER_ACL, "")


def host_of(server_name: str) -> str:
    """The server name without its port: ``[::1]:8448`` -> ``[::1]``, ``a.b:80`` -> ``a.b``."""
    if server_name.startswith("["):
        end = server_name.find("]")
        return server_name if end < 0 else server_name[: end + 1]
    return server_name.rsplit(":", 1)[0] if ":" in server_name else server_name


def is_ip_literal(host: str) -> bool:
    """An IPv4 address, or an IPv6 address in brackets (the server-name grammar's literals)."""
    if host.startswith("[") and host.endswith("]"):
        candidate = host[1:-1]
    else:
        candidate = host
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _glob(pattern: str) -> re.Pattern[str]:
    parts = [".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern]
    return re.compile("".join(parts), re.IGNORECASE | re.DOTALL)


def _entries(value: object) -> list[str]:
    if not isinstance(value, (list, tuple)):
        return []
    return [entry for entry in value if isinstance(entry, str)]


def server_allowed(server_name: str, content: Mapping[str, Any] | None) -> bool:
    """Whether the ACL ``content`` (None: the room has no ACL) lets ``server_name`` in."""
    if content is None:
        return True
    host = host_of(server_name)
    allow_ip_literals = content.get("allow_ip_literals", True)
    if allow_ip_literals is False and is_ip_literal(host):
        return False
    if any(_glob(pattern).fullmatch(host) for pattern in _entries(content.get("deny"))):
        return False
    return any(_glob(pattern).fullmatch(host) for pattern in _entries(content.get("allow")))


def edu_rooms(edu_type: str, content: object) -> list[str]:
    """The rooms an EDU is about (``m.typing``: one, ``m.receipt``: its keys); others: none."""
    if not isinstance(content, Mapping):
        return []
    if edu_type == "m.typing":
        room_id = content.get("room_id")
        return [room_id] if isinstance(room_id, str) else []
    if edu_type == "m.receipt":
        return [room_id for room_id in content if isinstance(room_id, str)]
    return []


class AclSource(Protocol):
    """The current ACL event ID of a room, or of several (``EventsStore.get_current_state_for_keys``
    and ``get_current_state_for_keys_in_rooms``)."""

    async def get_current_state_for_keys(self, room_id: str, keys: Any) -> Mapping[tuple[str, str], str]: ...

    async def get_current_state_for_keys_in_rooms(
        self, room_ids: Any, keys: Any
    ) -> Mapping[str, Mapping[tuple[str, str], str]]: ...


class EventSource(Protocol):
    async def get_event(self, event_id: str) -> FrozenEvent | None: ...


class ServerAcls:
    def __init__(self, *, store: AclSource, loader: EventSource) -> None:
        self._store = store
        self._loader = loader

    async def acl_content(self, room_id: str) -> Mapping[str, Any] | None:
        """The content of the room's current ``m.room.server_acl``, or None when it has none."""
        if not is_valid_room_id(room_id):
            return None  # not a room ID (an EDU's content may name anything): no room, no ACL
        ids = await self._store.get_current_state_for_keys(room_id, [ACL_KEY])
        event_id = ids.get(ACL_KEY)
        if event_id is None:
            return None
        event = await self._loader.get_event(event_id)
        return None if event is None else event.content

    async def denied_rooms(self, origin: str, room_ids: Iterable[str]) -> set[str]:
        """Those of ``room_ids`` (valid room IDs) whose ACL denies ``origin``; one read for all."""
        rooms = [room_id for room_id in room_ids if is_valid_room_id(room_id)]
        ids = await self._store.get_current_state_for_keys_in_rooms(rooms, [ACL_KEY])
        denied: set[str] = set()
        for room_id, state in ids.items():
            event_id = state.get(ACL_KEY)
            event = None if event_id is None else await self._loader.get_event(event_id)
            if event is not None and not server_allowed(origin, event.content):
                denied.add(room_id)
        return denied

    async def allows(self, origin: str, room_id: str) -> bool:
        return server_allowed(origin, await self.acl_content(room_id))

    async def check(self, origin: str, room_id: str) -> None:
        """403 ``M_FORBIDDEN`` when the room's ACL denies ``origin``."""
        if not await self.allows(origin, room_id):
            raise forbidden(f"Server {origin[:255]} is banned from room {room_id[:255]} by its server ACL")

    async def check_event(self, origin: str, event_id: str) -> None:
        """``check`` for the room of an event (``GET /event``); an unknown event is left to the handler."""
        event = await self._loader.get_event(event_id)
        if event is not None:
            await self.check(origin, event.room_id)

    async def filter_edu(self, origin: str, edu_type: str, content: object) -> object | None:
        """The EDU's content without the rooms whose ACL denies ``origin`` (None: nothing left)."""
        rooms = edu_rooms(edu_type, content)
        denied = {room_id for room_id in rooms if not await self.allows(origin, room_id)}
        if not denied:
            return content
        if edu_type == "m.receipt" and isinstance(content, Mapping):
            kept = {room_id: value for room_id, value in content.items() if room_id not in denied}
            return kept or None
        return None

    async def allowed_servers(self, room_id: str, servers: Iterable[str]) -> set[str]:
        """Those of ``servers`` the room's current ACL lets take part (receive its events and EDUs)."""
        servers = set(servers)
        if not servers:
            return servers
        content = await self.acl_content(room_id)
        return servers if content is None else set(self.filter(servers, content))

    def filter(self, servers: Iterable[str], content: Mapping[str, Any] | None) -> frozenset[str]:
        """The ``servers`` an ACL with ``content`` lets receive the room's events."""
        return frozenset(s for s in servers if server_allowed(s, content))

