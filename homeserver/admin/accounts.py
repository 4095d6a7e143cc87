"""Creating accounts outside ``/register``: the ``register-user`` command, shared-secret
registration and the admin API's create-user. One function, so all three make the same
account as ``/register`` would (profile with the localpart as display name), optionally
a server admin."""

# tests: tests/integration/test_admin_api.py

from __future__ import annotations

import logging
import time
from typing import Any

from twisted.internet.threads import deferToThreadPool

from homeserver.config import HomeserverConfig
from homeserver.handlers.accounts.auth import PasswordHasher
from storage.database import Database
from storage.stores.accounts import AccountStore
from storage.stores.admin import AdminStore

logger = logging.getLogger(__name__)


class AccountExists(Exception):
    """The user ID is taken (by a live, deactivated or guest account)."""


def password_hasher(config: HomeserverConfig, reactor: Any) -> PasswordHasher:
    async def run(func: Any, *args: Any) -> Any:
        return await deferToThreadPool(reactor, reactor.getThreadPool(), func, *args)

    return PasswordHasher(config.bcrypt_rounds, run)


async def create_account(db: Database, reactor: Any, config: HomeserverConfig, localpart: str, password: str | None,
                         *, admin: bool, displayname: str | None = None) -> str:
    """Create ``@localpart:server_name`` (the localpart already checked); return the user ID.
    Raises AccountExists when the ID is taken."""
    user_id = f"@{localpart}:{config.server_name}"
    password_hash = None if password is None else await password_hasher(config, reactor).hash(password)
    created = await AccountStore(db).register_user(user_id, password_hash=password_hash,
                                                   displayname=displayname or localpart, login=None,
                                                   now_ms=int(time.time() * 1000))
    if not created:
        raise AccountExists(f"{user_id} already exists")
    if admin:
        await AdminStore(db).set_admin(user_id, True)
    logger.info("registered %s%s", user_id, " as a server admin" if admin else "")
    return user_id
