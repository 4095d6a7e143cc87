"""The federation services of one process: the keyring, the notary, the inbound transaction,
membership, history and backfill handlers, and the outbound client they share, built from
the config (``FederationServices.build``); ``app.py`` hands each servlet the ones it calls."""

# tests: tests/integration/test_federation.py

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import attrs
from signedjson.types import SigningKey
from twisted.internet.threads import deferToThreadPool

from homeserver.config import HomeserverConfig
from homeserver.events.server_acl import ServerAcls
from homeserver.federation.backfill import BackfillHandler
from homeserver.events import FrozenEvent
from homeserver.remote.client import FederationClient, OutboundTimeouts
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
