"""Client servlets for application services: ``POST /_matrix/client/v1/appservice/{id}/ping``
and the ``/thirdparty/*`` lookups the services answer (``homeserver/appservice/queries.py``)."""

# tests: tests/integration/test_appservice.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.appservice.queries import AppServiceQueries
from homeserver.handlers.accounts.auth import Auth
from homeserver.http.server import parse_optional_json_object
from homeserver.http.client_api._base import client_path, optional_string
from homeserver.http.server import Routes
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


def register_appservice_servlets(router: Routes, *, auth: Auth, queries: AppServiceQueries) -> None:
    async def post_ping(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        service = auth.app_service_by_req(request)
        if service is None:
            await auth.get_user_by_req(request)  # 401 without a valid token
            raise forbidden("Only an application service may ping itself")
        if service.id != params["service_id"]:
            raise forbidden("This as_token belongs to another application service")
        body = parse_optional_json_object(request)
        txn_id = optional_string(body, "transaction_id", max_length=MAX_PING_TXN_ID_LENGTH)
        return 200, {"duration_ms": await queries.ping(service, txn_id)}

    async def get_protocols(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        await auth.get_user_by_req(request)
        return 200, await queries.protocols()

    async def get_protocol(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        await auth.get_user_by_req(request)
        return 200, await queries.protocol(params["protocol"])

    def lookup(kind: str, by_protocol: bool) -> Any:
        async def handler(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
            await auth.get_user_by_req(request)
            protocol = params["protocol"] if by_protocol else None
            return 200, await queries.lookup(kind, protocol, _lookup_query(request))

        return handler

    router.register(["POST"], r"/_matrix/client/v1/appservice/(?P<service_id>[^/]+)/ping", post_ping,
                    "client_appservice_ping")
    router.register(["GET"], client_path(r"/thirdparty/protocols"), get_protocols, "client_thirdparty_protocols")
    router.register(["GET"], client_path(r"/thirdparty/protocol/(?P<protocol>[^/]+)"), get_protocol,
                    "client_thirdparty_protocol")
    for kind in ("location", "user"):
        router.register(["GET"], client_path(rf"/thirdparty/{kind}/(?P<protocol>[^/]+)"), lookup(kind, True),
                        f"client_thirdparty_{kind}_protocol")
        router.register(["GET"], client_path(rf"/thirdparty/{kind}"), lookup(kind, False),
                        f"client_thirdparty_{kind}")
