"""Routes under /_matrix/federation/v1|v2 and /_matrix/key/v2, and the services behind them.

``FederationServices.build`` wires the keyring, client and handlers from the
config; the servlet classes declare the routes (homeserver/http/routes.py), and
``app.py`` declares them on the federation router. The federation listener's gate (homeserver/app.py)
authenticates each ``Caller.SERVER`` route with ``XMatrixAuth``: it reads the signed body, checks
``X-Matrix`` (401 M_UNAUTHORIZED on any failure) and a room's server ACL, and the
handler gets the origin as ``call.server``.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import attrs
from signedjson.types import SigningKey
from twisted.internet.threads import deferToThreadPool
from twisted.web.server import Request

from homeserver import __version__
from homeserver.config import HomeserverConfig
from homeserver.events.server_acl import ServerAcls
from homeserver.remote.request_auth import KeyLookup, authenticate_request
from homeserver.federation.backfill import BackfillHandler
from homeserver.events import FrozenEvent
from homeserver.remote.client import FederationClient, OutboundTimeouts
from homeserver.federation.devices import FederationDeviceHandler
from homeserver.federation.gaps import GapFiller, GapLimits
from homeserver.federation.history import HistoryHandler
from homeserver.federation.keys import Keyring, Notary, NotaryLimits, server_key_response
from homeserver.federation.membership import InviteLimits, MembershipHandler
from homeserver.remote.metrics import FederationMetrics
from homeserver.federation.partial_state import PartialStateResyncer
from homeserver.federation.queries import RemoteQueries
from homeserver.federation.transaction import TransactionHandler
from storage.kernel.ratelimit import Ratelimiter
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister
from homeserver.handlers.rooms.partial_state import PartialRooms
from homeserver.handlers.rooms.remote_invites import RemoteInvites
from homeserver.handlers.writers import InviteWriter
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
from storage.stores.events import EventsStore
from storage.stores.federation import FederationStore
from storage.stores.partial_state import PartialStateStore
from storage.stores.room_state import RoomStateStore

FED_V1 = "/_matrix/federation/v1"
FED_V2 = "/_matrix/federation/v2"
KEY_V2 = "/_matrix/key/v2"
_SEG = "[^/]+"
# Room version identifiers in make_join's ``ver`` are short ("12", "org.matrix.msc...").
MAX_VERSION_LENGTH = 64


@attrs.define
class FederationServices:
    server_name: str
    signing_key: SigningKey
    clock_ms: Callable[[], int]
    client: FederationClient
    keyring: Keyring
    notary: Notary
    # Inbound key queries, per requesting address (federation_limits.rc_key_query).
    key_query_limiter: Ratelimiter
    transactions: TransactionHandler
    membership: MembershipHandler
    history: HistoryHandler
    backfill: BackfillHandler
    acl: ServerAcls
    # Fetches the full state of rooms joined with partial state (partial_state.py).
    partial_resync: PartialStateResyncer
    # Called with the origin of every authenticated inbound request: the server is up
    # (the federation sender clears its backoff and wakes its queue).
    on_remote_up: Callable[[str], None]

    @classmethod
    def build(
        cls,
        config: HomeserverConfig,
        reactor: Any,
        *,
        client: FederationClient,
        signing_key: SigningKey,
        store: EventsStore,
        persister: EventPersister,
        loader: EventLoader,
        federation_store: FederationStore,
        room_state: RoomStateStore,
        partial_state: PartialStateStore,
        metrics: FederationMetrics,
        invites: RemoteInvites,
        invite_writer: InviteWriter,
        forward: Callable[[FrozenEvent, str], None] | None,
        on_remote_up: Callable[[str], None],
    ) -> FederationServices:
        server_name = config.server_name
        limits = config.federation_limits
        key_fetch_timeout = limits.key_fetch_timeout.total_seconds()

        def clock_ms() -> int:
            return int(reactor.seconds() * 1000)

        async def fetch_direct(server: str) -> Any:
            return await client.get_json(server, f"{KEY_V2}/server", signed=False, timeout=key_fetch_timeout)

        async def fetch_notary(notary: str, server: str, key_ids: Any) -> Any:
            body: dict[str, Any] = {"server_keys": {server: {k: {} for k in key_ids}}}
            return await client.post_json(notary, f"{KEY_V2}/query", body, signed=False, timeout=key_fetch_timeout)

        acl = ServerAcls(store=store, loader=loader)
        keyring = Keyring(server_name=server_name, signing_key=signing_key, clock_ms=clock_ms,
                          fetch_direct=fetch_direct, fetch_notary=fetch_notary, key_store=federation_store,
                          notaries=config.federation.trusted_key_servers, concurrency=limits.max_concurrent_fetches)
        notary = Notary(keyring=keyring, server_name=server_name, signing_key=signing_key, clock_ms=clock_ms,
                        reactor=reactor, limits=NotaryLimits(max_servers=limits.key_query_max_servers,
                                                             concurrency=limits.max_concurrent_fetches,
                                                             timeout=limits.key_query_timeout.total_seconds()))
        gaps = GapFiller(store=store, loader=loader, persister=persister, keyring=keyring, client=client,
                         metrics=metrics, limiter=Ratelimiter.from_config(limits.rc_missing_events),
                         clock=lambda: float(reactor.seconds()),
                         limits=GapLimits(max_events=limits.missing_events_max,
                                          concurrency=limits.max_concurrent_fetches))
        run_in_thread = _thread_runner(reactor)
        resyncer = PartialStateResyncer(server_name=server_name, partial=partial_state, store=store, loader=loader,
                                        persister=persister, keyring=keyring, client=client, clock=reactor,
                                        metrics=metrics, run_in_thread=run_in_thread)
        partial_rooms = PartialRooms(partial_state, reactor)
        resyncer.on_complete.append(partial_rooms.invalidate)

        def on_partial_join(room_id: str) -> None:
            partial_rooms.invalidate()
            resyncer.start(room_id)
        return cls(
            server_name=server_name, signing_key=signing_key, clock_ms=clock_ms, client=client, keyring=keyring,
            notary=notary, key_query_limiter=Ratelimiter.from_config(limits.rc_key_query),
            transactions=TransactionHandler(server_name=server_name, store=store, persister=persister, loader=loader,
                                            keyring=keyring, client=client, txn_store=federation_store,
                                            clock_ms=clock_ms, metrics=metrics, gaps=gaps, acl=acl,
                                            partial_rooms=partial_rooms.is_partial,
                                            run_in_thread=_thread_runner(reactor)),
            membership=MembershipHandler(server_name=server_name, signing_key=signing_key, store=store,
                                         room_state=room_state,
                                         persister=persister, loader=loader, keyring=keyring, client=client,
                                         clock_ms=clock_ms, invites=invites, invite_writer=invite_writer,
                                         forward=forward, invite_limits=InviteLimits.from_config(
                                             config.rc_invites, lambda: float(reactor.seconds())),
                                         run_in_thread=run_in_thread,
                                         partial_joins=config.federation.partial_state_joins,
                                         on_partial_join=on_partial_join, is_partial=partial_rooms.is_partial),
            history=HistoryHandler(server_name=server_name, store=store, loader=loader, clock_ms=clock_ms,
                                   is_partial=partial_rooms.is_partial),
            backfill=BackfillHandler(server_name=server_name, store=store, persister=persister, loader=loader,
                                     keyring=keyring,
                                     client=client),
            acl=acl,
            partial_resync=resyncer,
            on_remote_up=on_remote_up,
        )

    async def stop(self) -> None:
        self.partial_resync.stop()
        await self.client.close()

    # --- key server --------------------------------------------------------------------

    def key_response(self) -> dict[str, Any]:
        return server_key_response(self.server_name, self.signing_key, self.clock_ms())


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

    @route("PUT", f"{FED_V1}/send/(?P<txn_id>{_SEG})", "federation_send", caller=Caller.SERVER, body=Body.SIGNED)
    async def send(self, call: Call) -> Response:
        # The transaction handler checks 'pdus' and 'edus' (and counts what it refuses).
        return 200, await self._transactions.on_send(call.server, call.params["txn_id"],
                                                     body_object(call.body, "a transaction"))


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




def _thread_runner(reactor: Any) -> Callable[..., Coroutine[Any, Any, Any]]:
    """Runs a function on the reactor's thread pool (CPU-bound checks, off the reactor thread)."""

    async def run(func: Callable[..., Any], *args: Any) -> Any:
        return await deferToThreadPool(reactor, reactor.getThreadPool(), func, *args)

    return run


def build_federation_client(config: HomeserverConfig, reactor: Any, signing_key: SigningKey,
                            metrics: FederationMetrics) -> FederationClient:
    """The one outbound federation client of a process (requests, the sender's transactions, keys)."""
    limits = config.federation_limits
    timeouts = OutboundTimeouts(
        dns=limits.dns_timeout.total_seconds(), well_known=limits.well_known_timeout.total_seconds(),
        connect=limits.connect_timeout.total_seconds(), tls=limits.tls_timeout.total_seconds(),
        request=limits.request_timeout.total_seconds(), body=limits.body_timeout.total_seconds(),
    )
    return FederationClient(
        reactor, server_name=config.server_name, signing_key=signing_key,
        verify_certificates=config.federation.verify_certificates,
        ip_range_whitelist=config.federation.ip_range_whitelist, timeouts=timeouts, metrics=metrics,
    )


def build_remote_queries(config: HomeserverConfig, reactor: Any, client: FederationClient) -> RemoteQueries:
    """Remote profile and alias lookups for our clients, cached as ``federation_limits`` says."""
    limits = config.federation_limits
    return RemoteQueries(client, clock=reactor.seconds, cache_ttl=limits.query_cache_ttl.total_seconds(),
                         cache_size=limits.query_cache_size)
