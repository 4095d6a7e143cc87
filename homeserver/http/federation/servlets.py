"""Routes under /_matrix/federation/v1|v2 and /_matrix/key/v2, and the services behind them.

The servlet classes declare the routes (homeserver/http/routes.py), each given the
federation services it calls (built in homeserver/wiring/federation.py), and ``app.py``
declares them on the federation router. The federation listener's gate (homeserver/app.py)
authenticates each ``Caller.SERVER`` route with ``XMatrixAuth``: it reads the signed body, checks
``X-Matrix`` (401 M_UNAUTHORIZED on any failure) and a room's server ACL, and the
handler gets the origin as ``call.server``.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from twisted.web.server import Request

from homeserver import __version__
from homeserver.events.server_acl import ServerAcls
from homeserver.remote.request_auth import KeyLookup, authenticate_request
from homeserver.federation.devices import FederationDeviceHandler
from homeserver.federation.history import HistoryHandler
from homeserver.federation.keys import Notary
from homeserver.federation.membership import MembershipHandler
from homeserver.federation.transaction import TransactionHandler
from homeserver.events.identifiers import is_valid_event_id, is_valid_key_id, is_valid_room_alias, is_valid_user_id
from homeserver.federation.history import MAX_BACKFILL
from homeserver.federation.requests import (
    body_object,
    invite_body,
    missing_events_body,
    query_bool,
    query_int,
    query_list,
    query_one,
    query_required,
    query_values,
)
from storage.kernel.errors import invalid_param, missing_param, not_found
from homeserver.http.routes import Body, Call, Caller, Rate, Response, route

FED_V1 = "/_matrix/federation/v1"
FED_V2 = "/_matrix/federation/v2"
KEY_V2 = "/_matrix/key/v2"
_SEG = "[^/]+"
# Room version identifiers in make_join's ``ver`` are short ("12", "org.matrix.msc...").
MAX_VERSION_LENGTH = 64


ProfileLookup = Callable[[str], Awaitable[Any]]
"""``user_id -> row`` with ``displayname`` and ``avatar_url``; raises ``MatrixError`` 404 when unknown."""


AliasLookup = Callable[[str], Awaitable[tuple[str, str] | None]]
"""``#alias:server -> (room_id, creator)`` from the local alias directory, or None."""


class XMatrixAuth:
    """The gate's check of another server (``ServerAuth``): the request's ``X-Matrix`` signature
    over method, URI and the signed body (401 otherwise); the origin is then up
    (``on_remote_up``), and a path naming a room obeys that room's server ACL (403)."""

    def __init__(self, server_name: str, get_verify_key: KeyLookup, on_remote_up: Callable[[str], None],
                 acl: ServerAcls) -> None:
        self._server_name = server_name
        self._get_verify_key = get_verify_key
        self._on_remote_up = on_remote_up
        self._acl = acl

    async def authenticate(self, request: Request, params: Mapping[str, str], content: Any,
                           raw: bytes | None) -> str:
        # The router serves HEAD with a GET route, whose signature covers "GET".
        method = request.method.decode("ascii", "replace")
        origin = await authenticate_request(
            request.requestHeaders.getRawHeaders(b"Authorization"),
            "GET" if method == "HEAD" else method, request.uri.decode("ascii", "replace"), self._server_name,
            content, self._get_verify_key, raw_content=raw,
        )
        self._on_remote_up(origin)
        if "room_id" in params:  # every endpoint that names a room obeys its server ACL
            await self._acl.check(origin, params["room_id"])
        return origin


class ServerKeyServlets:
    """``/version`` and the key server: our keys and, as a notary, other servers' (open to anyone)."""

    def __init__(self, key_response: Callable[[], dict[str, Any]], notary: Notary) -> None:
        self._key_response = key_response
        self._notary = notary

    @route("GET", f"{FED_V1}/version", "federation_version", caller=Caller.NONE)
    async def version(self, call: Call) -> Response:
        return 200, {"server": {"name": "Tributary", "version": __version__}}

    @route("GET", f"{KEY_V2}/server(?:/{_SEG})?", "key_server", caller=Caller.NONE)
    async def key_server(self, call: Call) -> Response:
        return 200, self._key_response()

    @route("POST", f"{KEY_V2}/query", "key_query", caller=Caller.NONE, rate=Rate.KEY_QUERY, body=Body.OBJECT)
    async def key_query(self, call: Call) -> Response:
        return 200, await self._notary.query_body(call.content)

    @route("GET", f"{KEY_V2}/query/(?P<server>{_SEG})(?:/(?P<key_id>{_SEG}))?", "key_query_server",
           caller=Caller.NONE, rate=Rate.KEY_QUERY)
    async def key_query_server(self, call: Call) -> Response:
        params = call.params
        minimum = query_values(call.request.args or {}, "minimum_valid_until_ts")
        if "key_id" in params and not is_valid_key_id(params["key_id"]):
            raise invalid_param(f"{params['key_id'][:100]!r} is not a key ID (algorithm:identifier)")
        return 200, await self._notary.query_server(params["server"], params.get("key_id"), minimum)


ROOM_USER = rf"(?P<room_id>{_SEG})/(?P<user_id>{_SEG})"
ROOM_EVENT = rf"(?P<room_id>{_SEG})/(?P<event_id>{_SEG})"


def _versions(request: Request) -> list[str]:
    return query_values(request.args or {}, "ver", max_length=MAX_VERSION_LENGTH)


class MembershipServlets:
    """make_/send_ leave, knock and join, and invites, for a room's other servers."""

    def __init__(self, membership: MembershipHandler) -> None:
        self._membership = membership

    @route("GET", f"{FED_V1}/make_leave/{ROOM_USER}", "federation_make_leave", caller=Caller.SERVER)
    async def make_leave(self, call: Call) -> Response:
        return 200, await self._membership.make_leave(call.server, call.params["room_id"], call.params["user_id"])

    @route("PUT", f"{FED_V2}/send_leave/{ROOM_EVENT}", "federation_send_leave", caller=Caller.SERVER, body=Body.SIGNED)
    async def send_leave(self, call: Call) -> Response:
        p = call.params
        return 200, await self._membership.send_leave(call.server, p["room_id"], p["event_id"], body_object(call.body))

    @route("GET", f"{FED_V1}/make_knock/{ROOM_USER}", "federation_make_knock", caller=Caller.SERVER)
    async def make_knock(self, call: Call) -> Response:
        p = call.params
        return 200, await self._membership.make_knock(call.server, p["room_id"], p["user_id"], _versions(call.request))

    @route("PUT", f"{FED_V1}/send_knock/{ROOM_EVENT}", "federation_send_knock", caller=Caller.SERVER, body=Body.SIGNED)
    async def send_knock(self, call: Call) -> Response:
        p = call.params
        return 200, await self._membership.send_knock(call.server, p["room_id"], p["event_id"], body_object(call.body))

    @route("PUT", f"{FED_V2}/invite/{ROOM_EVENT}", "federation_invite", caller=Caller.SERVER, body=Body.SIGNED)
    async def invite(self, call: Call) -> Response:
        p = call.params
        return 200, await self._membership.on_invite(call.server, p["room_id"], p["event_id"], invite_body(call.body))

    # (Declared after invites here, before /user/ and /query/ before: the paths do not overlap.)
    @route("GET", f"{FED_V1}/make_join/{ROOM_USER}", "federation_make_join", caller=Caller.SERVER)
    async def make_join(self, call: Call) -> Response:
        p = call.params
        return 200, await self._membership.make_join(call.server, p["room_id"], p["user_id"], _versions(call.request))

    @route("PUT", f"{FED_V2}/send_join/{ROOM_EVENT}", "federation_send_join", caller=Caller.SERVER, body=Body.SIGNED)
    async def send_join(self, call: Call) -> Response:
        p = call.params
        omit = query_bool(call.request.args, "omit_members")
        return 200, await self._membership.send_join(call.server, p["room_id"], p["event_id"], body_object(call.body),
                                                     omit_members=bool(omit))


class DeviceServlets:
    """A local user's devices and their keys, for servers sharing a room with them."""

    def __init__(self, devices: FederationDeviceHandler | None) -> None:
        self._devices = devices

    def _served(self, what: str) -> FederationDeviceHandler:
        if self._devices is None:
            raise not_found(f"{what} are not served by this process")
        return self._devices

    @route("GET", f"{FED_V1}/user/devices/(?P<user_id>{_SEG})", "federation_user_devices", caller=Caller.SERVER)
    async def user_devices(self, call: Call) -> Response:
        return 200, await self._served("devices").user_devices(call.params["user_id"])

    @route("POST", f"{FED_V1}/user/keys/query", "federation_user_keys_query", caller=Caller.SERVER, body=Body.SIGNED)
    async def user_keys_query(self, call: Call) -> Response:
        return 200, await self._served("keys").query_keys(body_object(call.body))

    @route("POST", f"{FED_V1}/user/keys/claim", "federation_user_keys_claim", caller=Caller.SERVER, body=Body.SIGNED)
    async def user_keys_claim(self, call: Call) -> Response:
        return 200, await self._served("keys").claim_keys(body_object(call.body))


class QueryServlets:
    """``/query/profile`` and ``/query/directory``: a local user's profile, a local alias's room."""

    def __init__(self, server_name: str, servers_in_room: Callable[[str], Awaitable[set[str]]],
                 profile_lookup: ProfileLookup | None, alias_lookup: AliasLookup | None) -> None:
        self._server_name = server_name
        self._servers_in_room = servers_in_room
        self._profile_lookup = profile_lookup
        self._alias_lookup = alias_lookup

    @route("GET", f"{FED_V1}/query/profile", "federation_query_profile", caller=Caller.SERVER)
    async def profile(self, call: Call) -> Response:
        query = call.request.args or {}
        user_id = query_required(query, "user_id", is_valid_user_id, "user ID")
        field = query_one(query, "field")
        if self._profile_lookup is None:
            raise not_found("profiles are not served by this process")
        row = await self._profile_lookup(user_id)
        result = {k: v for k, v in (("displayname", row.displayname), ("avatar_url", row.avatar_url)) if v is not None}
        if field is not None:
            result = {k: v for k, v in result.items() if k == field}
        return 200, result

    @route("GET", f"{FED_V1}/query/directory", "federation_query_directory", caller=Caller.SERVER)
    async def directory(self, call: Call) -> Response:
        alias = query_required(call.request.args or {}, "room_alias", is_valid_room_alias, "room alias")
        entry = await self._alias_lookup(alias) if self._alias_lookup is not None else None
        if entry is None:
            raise not_found(f"Room alias {alias} not found")
        ours = self._server_name
        servers = sorted(await self._servers_in_room(entry[0]) | {ours})
        return 200, {"room_id": entry[0], "servers": [ours, *(s for s in servers if s != ours)]}


class TransactionServlets:
    def __init__(self, transactions: TransactionHandler) -> None:
        self._transactions = transactions

    @route("PUT", f"{FED_V1}/send/(?P<txn_id>{_SEG})", "federation_send", caller=Caller.SERVER, body=Body.SIGNED,
           entries=("pdus", "edus"))
    async def send(self, call: Call) -> Response:
        # The transaction handler checks 'pdus' and 'edus' (and counts what it refuses); a PDU or
        # EDU that is not canonical JSON is its own fault, answered or dropped alone.
        return 200, await self._transactions.on_send(call.server, call.params["txn_id"],
                                                     body_object(call.body, "a transaction"), call.refused)


def _event_id_arg(request: Request) -> str:
    return query_required(request.args or {}, "event_id", is_valid_event_id, "event ID")


class HistoryServlets:
    """Events, state and history of rooms we are in, for their other servers."""

    def __init__(self, history: HistoryHandler, acl: ServerAcls) -> None:
        self._history = history
        self._acl = acl

    @route("GET", f"{FED_V1}/event/(?P<event_id>{_SEG})", "federation_event", caller=Caller.SERVER)
    async def get_event(self, call: Call) -> Response:
        await self._acl.check_event(call.server, call.params["event_id"])
        return 200, await self._history.get_event(call.server, call.params["event_id"])

    @route("GET", f"{FED_V1}/state_ids/(?P<room_id>{_SEG})", "federation_state_ids", caller=Caller.SERVER)
    async def state_ids(self, call: Call) -> Response:
        return 200, await self._history.state_ids(call.server, call.params["room_id"], _event_id_arg(call.request))

    @route("GET", f"{FED_V1}/state/(?P<room_id>{_SEG})", "federation_state", caller=Caller.SERVER)
    async def state(self, call: Call) -> Response:
        return 200, await self._history.state(call.server, call.params["room_id"], _event_id_arg(call.request))

    @route("GET", f"{FED_V1}/backfill/(?P<room_id>{_SEG})", "federation_backfill", caller=Caller.SERVER)
    async def backfill(self, call: Call) -> Response:
        query = call.request.args or {}
        limit = query_int(query, "limit", default=10, minimum=1, maximum=MAX_BACKFILL)
        starts = query_list(query, "v", is_valid_event_id, "event ID")
        if not starts:
            raise missing_param("missing the 'v' query parameter (event IDs to backfill from)")
        return 200, await self._history.backfill(call.server, call.params["room_id"], starts, limit)

    @route("POST", f"{FED_V1}/get_missing_events/(?P<room_id>{_SEG})", "federation_get_missing_events",
           caller=Caller.SERVER, body=Body.SIGNED)
    async def missing(self, call: Call) -> Response:
        request_body = missing_events_body(call.body, is_valid_event_id)
        return 200, await self._history.get_missing_events(call.server, call.params["room_id"], request_body)
