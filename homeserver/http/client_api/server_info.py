"""Servlets describing the server: GET /capabilities, GET /.well-known/matrix/client.

``/capabilities`` needs an access token (a guest's will do; push rules: ``client_api/push.py``);
the well-known document does not, and is 404 ``M_NOT_FOUND`` unless ``public_baseurl`` is set.
"""

# tests: tests/integration/test_client_accounts.py

from __future__ import annotations

from homeserver.config import HomeserverConfig
from homeserver.handlers.server_info import capabilities, client_well_known
from homeserver.http.client_api._base import client_path
from homeserver.http.routes import Call, Caller, Response, route
from storage.kernel.errors import not_found


class ServerInfoServlets:
    def __init__(self, config: HomeserverConfig) -> None:
        self._config = config

    @route("GET", client_path(r"/capabilities"), "client_capabilities", caller=Caller.GUEST)
    async def get_capabilities(self, call: Call) -> Response:
        return 200, {"capabilities": capabilities(self._config)}

    @route("GET", r"/\.well-known/matrix/client", "client_well_known", caller=Caller.NONE)
    async def get_well_known(self, call: Call) -> Response:
        document = client_well_known(self._config)
        if document is None:
            raise not_found("No client discovery information: public_baseurl is not configured")
        return 200, document
