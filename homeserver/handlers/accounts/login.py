"""Logging in and out, changing passwords, and the ``m.login.password`` auth stage.

Password logins are rate limited per client address and per account
(``rc_login.address`` / ``rc_login.account``), and failed ones again per account
(``rc_login.failed_attempts``), counted only when the password was wrong.
Unknown users cost the same bcrypt time as known ones, so response times do
not tell which accounts exist. Logging in with a known device ID replaces that
device's token.
"""

# tests: tests/integration/test_client_accounts.py

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from homeserver.appservice.registration import AppService
from homeserver.handlers.accounts.auth import (
    Auth,
    PasswordHasher,
    Requester,
    generate_access_token,
    generate_device_id,
    hash_access_token,
)
from homeserver.handlers.accounts.devices import DeviceHandler
from homeserver.handlers.ratelimit import Ratelimiters
from storage.kernel.ratelimit import limit_exceeded, ratelimit
from homeserver.handlers.accounts.register import LoginResult
from homeserver.handlers.accounts.ui_auth import StageFailed
from homeserver.events.validation import MAX_PASSWORD_LENGTH, check_text, is_storable_text
from storage.kernel.errors import MatrixError, bad_json, forbidden
from storage.stores.accounts import AccountStore, NewLogin

logger = logging.getLogger(__name__)

LOGIN_TYPE_PASSWORD: Final = "m.login.password"


def invalid_credentials() -> MatrixError:
    return forbidden("Invalid username or password")


def resolve_user(user: str, server_name: str) -> str | None:
    """The local user ID a login names (``@alice:server`` or ``alice``, any case); None if it cannot be ours."""
    if len(user) > 255 or not is_storable_text(user):
        return None
    if user.startswith("@"):
        localpart, sep, server = user[1:].partition(":")
        if not sep or server != server_name:
            return None
    else:
        localpart = user
    if not localpart or ":" in localpart:
        return None
    return f"@{localpart.lower()}:{server_name}"


def user_from_identifier(identifier: object, legacy_user: object) -> str | None:
    """The ``user`` of an ``m.id.user`` identifier (or the deprecated top-level ``user``).

    None when neither is given; 400 for malformed ones; 403 for third-party
    identifiers, since no account here has one.
    """
    if identifier is not None:
        if not isinstance(identifier, dict):
            raise bad_json("'identifier' must be an object")
        id_type = identifier.get("type")
        if id_type == "m.id.user":
            user = identifier.get("user")
            if not isinstance(user, str):
                raise bad_json("'identifier.user' must be a string")
            return user
        if id_type in ("m.id.thirdparty", "m.id.phone"):
            raise forbidden("No account is bound to that third-party identifier")
        raise MatrixError(400, "M_UNKNOWN", "Unknown identifier type")
    if legacy_user is not None:
        if not isinstance(legacy_user, str):
            raise bad_json("'user' must be a string")
        return legacy_user
    return None


class LoginHandler:
    def __init__(
        self,
        *,
        server_name: str,
        accounts: AccountStore,
        devices: DeviceHandler,
        auth: Auth,
        hasher: PasswordHasher,
        ratelimiters: Ratelimiters,
        clock: Callable[[], float],
    ) -> None:
        self._server_name = server_name
        self._accounts = accounts
        self._devices = devices
        self._auth = auth
        self._hasher = hasher
        self._limits = ratelimiters
        self._clock = clock

    async def _check_password(self, user_id: str, password: str) -> bool:
        """Verify with failed-attempt limiting; raises 429 when this account failed too often."""
        limiter = self._limits.login_failed_attempts
        result = limiter.check(user_id, self._clock(), update=False)
        if not result.allowed:
            raise limit_exceeded(result.retry_after)
        user = await self._accounts.get_user(user_id)
        if await self._hasher.verify(password, None if user is None else user.password_hash):
            if user is not None and user.deactivated:
                # Only to whoever knows the password (as Synapse): the account exists but is closed.
                raise MatrixError(403, "M_USER_DEACTIVATED", "This account has been deactivated")
            return True
        limiter.record(user_id, self._clock())
        return False

    async def login_with_password(
        self,
        *,
        user: str,
        password: str,
        device_id: str | None,
        initial_device_display_name: str | None,
        ip: str | None,
    ) -> LoginResult:
        ratelimit(self._limits.login_address, ip, self._clock())
        user_id = resolve_user(user, self._server_name)
        if user_id is None:
            raise invalid_credentials()
        ratelimit(self._limits.login_account, user_id, self._clock())
        if not await self._check_password(user_id, password):
            raise invalid_credentials()
        return await self._issue_login(user_id, device_id, initial_device_display_name, ip)

    async def login_as_app_service(
        self,
        service: AppService,
        *,
        user: str,
        device_id: str | None,
        initial_device_display_name: str | None,
        ip: str | None,
    ) -> LoginResult:
        """``m.login.application_service``: a token for a registered user of the service's
        namespaces (400 ``M_EXCLUSIVE`` outside them, 403 for an unknown or closed account)."""
        user_id = resolve_user(user, self._server_name)
        if user_id is None or not service.may_act_as(user_id):
            raise MatrixError(400, "M_EXCLUSIVE", "This user is not in the application service's namespaces")
        row = await self._accounts.get_user(user_id)
        if row is None or row.deactivated:
            raise invalid_credentials()
        return await self._issue_login(user_id, device_id, initial_device_display_name, ip)

    async def _issue_login(
        self, user_id: str, device_id: str | None, initial_device_display_name: str | None, ip: str | None
    ) -> LoginResult:
        device_id = device_id or generate_device_id()
        token = generate_access_token()
        login = NewLogin(device_id, initial_device_display_name, hash_access_token(token), ip)
        replaced = await self._accounts.add_login(user_id, login, int(self._clock() * 1000))
        self._auth.invalidate_token_hashes(replaced)
        logger.info("[%s] logged in on device %s", user_id, device_id)
        await self._devices.devices_changed(user_id, [device_id])
        return LoginResult(user_id, device_id, token)

    async def check_password_stage(self, auth: Mapping[str, Any], user_id: str | None) -> None:
        """The ``m.login.password`` UIA stage, for a session bound to ``user_id``."""
        if user_id is None:
            raise StageFailed("M_FORBIDDEN", "Password authentication needs a logged-in user")
        named = user_from_identifier(auth.get("identifier"), auth.get("user"))
        if named is not None and resolve_user(named, self._server_name) != user_id:
            # Not a failed stage that another try could pass: the request is refused outright,
            # 403 as Synapse ("Invalid auth") and SyTest's "DELETE /device/{deviceId} requires UI
            # auth user to match device owner" expect. No password of the other user is checked.
            raise MatrixError(403, "M_FORBIDDEN", "The identifier does not name the logged-in user")
        password = auth.get("password")
        if not isinstance(password, str):
            raise bad_json("'auth.password' must be a string")
        if len(password) > MAX_PASSWORD_LENGTH or not await self._check_password(user_id, password):
            raise StageFailed("M_FORBIDDEN", "Invalid password")

    async def logout(self, requester: Requester) -> None:
        await self._devices.delete_devices(requester.user_id, [requester.device_id])

    async def logout_all(self, requester: Requester) -> None:
        await self._devices.delete_all_devices(requester.user_id)

    async def deactivate(self, user_id: str, *, erase: bool = False) -> None:
        """Close the account: no login from now on, then every device and access token goes.
        ``erase`` marks it erased too (its events are then served pruned to later joiners)."""
        await self._accounts.deactivate_user(user_id, erased_ts=int(self._clock() * 1000) if erase else None)
        await self._devices.delete_all_devices(user_id)
        logger.info("[%s] deactivated", user_id)

    async def change_password(self, requester: Requester, new_password: str, *, logout_devices: bool) -> None:
        check_text(new_password, "new_password", max_length=MAX_PASSWORD_LENGTH, allow_empty=False)
        password_hash = await self._hasher.hash(new_password)
        deleted = await self._accounts.set_password_hash(
            requester.user_id, password_hash, keep_device_id=requester.device_id, logout_devices=logout_devices
        )
        await self._devices.devices_deleted(requester.user_id, deleted)
        logger.info("[%s] changed password (other devices logged out: %s)", requester.user_id, logout_devices)
