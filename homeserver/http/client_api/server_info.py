"""Servlets describing the server: GET /capabilities, GET /.well-known/matrix/client.

``/capabilities`` needs an access token (push rules: ``client_api/push.py``); the well-known
document does not, and is 404 ``M_NOT_FOUND`` unless ``public_baseurl`` is set.
"""

# tests: tests/integration/test_client_accounts.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.config import HomeserverConfig
from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.server_info import capabilities, client_well_known
from homeserver.http.client_api._base import client_path
from storage.kernel.errors import not_found
from homeserver.http.server import Routes


def register_server_info_servlets(router: Routes, *, config: HomeserverConfig, auth: Auth) -> None:
    async def get_capabilities(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        await auth.get_user_by_req(request)
        return 200, {"capabilities": capabilities(config)}

    async def get_well_known(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        document = client_well_known(config)
        if document is None:
            raise not_found("No client discovery information: public_baseurl is not configured")
        return 200, document

    router.register(["GET"], client_path(r"/capabilities"), get_capabilities, "client_capabilities")
    router.register(["GET"], r"/\.well-known/matrix/client", get_well_known, "client_well_known")
