"""Client servlets for application services: ``POST /_matrix/client/v1/appservice/{id}/ping``
(a service's ``as_token`` only) and the ``/thirdparty/*`` lookups the services answer
(``homeserver/appservice/queries.py``; any user's access token)."""

# tests: tests/integration/test_appservice.py

from __future__ import annotations

from twisted.web.server import Request

from homeserver.appservice.queries import AppServiceQueries
from homeserver.http.client_api._base import client_path, optional_string
from homeserver.http.routes import Call, Caller, Response, route
from homeserver.http.server import parse_optional_json_object
from storage.kernel.errors import MatrixError, forbidden

MAX_PING_TXN_ID_LENGTH = 255
# Query parameters passed through to a service's third-party lookup, at most.
MAX_LOOKUP_FIELDS = 20


def _lookup_query(request: Request) -> dict[str, str]:
    args: dict[bytes, list[bytes]] = request.args or {}
    if len(args) > MAX_LOOKUP_FIELDS:
        raise MatrixError(400, "M_INVALID_PARAM", f"At most {MAX_LOOKUP_FIELDS} query parameters")
    query: dict[str, str] = {}
    for key, values in args.items():
        if key == b"access_token" or not values:
            continue
        try:
            query[key.decode("utf-8")] = values[0].decode("utf-8")
        except UnicodeDecodeError:
            raise MatrixError(400, "M_INVALID_PARAM", "Query parameters must be UTF-8") from None
    return query


class AppServiceServlets:
    def __init__(self, queries: AppServiceQueries) -> None:
        self._queries = queries

    @route("POST", r"/_matrix/client/v1/appservice/(?P<service_id>[^/]+)/ping", "client_appservice_ping",
           caller=Caller.APPSERVICE)
    async def post_ping(self, call: Call) -> Response:
        service = call.user.app_service
        assert service is not None  # Caller.APPSERVICE
        if service.id != call.params["service_id"]:
            raise forbidden("This as_token belongs to another application service")
        # Read after the service is checked (not declared as the body), so another service's ping is a 403 first.
        body = parse_optional_json_object(call.request)
        txn_id = optional_string(body, "transaction_id", max_length=MAX_PING_TXN_ID_LENGTH)
        return 200, {"duration_ms": await self._queries.ping(service, txn_id)}

    @route("GET", client_path(r"/thirdparty/protocols"), "client_thirdparty_protocols", caller=Caller.USER)
    async def get_protocols(self, call: Call) -> Response:
        return 200, await self._queries.protocols()

    @route("GET", client_path(r"/thirdparty/protocol/(?P<protocol>[^/]+)"), "client_thirdparty_protocol",
           caller=Caller.USER)
    async def get_protocol(self, call: Call) -> Response:
        return 200, await self._queries.protocol(call.params["protocol"])

    @route("GET", client_path(r"/thirdparty/location/(?P<protocol>[^/]+)"), "client_thirdparty_location_protocol",
           caller=Caller.USER)
    @route("GET", client_path(r"/thirdparty/location"), "client_thirdparty_location", caller=Caller.USER)
    async def lookup_location(self, call: Call) -> Response:
        return await self._lookup("location", call)

    @route("GET", client_path(r"/thirdparty/user/(?P<protocol>[^/]+)"), "client_thirdparty_user_protocol",
           caller=Caller.USER)
    @route("GET", client_path(r"/thirdparty/user"), "client_thirdparty_user", caller=Caller.USER)
    async def lookup_user(self, call: Call) -> Response:
        return await self._lookup("user", call)

    async def _lookup(self, kind: str, call: Call) -> Response:
        return 200, await self._queries.lookup(kind, call.params.get("protocol"), _lookup_query(call.request))
