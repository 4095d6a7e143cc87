"""Builds the account-side services (stores and handlers) of a process from its config.

``AccountServices.build`` is called by the composition root (homeserver/app.py)
once the database is open; it keeps that file to a few lines. Collaborators
that belong to other parts of the server are parameters: the reactor (whose
thread pool runs bcrypt), and the account_data stream's ID allocator and writer name.
Until the stream writers are wired, ``sequence_stream_ids`` is the stand-in
allocator (see its docstring for what it does not do).
"""

# tests: tests/integration/test_client_accounts.py

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final

import attrs
from twisted.internet.threads import deferToThreadPool

from homeserver.appservice.client import AppServiceClient
from homeserver.appservice.queries import AppServiceQueries
from homeserver.appservice.registration import AppServiceRegistry
from homeserver.config import HomeserverConfig
from homeserver.handlers.accounts.account_data import AccountDataHandler, StreamIdAllocator
from homeserver.handlers.accounts.auth import Auth, PasswordHasher
from homeserver.handlers.accounts.devices import DeviceHandler
from homeserver.handlers.accounts.filters import FilterHandler
from homeserver.handlers.accounts.login import LoginHandler
from homeserver.handlers.accounts.profile import ProfileHandler, RemoteProfiles
from homeserver.handlers.ratelimit import Ratelimiters
from homeserver.handlers.accounts.register import RegistrationHandler
from homeserver.handlers.accounts.ui_auth import (
    LOGIN_DUMMY,
    LOGIN_PASSWORD,
    LOGIN_REGISTRATION_TOKEN,
    UiaSessions,
    UserInteractiveAuth,
    check_dummy,
    registration_token_checker,
)
from storage.database import Database
from storage.stores.account_data import AccountDataStore
from storage.stores.accounts import AccountStore
from storage.stores.admin import AdminStore
from storage.stores.devices import DeviceStore
from storage.stores.filters import FilterStore
from storage.stores.profiles import ProfileStore

# The name this process writes streams under until instance names are configured.
DEFAULT_INSTANCE_NAME: Final = "master"


def sequence_stream_ids(store: AccountDataStore) -> StreamIdAllocator:
    """Stand-in allocator: ``nextval`` on the stream's sequence, with no position tracking.

    Rows get correct, increasing stream IDs, but no reader is told the stream's
    position moved. Replace it with ``StreamIdGenerator.get_next`` of the
    account_data stream's generator when the stream writers are wired.
    """

    @asynccontextmanager
    async def reserve() -> AsyncIterator[int]:
        yield await store.next_stream_id_from_sequence()

    def allocator() -> AbstractAsyncContextManager[int]:
        return reserve()

    return allocator


def _thread_runner(reactor: Any) -> Callable[..., Any]:
    async def run(func: Callable[..., Any], *args: Any) -> Any:
        return await deferToThreadPool(reactor, reactor.getThreadPool(), func, *args)

    return run


@attrs.frozen
class AccountServices:
    auth: Auth
    ratelimiters: Ratelimiters
    uia: UserInteractiveAuth
    registration: RegistrationHandler
    login: LoginHandler
    devices: DeviceHandler
    profiles: ProfileHandler
    account_data: AccountDataHandler
    filters: FilterHandler
    # Whether a registration token may be used now (GET .../registration_token/validity).
    registration_token_valid: Callable[[str], Awaitable[bool]]
    # Questions for application services (unknown users and aliases, third-party lookups, pings).
    app_service_queries: AppServiceQueries

    @classmethod
    def build(
        cls,
        config: HomeserverConfig,
        db: Database,
        reactor: Any,
        *,
        account_data_stream_ids: StreamIdAllocator | None = None,
        instance_name: str = DEFAULT_INSTANCE_NAME,
        clock: Callable[[], float] = time.time,
        remote_profiles: RemoteProfiles | None = None,
        account_data_noted: Callable[[int, frozenset[str]], None] | None = None,
        on_tokens_revoked: Callable[[list[bytes]], None] | None = None,
    ) -> AccountServices:
        accounts = AccountStore(db)
        device_store = DeviceStore(db)
        account_data_store = AccountDataStore(db)
        hasher = PasswordHasher(config.bcrypt_rounds, _thread_runner(reactor))
        ratelimiters = Ratelimiters.from_config(config)
        app_services = AppServiceRegistry(config.app_services)
        auth = Auth(accounts, device_store, clock=clock, app_services=app_services, on_revoked=on_tokens_revoked)
        app_service_queries = AppServiceQueries(
            app_services, AppServiceClient(reactor, timeout=config.app_service_sender.request_timeout.total_seconds()),
            clock_ms=lambda: int(clock() * 1000),
        )
        devices = DeviceHandler(device_store, auth)
        login = LoginHandler(
            server_name=config.server_name,
            accounts=accounts,
            devices=devices,
            auth=auth,
            hasher=hasher,
            ratelimiters=ratelimiters,
            clock=clock,
        )
        tokens = AdminStore(db)
        uia = UserInteractiveAuth(
            UiaSessions(),
            {LOGIN_DUMMY: check_dummy, LOGIN_PASSWORD: login.check_password_stage,
             LOGIN_REGISTRATION_TOKEN: registration_token_checker(tokens.use_registration_token, clock)},
            clock,
        )
        return cls(
            auth=auth,
            ratelimiters=ratelimiters,
            uia=uia,
            registration=RegistrationHandler(
                server_name=config.server_name,
                accounts=accounts,
                hasher=hasher,
                ratelimiter=ratelimiters.registration,
                clock=clock,
            ),
            login=login,
            devices=devices,
            profiles=ProfileHandler(ProfileStore(db), server_name=config.server_name, remote=remote_profiles,
                                    ask_services=app_service_queries.query_user if app_services else None),
            account_data=AccountDataHandler(
                account_data_store,
                account_data_stream_ids or sequence_stream_ids(account_data_store),
                instance_name=instance_name,
                noted=account_data_noted,
            ),
            filters=FilterHandler(FilterStore(db)),
            registration_token_valid=lambda token: tokens.registration_token_valid(token, int(clock() * 1000)),
            app_service_queries=app_service_queries,
        )
