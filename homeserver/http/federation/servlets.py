"""Routes under /_matrix/federation/v1|v2 and /_matrix/key/v2, and the services behind them.

``FederationServices.build`` wires the keyring, client and handlers from the
config; ``register_federation_servlets`` adds the routes to a router. Each
authenticated route reads the body, checks ``X-Matrix`` (401 M_UNAUTHORIZED on
any failure) and calls a handler with the origin.
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
from homeserver.remote.request_auth import authenticate_request
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
from homeserver.handlers.accounts.auth import client_ip
from storage.kernel.ratelimit import Ratelimiter, ratelimit
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
from homeserver.http.server import FEDERATION_JSON, Routes, parse_json_object, read_json_body
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

    def check_key_query_rate(self, request: Request) -> None:
        """429 ``M_LIMIT_EXCEEDED`` when the requesting address asks for keys too often."""
        ratelimit(self.key_query_limiter, client_ip(request) or "-", self.clock_ms() / 1000)


Authed = Callable[[str, Request, Mapping[str, str], Any], Awaitable[tuple[int, Any]]]


ProfileLookup = Callable[[str], Awaitable[Any]]
"""``user_id -> row`` with ``displayname`` and ``avatar_url``; raises ``MatrixError`` 404 when unknown."""


AliasLookup = Callable[[str], Awaitable[tuple[str, str] | None]]
"""``#alias:server -> (room_id, creator)`` from the local alias directory, or None."""


def register_authed(router: Routes, fed: FederationServices, method: str, pattern: str, handler: Authed,
                    servlet: str, *, has_body: bool = False) -> None:
    """Route ``method`` ``pattern`` to ``handler(origin, request, params, body)`` once the request's
    ``X-Matrix`` signature is checked (401 otherwise) and, for a path naming a room, its server ACL."""

    async def wrapped(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        content, raw = read_json_body(request, FEDERATION_JSON) if has_body else (None, None)
        origin = await authenticate_request(
            request.requestHeaders.getRawHeaders(b"Authorization"),
            method, request.uri.decode("ascii", "replace"), fed.server_name, content,
            fed.keyring.get_verify_key, raw_content=raw,
        )
        fed.on_remote_up(origin)
        if "room_id" in params:  # every endpoint that names a room obeys its server ACL
            await fed.acl.check(origin, params["room_id"])
        return await handler(origin, request, params, content)

    router.register([method], pattern, wrapped, servlet)


def register_federation_servlets(router: Routes, fed: FederationServices, *,
                                 profile_lookup: ProfileLookup | None = None,
                                 alias_lookup: AliasLookup | None = None,
                                 devices: FederationDeviceHandler | None = None) -> None:
    async def version(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, {"server": {"name": "Tributary", "version": __version__}}

    async def key_server(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, fed.key_response()

    async def key_query(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        fed.check_key_query_rate(request)
        return 200, await fed.notary.query_body(parse_json_object(request, FEDERATION_JSON))

    async def key_query_server(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        fed.check_key_query_rate(request)
        minimum = query_values(request.args or {}, "minimum_valid_until_ts")
        if "key_id" in params and not is_valid_key_id(params["key_id"]):
            raise invalid_param(f"{params['key_id'][:100]!r} is not a key ID (algorithm:identifier)")
        return 200, await fed.notary.query_server(params["server"], params.get("key_id"), minimum)

    router.register(["GET"], f"{FED_V1}/version", version, "federation_version")
    router.register(["GET"], f"{KEY_V2}/server(?:/{_SEG})?", key_server, "key_server")
    router.register(["POST"], f"{KEY_V2}/query", key_query, "key_query")
    router.register(["GET"], f"{KEY_V2}/query/(?P<server>{_SEG})(?:/(?P<key_id>{_SEG}))?", key_query_server,
                    "key_query_server")

    def authed(method: str, pattern: str, handler: Authed, servlet: str, *, has_body: bool = False) -> None:
        register_authed(router, fed, method, pattern, handler, servlet, has_body=has_body)

    def versions(request: Request) -> list[str]:
        return query_values(request.args or {}, "ver", max_length=MAX_VERSION_LENGTH)

    async def send(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        # The transaction handler checks 'pdus' and 'edus' (and counts what it refuses).
        return 200, await fed.transactions.on_send(origin, p["txn_id"], body_object(body, "a transaction"))

    async def make_join(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.membership.make_join(origin, p["room_id"], p["user_id"], versions(request))

    async def send_join(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        omit = query_bool(request.args, "omit_members")
        return 200, await fed.membership.send_join(origin, p["room_id"], p["event_id"], body_object(body),
                                                   omit_members=bool(omit))

    async def get_event(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        await fed.acl.check_event(origin, p["event_id"])
        return 200, await fed.history.get_event(origin, p["event_id"])

    def event_id_arg(request: Request) -> str:
        return query_required(request.args or {}, "event_id", is_valid_event_id, "event ID")

    async def state_ids(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.history.state_ids(origin, p["room_id"], event_id_arg(request))

    async def state(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.history.state(origin, p["room_id"], event_id_arg(request))

    async def backfill(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        query = request.args or {}
        limit = query_int(query, "limit", default=10, minimum=1, maximum=MAX_BACKFILL)
        starts = query_list(query, "v", is_valid_event_id, "event ID")
        if not starts:
            raise missing_param("missing the 'v' query parameter (event IDs to backfill from)")
        return 200, await fed.history.backfill(origin, p["room_id"], starts, limit)

    async def missing(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        request_body = missing_events_body(body, is_valid_event_id)
        return 200, await fed.history.get_missing_events(origin, p["room_id"], request_body)

    async def make_leave(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.membership.make_leave(origin, p["room_id"], p["user_id"])

    async def send_leave(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.membership.send_leave(origin, p["room_id"], p["event_id"], body_object(body))

    async def invite(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.membership.on_invite(origin, p["room_id"], p["event_id"], invite_body(body))

    async def make_knock(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.membership.make_knock(origin, p["room_id"], p["user_id"], versions(request))

    async def send_knock(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        return 200, await fed.membership.send_knock(origin, p["room_id"], p["event_id"], body_object(body))

    async def profile(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        query = request.args or {}
        user_id = query_required(query, "user_id", is_valid_user_id, "user ID")
        field = query_one(query, "field")
        if profile_lookup is None:
            raise not_found("profiles are not served by this process")
        row = await profile_lookup(user_id)
        result = {k: v for k, v in (("displayname", row.displayname), ("avatar_url", row.avatar_url)) if v is not None}
        if field is not None:
            result = {k: v for k, v in result.items() if k == field}
        return 200, result

    authed("GET", f"{FED_V1}/make_leave/(?P<room_id>{_SEG})/(?P<user_id>{_SEG})", make_leave, "federation_make_leave")
    authed("PUT", f"{FED_V2}/send_leave/(?P<room_id>{_SEG})/(?P<event_id>{_SEG})", send_leave,
           "federation_send_leave", has_body=True)
    authed("GET", f"{FED_V1}/make_knock/(?P<room_id>{_SEG})/(?P<user_id>{_SEG})", make_knock, "federation_make_knock")
    authed("PUT", f"{FED_V1}/send_knock/(?P<room_id>{_SEG})/(?P<event_id>{_SEG})", send_knock,
           "federation_send_knock", has_body=True)
    authed("PUT", f"{FED_V2}/invite/(?P<room_id>{_SEG})/(?P<event_id>{_SEG})", invite, "federation_invite",
           has_body=True)
    async def directory(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        alias = query_required(request.args or {}, "room_alias", is_valid_room_alias, "room alias")
        entry = await alias_lookup(alias) if alias_lookup is not None else None
        if entry is None:
            raise not_found(f"Room alias {alias} not found")
        servers = sorted(await fed.membership.servers_in_room(entry[0]) | {fed.server_name})
        return 200, {"room_id": entry[0], "servers": [fed.server_name, *(s for s in servers if s != fed.server_name)]}

    async def user_devices(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        if devices is None:
            raise not_found("devices are not served by this process")
        return 200, await devices.user_devices(p["user_id"])

    async def user_keys_query(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        if devices is None:
            raise not_found("keys are not served by this process")
        return 200, await devices.query_keys(body_object(body))

    async def user_keys_claim(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        if devices is None:
            raise not_found("keys are not served by this process")
        return 200, await devices.claim_keys(body_object(body))

    authed("GET", f"{FED_V1}/user/devices/(?P<user_id>{_SEG})", user_devices, "federation_user_devices")
    authed("POST", f"{FED_V1}/user/keys/query", user_keys_query, "federation_user_keys_query", has_body=True)
    authed("POST", f"{FED_V1}/user/keys/claim", user_keys_claim, "federation_user_keys_claim", has_body=True)
    authed("GET", f"{FED_V1}/query/profile", profile, "federation_query_profile")
    authed("GET", f"{FED_V1}/query/directory", directory, "federation_query_directory")
    authed("PUT", f"{FED_V1}/send/(?P<txn_id>{_SEG})", send, "federation_send", has_body=True)
    authed("GET", f"{FED_V1}/make_join/(?P<room_id>{_SEG})/(?P<user_id>{_SEG})", make_join, "federation_make_join")
    authed("PUT", f"{FED_V2}/send_join/(?P<room_id>{_SEG})/(?P<event_id>{_SEG})", send_join,
           "federation_send_join", has_body=True)
    authed("GET", f"{FED_V1}/event/(?P<event_id>{_SEG})", get_event, "federation_event")
    authed("GET", f"{FED_V1}/state_ids/(?P<room_id>{_SEG})", state_ids, "federation_state_ids")
    authed("GET", f"{FED_V1}/state/(?P<room_id>{_SEG})", state, "federation_state")
    authed("GET", f"{FED_V1}/backfill/(?P<room_id>{_SEG})", backfill, "federation_backfill")
    authed("POST", f"{FED_V1}/get_missing_events/(?P<room_id>{_SEG})", missing, "federation_get_missing_events",
           has_body=True)


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
