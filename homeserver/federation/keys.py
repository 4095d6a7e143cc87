"""Server signing keys: the key server we answer with, and the keyring we verify with.

``server_key_response`` builds our signed ``/_matrix/key/v2/server`` body.
``parse_key_response`` checks another server's body (its name, its self-signature,
a notary's signature when asked) and turns it into ``ServerKey``s whose validity is
capped at seven days after fetching. ``Keyring`` caches keys until they expire,
fetches from the server itself first and from notaries second, and keeps the
verified responses in a ``KeyStore`` so that a restart need not refetch. Time is an injected
``clock_ms``; fetching is injected too, so the keyring needs no network in tests.

``Notary`` answers key queries about other servers (``POST /_matrix/key/v2/query`` and
``GET /_matrix/key/v2/query/{serverName}[/{keyId}]``): at most ``max_servers`` names per
query, fetched concurrently (at most ``concurrency`` at once) for whichever keys are not
cached valid until the query's ``minimum_valid_until_ts``, and answered within ``timeout``
seconds from whatever is cached by then. ``parse_key_query`` is the pure part.
"""

# tests: tests/unit/federation/test_keys.py

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, Protocol

import attrs
from nacl.exceptions import CryptoError
from signedjson.key import decode_verify_key_bytes, encode_verify_key_base64, get_verify_key
from signedjson.sign import SignatureVerifyException, sign_json, verify_signed_json
from signedjson.types import SigningKey, VerifyKey
from unpaddedbase64 import decode_base64

from twisted.internet.defer import CancelledError, Deferred

from homeserver.events import ServerKey
from homeserver.remote.client import FederationClientError, parse_server_name, within
from storage.kernel.concurrency import map_concurrently
from storage.kernel.errors import MatrixError, bad_json

logger = logging.getLogger(__name__)

KEY_VALIDITY_MS: Final = 24 * 3600 * 1000          # what we advertise for our own key
MAX_CACHE_MS: Final = 7 * 24 * 3600 * 1000         # the cap the spec puts on others' keys
MIN_REFETCH_INTERVAL_MS: Final = 60 * 1000         # do not hammer a server that lacks a key


class KeyFetchError(Exception):
    """A key response that is malformed, unsigned, or for another server."""


def key_id_of(signing_key: SigningKey) -> str:
    return f"{signing_key.alg}:{signing_key.version}"


def server_key_response(server_name: str, signing_key: SigningKey, now_ms: int) -> dict[str, Any]:
    """Our ``GET /_matrix/key/v2/server`` body, signed with our key."""
    body: dict[str, Any] = {
        "server_name": server_name,
        "valid_until_ts": now_ms + KEY_VALIDITY_MS,
        "verify_keys": {key_id_of(signing_key): {"key": encode_verify_key_base64(get_verify_key(signing_key))}},
        "old_verify_keys": {},
    }
    signed: dict[str, Any] = sign_json(body, server_name, signing_key)
    return signed


def parse_key_response(
    expected_server: str, body: object, fetched_at_ms: int
) -> dict[str, ServerKey]:
    """Validate a key response for ``expected_server``; return its keys by key ID.

    Current keys are valid until the lesser of ``valid_until_ts`` and seven days
    after fetching; old keys until their ``expired_ts``.
    """
    if not isinstance(body, Mapping):
        raise KeyFetchError(f"key response for {expected_server} is not a JSON object")
    if body.get("server_name") != expected_server:
        raise KeyFetchError(
            f"key response names server {str(body.get('server_name'))[:100]!r}, expected {expected_server!r}"
        )
    valid_until = body.get("valid_until_ts")
    if not isinstance(valid_until, int) or isinstance(valid_until, bool):
        raise KeyFetchError(f"key response for {expected_server} has no integer valid_until_ts")
    keys: dict[str, ServerKey] = {}
    verify_keys = body.get("verify_keys")
    if not isinstance(verify_keys, Mapping) or not verify_keys:
        raise KeyFetchError(f"key response for {expected_server} has no verify_keys")
    cap = min(valid_until, fetched_at_ms + MAX_CACHE_MS)
    for key_id, entry in verify_keys.items():
        key = _decode_key(expected_server, key_id, entry)
        if key is not None:
            keys[key_id] = ServerKey(key, cap)
    signatures = body.get("signatures")
    own = signatures.get(expected_server) if isinstance(signatures, Mapping) else None
    if not isinstance(own, Mapping) or not any(k in keys for k in own):
        raise KeyFetchError(f"key response for {expected_server} is not signed by any of its own keys")
    for key_id in own:
        if key_id in keys:
            try:
                verify_signed_json(dict(body), expected_server, keys[key_id].verify_key)
            except SignatureVerifyException as e:
                raise KeyFetchError(f"self-signature of {expected_server} with {key_id} does not verify: {e}") from None
    old = body.get("old_verify_keys")
    if isinstance(old, Mapping):
        for key_id, entry in old.items():
            key = _decode_key(expected_server, key_id, entry)
            expired = entry.get("expired_ts") if isinstance(entry, Mapping) else None
            if key is not None and isinstance(expired, int) and key_id not in keys:
                keys[key_id] = ServerKey(key, expired)
    return keys


def _decode_key(server: str, key_id: object, entry: object) -> VerifyKey | None:
    if not isinstance(key_id, str) or not key_id.startswith("ed25519:") or not isinstance(entry, Mapping):
        return None
    raw = entry.get("key")
    if not isinstance(raw, str):
        raise KeyFetchError(f"key {key_id} of {server} has no base64 'key'")
    try:
        return decode_verify_key_bytes(key_id, decode_base64(raw))
    except (CryptoError, ValueError, TypeError) as e:
        raise KeyFetchError(f"key {key_id} of {server} is not a valid ed25519 key: {e}") from None


def check_notary_signature(body: Mapping[str, Any], notary: str, notary_keys: Mapping[str, ServerKey]) -> None:
    """Raise ``KeyFetchError`` unless ``notary`` signed ``body`` with one of ``notary_keys``."""
    sigs = body.get("signatures")
    theirs = sigs.get(notary) if isinstance(sigs, Mapping) else None
    if not isinstance(theirs, Mapping):
        raise KeyFetchError(f"notary response is not signed by {notary}")
    for key_id in theirs:
        if key_id in notary_keys:
            try:
                verify_signed_json(dict(body), notary, notary_keys[key_id].verify_key)
                return
            except SignatureVerifyException as e:
                raise KeyFetchError(f"notary signature of {notary} does not verify: {e}") from None
    raise KeyFetchError(f"notary response is signed by {notary} with no key we know")


class StoredKeys(Protocol):
    @property
    def response(self) -> dict[str, Any]: ...

    @property
    def fetched_ts(self) -> int: ...


class KeyStore(Protocol):
    """Where verified key responses are kept (``storage.stores.federation.FederationStore``)."""

    async def get_key_response(self, server_name: str) -> StoredKeys | None: ...

    async def store_key_response(self, server_name: str, response: dict[str, Any], fetched_ts: int) -> None: ...


DirectFetch = Callable[[str], Awaitable[Any]]
"""``server -> body of its GET /_matrix/key/v2/server``."""
NotaryFetch = Callable[[str, str, Iterable[str]], Awaitable[Any]]
"""``(notary, server, key_ids) -> body of the notary's POST /_matrix/key/v2/query``."""


@attrs.define
class _Entry:
    keys: dict[str, ServerKey]
    response: dict[str, Any] | None
    last_fetch_ms: int
    # Key ID -> when a fetch last looked for it: a missing key is looked for at most once a
    # minute, but a key ID not seen before (a server that rotated its key) is fetched at once.
    tried: dict[str, int] = attrs.Factory(dict)


class Keyring:
    """Verify keys of other servers, cached until they expire (at most seven days)."""

    def __init__(
        self,
        *,
        server_name: str,
        signing_key: SigningKey,
        clock_ms: Callable[[], int],
        fetch_direct: DirectFetch,
        fetch_notary: NotaryFetch,
        notaries: Iterable[str] = (),
        key_store: KeyStore | None = None,
        concurrency: int = 10,
    ) -> None:
        self._concurrency = concurrency
        self._key_store = key_store
        self._server_name = server_name
        self._signing_key = signing_key
        self._clock_ms = clock_ms
        self._fetch_direct = fetch_direct
        self._fetch_notary = fetch_notary
        self._notaries = tuple(notaries)
        self._cache: dict[str, _Entry] = {}

    def _own(self) -> dict[str, ServerKey]:
        now = self._clock_ms()
        return {key_id_of(self._signing_key): ServerKey(get_verify_key(self._signing_key), now + KEY_VALIDITY_MS)}

    def cached_response(self, server: str) -> dict[str, Any] | None:
        """The last verified key response of ``server``, for answering key queries as a notary."""
        entry = self._cache.get(server)
        return entry.response if entry is not None else None

    async def get_verify_key(self, server: str, key_id: str) -> VerifyKey | None:
        """``server``'s key ``key_id`` if it is valid now (fetching it when needed)."""
        keys = await self.get_server_keys(server, {key_id}, at_ms=self._clock_ms())
        key = keys.get(key_id)
        return key.verify_key if key is not None else None

    async def get_server_keys(self, server: str, key_ids: Iterable[str], *, at_ms: int) -> dict[str, ServerKey]:
        """Keys of ``server`` valid at ``at_ms``, fetching unless all of ``key_ids`` are cached and valid."""
        if server == self._server_name:
            return self._own()
        wanted = set(key_ids)
        entry = self._cache.get(server)
        now = self._clock_ms()
        if entry is None or not _has_valid(entry.keys, wanted, at_ms, now):
            if entry is None or self._worth_fetching(entry, wanted, at_ms, now):
                entry = await self._fetch(server, wanted, entry)
        return {k: v for k, v in entry.keys.items() if v.valid_until_ts >= at_ms}

    @staticmethod
    def _worth_fetching(entry: _Entry, wanted: set[str], at_ms: int, now: int) -> bool:
        """Some wanted key is missing and was not looked for in the last minute."""
        for key_id in wanted:
            if _has_valid(entry.keys, {key_id}, at_ms, now):
                continue
            tried = entry.tried.get(key_id)
            if tried is None or now - tried >= MIN_REFETCH_INTERVAL_MS:
                return True
        return False

    def cached_keyring(self, wanted: Mapping[str, Iterable[str]], *, at_ms: int) -> dict[str, dict[str, ServerKey]] | None:
        """What ``keyring_for`` answers when it needs to fetch nothing (every server's wanted keys
        are cached and valid), else None."""
        now = self._clock_ms()
        found: dict[str, dict[str, ServerKey]] = {}
        for server, key_ids in wanted.items():
            if server == self._server_name:
                found[server] = self._own()
                continue
            entry = self._cache.get(server)
            if entry is None or not _has_valid(entry.keys, set(key_ids), at_ms, now):
                return None
            found[server] = {k: v for k, v in entry.keys.items() if v.valid_until_ts >= at_ms}
        return found

    async def keyring_for(self, wanted: Mapping[str, Iterable[str]], *, at_ms: int) -> dict[str, dict[str, ServerKey]]:
        """A ``KeyRing`` (server -> key ID -> key) for verifying an event signed at ``at_ms``;
        the servers are asked concurrently, ``concurrency`` at a time."""

        async def one(item: tuple[str, Iterable[str]]) -> dict[str, ServerKey]:
            server, key_ids = item
            try:
                return await self.get_server_keys(server, key_ids, at_ms=at_ms)
            except CancelledError:
                raise
            except Exception as e:  # the remote is down or lies: the signature will not verify
                logger.warning("could not fetch keys of %s: %s", server, e)
                return {}

        items = list(wanted.items())
        found = await map_concurrently(one, items, limit=self._concurrency)
        return {server: keys for (server, _), keys in zip(items, found)}

    async def _fetch(self, server: str, wanted: set[str], previous: _Entry | None) -> _Entry:
        now = self._clock_ms()
        if previous is None and self._key_store is not None:
            # First use since start: the response we verified before a restart may do.
            stored = await self._key_store.get_key_response(server)
            if stored is not None:
                try:
                    keys = parse_key_response(server, stored.response, stored.fetched_ts)
                except KeyFetchError:
                    keys = {}
                if _has_valid(keys, wanted, now, now):
                    entry = _Entry(keys, stored.response, stored.fetched_ts)
                    self._cache[server] = entry
                    return entry
        keys = dict(previous.keys) if previous is not None else {}
        response: dict[str, Any] | None = previous.response if previous is not None else None
        errors: list[str] = []
        try:
            body = await self._fetch_direct(server)
            keys.update(parse_key_response(server, body, now))
            response = body
            if self._key_store is not None:
                await self._key_store.store_key_response(server, body, now)
        except CancelledError:
            raise
        except Exception as e:
            errors.append(f"direct: {e}")
        if not wanted <= set(keys):
            for notary in self._notaries:
                try:
                    notary_keys = await self.get_server_keys(notary, (), at_ms=now)
                    reply = await self._fetch_notary(notary, server, wanted)
                    for item in reply.get("server_keys", []) if isinstance(reply, Mapping) else []:
                        check_notary_signature(item, notary, notary_keys)
                        keys.update(parse_key_response(server, item, now))
                        response = item
                except CancelledError:
                    raise
                except Exception as e:
                    errors.append(f"notary {notary}: {e}")
                if wanted <= set(keys):
                    break
        if errors:
            logger.warning("fetching keys of %s: %s", server, "; ".join(errors))
        tried = dict(previous.tried) if previous is not None else {}
        tried.update((key_id, now) for key_id in wanted)
        entry = _Entry(keys, response, now, tried)
        self._cache[server] = entry
        return entry


def _has_valid(keys: Mapping[str, ServerKey], wanted: set[str], at_ms: int, now_ms: int) -> bool:
    if not keys:
        return False
    if not wanted:
        return any(k.valid_until_ts >= now_ms for k in keys.values())
    return all(k in keys and keys[k].valid_until_ts >= max(at_ms, now_ms) for k in wanted)


# --- notary -------------------------------------------------------------------------------


@attrs.frozen
class KeyQuery:
    """One server named in a key query: the key IDs wanted (none: all) and how long they must stay valid."""

    server: str
    key_ids: frozenset[str]
    minimum_valid_until_ts: int


def _timestamp(field: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise bad_json(f"'{field}' must be a non-negative integer timestamp in milliseconds")
    return value


def parse_key_query(body: object, now_ms: int, *, max_servers: int) -> list[KeyQuery]:
    """The servers a ``POST /_matrix/key/v2/query`` body asks about, in its order.

    400 ``M_BAD_JSON`` for a wrong shape or type, 400 ``M_TOO_LARGE`` for more than
    ``max_servers`` names. A name that is not a valid server name is left out: nothing
    can be fetched for it, and the answer simply holds no keys for it. A key's
    ``minimum_valid_until_ts`` defaults to now; a server's is the latest of its keys'.
    """
    if not isinstance(body, Mapping):
        raise bad_json("the body must be a JSON object")
    wanted = body.get("server_keys")
    if not isinstance(wanted, Mapping):
        raise bad_json("'server_keys' must be an object of server name -> key ID -> criteria")
    if len(wanted) > max_servers:
        raise MatrixError(400, "M_TOO_LARGE", f"a key query may name at most {max_servers} servers, "
                                              f"this one names {len(wanted)}")
    queries = []
    for server, key_ids in wanted.items():
        if not isinstance(key_ids, Mapping):
            raise bad_json(f"'server_keys.{str(server)[:100]}' must be an object of key ID -> criteria")
        minimum = now_ms
        for key_id, criteria in key_ids.items():
            if not isinstance(criteria, Mapping):
                raise bad_json(f"'server_keys.{str(server)[:100]}.{str(key_id)[:100]}' must be an object")
            if criteria.get("minimum_valid_until_ts") is not None:
                minimum = max(minimum, _timestamp("minimum_valid_until_ts", criteria["minimum_valid_until_ts"]))
        try:
            parse_server_name(server)
        except ValueError as e:
            logger.debug("key query names %r, not a server name: %s", server[:300], e)
            continue
        queries.append(KeyQuery(server, frozenset(str(k) for k in key_ids), minimum))
    return queries


def parse_minimum_valid_until(values: list[str], now_ms: int) -> int:
    """The ``minimum_valid_until_ts`` query parameter of the GET form (now when absent)."""
    if not values:
        return now_ms
    text = values[0]
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise MatrixError(400, "M_INVALID_PARAM", "minimum_valid_until_ts must be an integer timestamp in milliseconds")
    return max(now_ms, int(text))


@attrs.frozen
class NotaryLimits:
    max_servers: int = 100
    concurrency: int = 10
    timeout: float = 30.0


class Notary:
    """Answers what we know of other servers' keys, each response countersigned by us."""

    def __init__(self, *, keyring: Keyring, server_name: str, signing_key: SigningKey, clock_ms: Callable[[], int],
                 reactor: Any, limits: NotaryLimits = NotaryLimits()) -> None:
        self._keyring = keyring
        self._server_name = server_name
        self._signing_key = signing_key
        self._clock_ms = clock_ms
        self._reactor = reactor
        self.limits = limits

    async def query_body(self, body: object) -> dict[str, Any]:
        """``POST /_matrix/key/v2/query``."""
        return await self.answer(parse_key_query(body, self._clock_ms(), max_servers=self.limits.max_servers))

    async def query_server(self, server: str, key_id: str | None, minimum_params: list[str]) -> dict[str, Any]:
        """``GET /_matrix/key/v2/query/{serverName}[/{keyId}]``."""
        minimum = parse_minimum_valid_until(minimum_params, self._clock_ms())
        try:
            parse_server_name(server)
        except ValueError:
            return {"server_keys": []}
        return await self.answer([KeyQuery(server, frozenset([key_id] if key_id else []), minimum)])

    async def answer(self, queries: list[KeyQuery]) -> dict[str, Any]:
        """Fetch what is missing (bounded in number, concurrency and time), then answer from the cache."""

        async def fetch(query: KeyQuery) -> None:
            if query.server == self._server_name:
                return
            try:
                await self._keyring.get_server_keys(query.server, query.key_ids, at_ms=query.minimum_valid_until_ts)
            except CancelledError:
                raise
            except (FederationClientError, KeyFetchError) as e:  # unreachable: answer with what we have
                logger.info("key query: keys of %s: %s", query.server, e)

        try:
            await within(Deferred.fromCoroutine(map_concurrently(fetch, queries, limit=self.limits.concurrency)),
                         self.limits.timeout, self._reactor, "key query")
        except FederationClientError as e:
            logger.warning("%s; answering from the cache", e)
        results: list[dict[str, Any]] = []
        for query in queries:
            if query.server == self._server_name:
                results.append(server_key_response(self._server_name, self._signing_key, self._clock_ms()))
                continue
            cached = self._keyring.cached_response(query.server)
            if cached is not None:
                results.append(sign_json(dict(cached), self._server_name, self._signing_key))
        return {"server_keys": results}
