"""Questions for other servers on behalf of our clients: a remote user's profile, a remote room alias.

``RemoteQueries`` asks the user's or alias's server over ``GET /_matrix/federation/v1/query/profile``
and ``/query/directory`` and keeps each answer in a ``TtlCache`` (``federation_limits.query_cache_ttl``,
five minutes by default, at most ``query_cache_size`` entries; a "not found" for a minute at most).
The remote's 404 becomes 404 ``M_NOT_FOUND``; anything else that goes wrong (unreachable, a timeout,
another status, a malformed answer) becomes 502 ``M_UNKNOWN``, as Synapse answers. Errors are not cached.
"""

# tests: tests/unit/federation/test_queries.py, tests/integration/test_federation_outbound.py

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from homeserver.remote.client import FederationClientError, HttpResponseError, parse_server_name
from homeserver.remote.ttl_cache import TtlCache
from homeserver.events.validation import MAX_AVATAR_URL_LENGTH, MAX_DISPLAYNAME_LENGTH
from storage.kernel.errors import MatrixError, not_found
from storage.stores.profiles import ProfileRow

logger = logging.getLogger(__name__)

NOT_FOUND_TTL_SECONDS: Final = 60.0
MAX_DIRECTORY_SERVERS: Final = 100
_NOT_FOUND: Final = "not found"


def unreachable(what: str) -> MatrixError:
    return MatrixError(502, "M_UNKNOWN", what)


def profile_from_answer(user_id: str, answer: object) -> ProfileRow:
    """The display name and avatar of a ``/query/profile`` answer; other keys and wrong types are dropped."""
    if not isinstance(answer, dict):
        raise unreachable(f"The server of {user_id} sent a profile that is not a JSON object")
    name, avatar = answer.get("displayname"), answer.get("avatar_url")
    return ProfileRow(
        user_id,
        name if isinstance(name, str) and len(name) <= MAX_DISPLAYNAME_LENGTH else None,
        avatar if isinstance(avatar, str) and len(avatar) <= MAX_AVATAR_URL_LENGTH else None,
    )


def directory_from_answer(alias: str, answer: object) -> dict[str, Any]:
    """``{"room_id", "servers"}`` of a ``/query/directory`` answer, the servers checked and capped."""
    room_id = answer.get("room_id") if isinstance(answer, dict) else None
    servers = answer.get("servers") if isinstance(answer, dict) else None
    if not isinstance(room_id, str) or not room_id.startswith("!") or len(room_id) > 255:
        raise unreachable(f"The server of {alias} sent a directory answer without a valid room_id")
    valid = []
    for server in servers if isinstance(servers, list) else []:
        try:
            if isinstance(server, str):
                parse_server_name(server)
                valid.append(server)
        except ValueError:
            continue
    return {"room_id": room_id, "servers": list(dict.fromkeys(valid))[:MAX_DIRECTORY_SERVERS]}


class QueryClient(Protocol):
    """What ``RemoteQueries`` needs of ``FederationClient``."""

    async def get_json(self, destination: str, path: str, query: Mapping[str, Any] | None = None) -> Any: ...


class RemoteQueries:
    def __init__(self, client: QueryClient, *, clock: Callable[[], float], cache_ttl: float,
                 cache_size: int) -> None:
        self._client = client
        self._clock = clock
        self._profiles: TtlCache[str, ProfileRow | str] = TtlCache(ttl=cache_ttl, max_entries=cache_size)
        self._aliases: TtlCache[str, dict[str, Any] | str] = TtlCache(ttl=cache_ttl, max_entries=cache_size)

    async def query_profile(self, user_id: str) -> ProfileRow:
        """The profile of ``user_id`` (on another server), from the cache or its server."""
        cached = self._profiles.get(user_id, self._clock())
        if cached is None:
            cached = await self._ask(self._profiles, user_id, "profile", {"user_id": user_id},
                                     lambda answer: profile_from_answer(user_id, answer))
        if isinstance(cached, str):
            raise not_found("Profile not found")
        return cached

    async def query_directory(self, alias: str) -> dict[str, Any]:
        """``{"room_id", "servers"}`` for ``alias`` (on another server), from the cache or its server."""
        cached = self._aliases.get(alias, self._clock())
        if cached is None:
            cached = await self._ask(self._aliases, alias, "directory", {"room_alias": alias},
                                     lambda answer: directory_from_answer(alias, answer))
        if isinstance(cached, str):
            raise not_found(f"Room alias {alias[:255]} not found")
        return dict(cached)

    async def _ask(self, cache: TtlCache[str, Any], key: str, kind: str, args: dict[str, str],
                   convert: Callable[[Any], Any]) -> Any:
        server = key.split(":", 1)[1] if ":" in key else ""
        try:
            answer = await self._client.get_json(server, f"/_matrix/federation/v1/query/{kind}", query=args)
        except HttpResponseError as e:
            if e.code == 404:
                cache.set(key, _NOT_FOUND, self._clock(), ttl=NOT_FOUND_TTL_SECONDS)
                return _NOT_FOUND
            logger.info("query %s %s at %s: %s", kind, key[:300], server[:300], e)
            raise unreachable(f"{server[:255]} answered the {kind} query with {e.code}") from None
        except FederationClientError as e:
            logger.info("query %s %s at %s: %s", kind, key[:300], server[:300], e)
            raise unreachable(f"Could not reach {server[:255]}: {str(e)[:300]}") from None
        value = convert(answer)
        cache.set(key, value, self._clock())
        return value
