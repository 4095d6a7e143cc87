"""Registration: choosing a user ID, creating the account, and logging it in.

Usernames are lowercased, then checked against the localpart grammar for new
user IDs (``M_INVALID_USERNAME``) and against existing accounts
(``M_USER_IN_USE``); with no username a random localpart is picked. The
account, its profile (display name = localpart), device and access token are
written in one transaction. Whether registration is open, the ``kind`` of
account and the user-interactive auth are checked by the servlet first.
Guest accounts are made the same way with no password (``is_guest``), and
``upgrade_guest`` gives one a password, making it a full account.
"""

# tests: tests/unit/handlers/test_validation.py, tests/integration/test_client_accounts.py, tests/integration/test_client_guest.py

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import attrs

from homeserver.handlers.accounts.auth import PasswordHasher, generate_access_token, generate_device_id, hash_access_token
from storage.kernel.ratelimit import Ratelimiter, ratelimit
from homeserver.events.validation import check_localpart
from storage.kernel.errors import MatrixError
from storage.stores.accounts import AccountStore, NewLogin

logger = logging.getLogger(__name__)

_RANDOM_LOCALPART_TRIES = 10


@attrs.frozen
class LoginResult:
    user_id: str
    device_id: str
    access_token: str


@attrs.frozen
class RegistrationResult:
    user_id: str
    login: LoginResult | None
    # After a guest upgrade: the hashes of the account's earlier tokens, to drop from caches.
    stale_token_hashes: tuple[bytes, ...] = ()


def user_in_use() -> MatrixError:
    return MatrixError(400, "M_USER_IN_USE", "That user ID is already taken")


def localpart_from_username(username: str) -> str:
    """The localpart a requested username maps to: the username, lowercased."""
    return username.lower()


def _new_login(
    device_id: str | None, display_name: str | None, ip: str | None, inhibit_login: bool
) -> tuple[NewLogin | None, str | None]:
    """The device and token a registration creates (and the usable token); none with ``inhibit_login``."""
    if inhibit_login:
        return None, None
    token = generate_access_token()
    return NewLogin(device_id or generate_device_id(), display_name, hash_access_token(token), ip), token


class RegistrationHandler:
    def __init__(
        self,
        *,
        server_name: str,
        accounts: AccountStore,
        hasher: PasswordHasher,
        ratelimiter: Ratelimiter,
        clock: Callable[[], float],
    ) -> None:
        self._server_name = server_name
        self._accounts = accounts
        self._hasher = hasher
        self._ratelimiter = ratelimiter
        self._clock = clock

    def check_ratelimit(self, ip: str | None) -> None:
        """429 when this address has registered too often; counts nothing."""
        ratelimit(self._ratelimiter, ("register", ip), self._clock(), update=False)

    def user_id_for(self, username: str) -> str:
        """The user ID ``username`` would get; 400 ``M_INVALID_USERNAME`` when it cannot be one."""
        localpart = check_localpart(localpart_from_username(username), self._server_name)
        return f"@{localpart}:{self._server_name}"

    async def check_username_available(self, username: str) -> str:
        """The user ID for ``username`` if it is valid and free; else ``M_INVALID_USERNAME`` / ``M_USER_IN_USE``."""
        user_id = self.user_id_for(username)
        if await self._accounts.get_user(user_id) is not None:
            raise user_in_use()
        return user_id

    async def register(
        self,
        *,
        username: str | None,
        password: str | None,
        device_id: str | None,
        initial_device_display_name: str | None,
        inhibit_login: bool,
        ip: str | None,
        is_guest: bool = False,
        counted: bool = True,
    ) -> RegistrationResult:
        """Create an account; a guest (``is_guest``) has no password and always gets a login.
        ``counted``: against the address's registration rate limit (not an application
        service's registrations: a bridge's hundreds of users would shut its address out)."""
        password_hash = None if password is None else await self._hasher.hash(password)
        new_login, login_token = _new_login(device_id, initial_device_display_name, ip, inhibit_login)
        now_ms = int(self._clock() * 1000)
        for _ in range(1 if username is not None else _RANDOM_LOCALPART_TRIES):
            user_id = self.user_id_for(username if username is not None else secrets.token_hex(6))
            localpart = user_id[1:].partition(":")[0]
            created = await self._accounts.register_user(
                user_id,
                password_hash=password_hash,
                displayname=localpart,
                login=new_login,
                now_ms=now_ms,
                is_guest=is_guest,
            )
            if created:
                break
        else:
            raise user_in_use()
        if counted:
            self._ratelimiter.record(("register", ip), self._clock())
        logger.info("registered %s%s", "guest " if is_guest else "", user_id)
        if new_login is None or login_token is None:
            return RegistrationResult(user_id, None)
        return RegistrationResult(user_id, LoginResult(user_id, new_login.device_id, login_token))

    async def upgrade_guest(
        self,
        *,
        user_id: str,
        password: str,
        device_id: str | None,
        initial_device_display_name: str | None,
        inhibit_login: bool,
        ip: str | None,
    ) -> RegistrationResult:
        """Make guest ``user_id`` a full account (spec: ``guest_access_token``); ``M_USER_IN_USE`` if it is not a guest."""
        password_hash = await self._hasher.hash(password)
        new_login, login_token = _new_login(device_id, initial_device_display_name, ip, inhibit_login)
        stale = await self._accounts.upgrade_guest(
            user_id, password_hash=password_hash, login=new_login, now_ms=int(self._clock() * 1000)
        )
        if stale is None:
            raise user_in_use()
        self._ratelimiter.record(("register", ip), self._clock())
        logger.info("upgraded guest %s", user_id)
        login = None if new_login is None or login_token is None else LoginResult(user_id, new_login.device_id, login_token)
        return RegistrationResult(user_id, login, tuple(stale))
