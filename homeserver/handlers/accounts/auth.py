"""Who is making a request: access tokens, password hashes, and the ``Auth`` helper.

Access tokens are random (``secrets``) and stored only as their SHA-256, so the
database never holds a usable token. ``Auth.get_user_by_req`` turns a request's
token (``Authorization: Bearer``, or the deprecated ``access_token`` query
parameter) into a ``Requester``; every authenticated servlet starts with it.
Lookups are cached in memory; logouts and device deletions invalidate the
cache, and a generation counter keeps a lookup that raced an invalidation
from caching a token that was just revoked. Passwords are hashed with bcrypt
on a worker thread, never on the reactor.

An application service's ``as_token`` is not in the database: the service acts as its
sender, or as the user its ``user_id`` query parameter names when that user is in its user
namespaces (and registered), on the device ``device_id`` names (docs/appservices.md).

The cache is per process. With workers, a revocation reaches the other
processes over the ``caches`` stream (``on_revoked`` on the revoking side,
``TokenCacheInvalidation`` on the others).
"""

# tests: tests/unit/handlers/test_auth.py, tests/integration/test_client_accounts.py, tests/integration/test_client_guest.py

from __future__ import annotations

import base64
import hashlib
import logging
import secrets
import string
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, TypeVar

import attrs
import bcrypt
from twisted.web.server import Request

from homeserver.appservice.registration import AppService, AppServiceRegistry
from storage.kernel.errors import MatrixError, forbidden
from storage.stores.accounts import AccountStore, TokenOwner
from storage.stores.devices import DeviceStore

logger = logging.getLogger(__name__)

T = TypeVar("T")
RunInThread = Callable[..., Awaitable[Any]]

TOKEN_PREFIX: Final = "trb_"
MAX_TOKEN_LENGTH: Final = 512
DEFAULT_TOKEN_CACHE_SIZE: Final = 10_000
# How often a device's last_seen_ts/ip is written while it keeps making requests.
LAST_SEEN_INTERVAL_SECONDS: Final = 300.0
_DEVICE_ID_ALPHABET: Final = string.ascii_uppercase


def guest_access_forbidden() -> MatrixError:
    return MatrixError(403, "M_GUEST_ACCESS_FORBIDDEN", "Guest access not allowed")


@attrs.frozen
class Requester:
    """The authenticated user behind a request."""

    user_id: str
    device_id: str
    access_token_id: int
    is_guest: bool = False
    # The application service acting (as ``user_id``), if it is one.
    app_service: AppService | None = None

    @property
    def ratelimited(self) -> bool:
        """Whether rate limits apply (not to a service registered with ``rate_limited: false``)."""
        return self.app_service is None or self.app_service.rate_limited


def app_service_token_id(service_id: str, user_id: str, device_id: str) -> int:
    """A stand-in ``access_token_id`` for a service acting as a user on a device: stable, and
    negative so that it never equals a real token's ID (send transaction IDs are scoped by it)."""
    digest = hashlib.sha256(f"{service_id}\0{user_id}\0{device_id}".encode("utf-8", "surrogatepass")).digest()
    return -1 - int.from_bytes(digest[:7], "big")


def generate_access_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_access_token(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def generate_device_id() -> str:
    return "".join(secrets.choice(_DEVICE_ID_ALPHABET) for _ in range(10))


def missing_token() -> MatrixError:
    return MatrixError(401, "M_MISSING_TOKEN", "Missing access token")


def unknown_token() -> MatrixError:
    return MatrixError(401, "M_UNKNOWN_TOKEN", "Unknown or expired access token", soft_logout=False)


def access_token_from_request(request: Request) -> str | None:
    """The request's access token, None when it has none; 401 when it is malformed or given twice."""
    headers = request.requestHeaders.getRawHeaders(b"authorization") or []
    args: dict[bytes, list[bytes]] = request.args or {}
    query = args.get(b"access_token", [])
    if len(headers) + len(query) > 1:
        raise MatrixError(
            401, "M_MISSING_TOKEN", "Give the access token once: in the Authorization header or the query"
        )
    raw: bytes
    if headers:
        scheme, _, value = headers[0].strip().partition(b" ")
        if scheme.lower() != b"bearer" or not value.strip():
            raise MatrixError(401, "M_MISSING_TOKEN", "The Authorization header must be 'Bearer <token>'")
        raw = value.strip()
    elif query:
        raw = query[0]
    else:
        return None
    if len(raw) > MAX_TOKEN_LENGTH:
        raise unknown_token()
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise unknown_token() from None


def client_ip(request: Request) -> str | None:
    host = getattr(request.getClientAddress(), "host", None)
    return host if isinstance(host, str) else None


def _query_arg(args: Mapping[bytes, list[bytes]], name: bytes) -> str | None:
    values = args.get(name)
    if not values:
        return None
    if len(values[0]) > 255:
        raise MatrixError(400, "M_INVALID_PARAM", f"{name.decode()} is too long")
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise MatrixError(400, "M_INVALID_PARAM", f"{name.decode()} is not UTF-8") from None


class PasswordHasher:
    """bcrypt over the base64 SHA-256 of the password, on a thread.

    bcrypt reads at most 72 bytes (and bcrypt 5 refuses longer input), so the
    password is first reduced to a 44-byte digest: long passphrases keep all
    their entropy, and NUL or other odd characters cannot truncate it.
    """

    def __init__(self, rounds: int, run_in_thread: RunInThread) -> None:
        self._rounds = rounds
        self._run_in_thread = run_in_thread
        self._dummy_hash: str | None = None

    @staticmethod
    def _prehash(password: str) -> bytes:
        return base64.b64encode(hashlib.sha256(password.encode("utf-8", "surrogatepass")).digest())

    def _hash_sync(self, password: str) -> str:
        return bcrypt.hashpw(self._prehash(password), bcrypt.gensalt(self._rounds)).decode("ascii")

    def _verify_sync(self, password: str, stored: str) -> bool:
        try:
            return bcrypt.checkpw(self._prehash(password), stored.encode("ascii"))
        except ValueError:
            logger.warning("a stored password hash is not a bcrypt hash")
            return False

    async def hash(self, password: str) -> str:
        result: str = await self._run_in_thread(self._hash_sync, password)
        return result

    async def verify(self, password: str, stored: str | None) -> bool:
        """Whether ``password`` matches ``stored``; with no stored hash, spend the same time and say no."""
        if stored is None:
            if self._dummy_hash is None:
                self._dummy_hash = await self.hash(secrets.token_hex(16))
            await self._run_in_thread(self._verify_sync, password, self._dummy_hash)
            return False
        result: bool = await self._run_in_thread(self._verify_sync, password, stored)
        return result


class Auth:
    """Turns access tokens into ``Requester``s, with an invalidated in-memory cache."""

    def __init__(
        self,
        accounts: AccountStore,
        devices: DeviceStore,
        *,
        clock: Callable[[], float],
        cache_size: int = DEFAULT_TOKEN_CACHE_SIZE,
        app_services: AppServiceRegistry | None = None,
        on_revoked: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        self.app_services = app_services if app_services is not None else AppServiceRegistry()
        # Users a service may act as that are known to be registered (services' senders included).
        self._as_users_known: set[str] = set()
        self._accounts = accounts
        self._devices = devices
        self._clock = clock
        self._cache: OrderedDict[bytes, TokenOwner] = OrderedDict()
        self._cache_size = cache_size
        self._generation = 0
        self._last_seen: dict[tuple[str, str], float] = {}
        # Called with the hashes of revoked tokens, after this process forgot them.
        self._on_revoked = on_revoked

    async def get_user_by_req(self, request: Request, *, allow_guest: bool = False) -> Requester:
        """The requester, or 401 ``M_MISSING_TOKEN`` / ``M_UNKNOWN_TOKEN``. A guest is refused
        (403 ``M_GUEST_ACCESS_FORBIDDEN``) unless ``allow_guest``: the route's declaration
        (``Caller.GUEST``, homeserver/http/routes.py) decides."""
        token = access_token_from_request(request)
        if token is None:
            raise missing_token()
        service = self.app_services.by_token(token)
        if service is not None:
            return await self._app_service_requester(service, request)
        owner = await self._lookup(token)
        # The router names the servlet on the request; one allow-list decides for guests.
        if owner.is_guest and not allow_guest:
            raise guest_access_forbidden()
        await self._note_seen(owner, client_ip(request))
        return Requester(owner.user_id, owner.device_id, owner.token_id, owner.is_guest)

    def has_access_token(self, request: Request) -> bool:
        return access_token_from_request(request) is not None

    def has_app_service_token(self, request: Request) -> bool:
        return self.app_service_by_req(request) is not None

    def app_service_by_req(self, request: Request) -> AppService | None:
        """The service whose ``as_token`` the request carries (None: not a service's token)."""
        token = access_token_from_request(request)
        return None if token is None else self.app_services.by_token(token)

    async def _app_service_requester(self, service: AppService, request: Request) -> Requester:
        """The spec's identity assertion: ``user_id`` (default: the sender) must be the service's,
        and registered; ``device_id``, if given, must be one of that user's devices."""
        args: dict[bytes, list[bytes]] = request.args or {}
        user_id = _query_arg(args, b"user_id") or service.sender
        if not service.may_act_as(user_id):
            raise forbidden("Application service cannot masquerade as this user")
        if user_id not in self._as_users_known:
            row = await self._accounts.get_user(user_id)
            if row is None and user_id == service.sender:
                # Its sender exists from the service's first request on.
                await self._accounts.register_user(user_id, password_hash=None, displayname=user_id[1:].split(":")[0],
                                                   login=None, now_ms=int(self._clock() * 1000))
                row = await self._accounts.get_user(user_id)
            if row is None or row.deactivated:
                raise forbidden("Application service has not registered this user")
            if len(self._as_users_known) >= 100_000:
                self._as_users_known.clear()
            self._as_users_known.add(user_id)
        device_id = _query_arg(args, b"device_id") if service.device_masquerading else None
        if device_id is not None and await self._devices.get_device(user_id, device_id) is None:
            raise MatrixError(400, "M_UNKNOWN_DEVICE", "No such device for this user")
        device = device_id or ""
        return Requester(user_id, device, app_service_token_id(service.id, user_id, device), app_service=service)

    async def get_user_by_access_token(self, token: str) -> Requester:
        owner = await self._lookup(token)
        return Requester(owner.user_id, owner.device_id, owner.token_id, owner.is_guest)

    async def _lookup(self, token: str) -> TokenOwner:
        digest = hash_access_token(token)
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
            return cached
        generation = self._generation
        owner = await self._accounts.get_token_owner(digest)
        if owner is None:
            raise unknown_token()
        # An invalidation that ran while we were reading may have revoked this
        # very token after our read saw it; caching it then would resurrect it.
        if generation == self._generation:
            self._cache[digest] = owner
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return owner

    async def _note_seen(self, owner: TokenOwner, ip: str | None) -> None:
        now = self._clock()
        key = (owner.user_id, owner.device_id)
        last = self._last_seen.get(key)
        if last is not None and now - last < LAST_SEEN_INTERVAL_SECONDS:
            return
        if len(self._last_seen) >= 100_000:
            self._last_seen.clear()
        self._last_seen[key] = now
        await self._devices.update_last_seen(owner.user_id, owner.device_id, int(now * 1000), ip)

    def invalidate_token_hashes(self, hashes: Iterable[bytes]) -> None:
        """Forget these tokens; call after the transaction that deleted them has committed.
        ``on_revoked`` tells other processes (the ``caches`` stream, with workers)."""
        digests = list(hashes)
        self.forget_token_hashes(digests)
        if self._on_revoked is not None:
            self._on_revoked(digests)

    def forget_token_hashes(self, hashes: Iterable[bytes]) -> None:
        """Drop these tokens from this process's cache only (another process revoked them)."""
        self._generation += 1
        # A revocation may be a deactivation: services' users are looked up again.
        self._as_users_known.clear()
        for digest in hashes:
            self._cache.pop(digest, None)

    def invalidate_all(self) -> None:
        self._generation += 1
        self._cache.clear()
        self._as_users_known.clear()


class TokenCacheInvalidation:
    """The ``access_tokens`` cache as the ``caches`` stream sees it: keys are ``(sha256 hex,)``."""

    name = "access_tokens"

    def __init__(self, auth: Auth) -> None:
        self._auth = auth

    def invalidate(self, key: tuple[str, ...]) -> None:
        try:
            self._auth.forget_token_hashes([bytes.fromhex(part) for part in key])
        except ValueError:
            self._auth.invalidate_all()

    def invalidate_all(self) -> None:
        self._auth.invalidate_all()
