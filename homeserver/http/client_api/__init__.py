"""Client-server API servlets for accounts, auth, devices, profiles, account data and discovery.

``register_client_api_servlets`` declares every servlet of this package on the
router, through the gate, each with the few handlers of ``AccountServices`` it uses. Each path is served under both
``/_matrix/client/r0`` and ``/_matrix/client/v3``. docs/client-api.md lists them.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_fuzz.py

from __future__ import annotations

from homeserver.config import HomeserverConfig
from homeserver.handlers.account_services import AccountServices
from homeserver.http.client_api.account import LoginServlets, RegistrationServlets
from homeserver.http.client_api.account_data import AccountDataServlets
from homeserver.http.client_api.appservice import AppServiceServlets
from homeserver.http.client_api.devices import DeviceServlets
from homeserver.http.client_api.profile import ProfileServlets
from homeserver.http.client_api.server_info import ServerInfoServlets
from homeserver.http.client_api.threepid import ThreepidServlets
from homeserver.http.routes import Gate, declare
from homeserver.http.server import Routes
from homeserver.handlers.writers import Writers

__all__ = ["register_client_api_servlets"]


def register_client_api_servlets(router: Routes, gate: Gate, config: HomeserverConfig, services: AccountServices,
                                 writers: Writers) -> None:
    declare(
        router,
        gate,
        AccountDataServlets(services.account_data, services.filters, writers.account_data),
        RegistrationServlets(config, services.auth, services.registration, services.uia,
                             services.registration_token_valid),
        LoginServlets(config, services.auth, services.login, services.uia),
        DeviceServlets(services.devices, services.uia),
        ProfileServlets(services.profiles),
        ServerInfoServlets(config),
        ThreepidServlets(services.uia),
        AppServiceServlets(services.app_service_queries),
    )
