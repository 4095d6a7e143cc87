"""The composition root: builds every service of a homeserver process from its config.

``HomeServer.start()`` brings the process up in order (database, schema, keys,
listeners) and marks it ready; ``stop()`` takes it down in reverse: stop
accepting connections, let requests in flight finish (bounded by
``shutdown_grace_period``), close the database pool, stop the embedded
database. Nothing here looks anything up globally: collaborators are built here
and handed down.
"""

# tests: tests/integration/test_process.py

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, Info, PlatformCollector, ProcessCollector
from signedjson.types import SigningKey
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IListeningPort
from twisted.internet.threads import deferToThread
from twisted.web.resource import Resource
from twisted.web.server import Request

from homeserver import __version__
from homeserver.config import HomeserverConfig, ListenerConfig
from homeserver.handlers.account_services import AccountServices
from homeserver.http.client import register_versions
from homeserver.http.client_api import register_client_api_servlets
from homeserver.http.metrics import HttpMetrics
from homeserver.http.server import JsonRouter, make_site
from homeserver.keys import ensure_self_signed_certificate, load_or_create_signing_key
from homeserver.handlers.event_persistence import EventPersister, PersistenceMetrics
from homeserver.handlers.room_events import RoomEventCreator
from homeserver.handlers.room_services import RoomServices
from homeserver.http.client_api.sync import register_room_api_servlets
from homeserver.federation.metrics import FederationMetrics
from homeserver.handlers.metrics import SyncMetrics
from homeserver.metrics import ReactorMetrics, ReactorTickMonitor
from homeserver.federation.servlets import FederationServices, register_federation_servlets
from homeserver.federation.devices import FederationDeviceHandler
from homeserver.federation.edus import register_edu_handlers
from storage.stores.e2e import E2eStore
from federation_sender.metrics import FederationSenderMetrics
from federation_sender.sender import FederationSender
from homeserver.federation.sender_transport import client_transport
from homeserver.handlers.federation_edus import EduSink, OutboundEdus
from homeserver.handlers.auth import TokenCacheInvalidation
from homeserver.handlers.typing import ReplicatedTyping
from homeserver.handlers.presence import SyncTracker
from homeserver.config import MAIN_INSTANCE, ConfigError
from workers.federation import (
    FederationStreamReader,
    FederationStreamSink,
    RemoteEduSink,
    register_main_operations,
)
from workers.forwarding import RoutedPersister, ShardedRoomEventCreator, install_forwarding, register_event_operations
from workers.internal_api import InternalApiClient, InternalApiServer
from workers.layout import Layout
from workers.pruning import StreamPruner
from storage.stores.pruning import PruningStore
from workers.roles import MAIN, WorkerRole, load_role
from replication.commands import JsonValue, UserSyncCommand
from replication.handler import CacheInvalidationHandler, RowHandler
from replication.stream_sources import connect_streams, stream_sources
from replication.transport import ReplicationService, start_replication
from storage.caches import CacheInvalidationStream, CacheRegistry
from storage.database import Database
from storage.id_generators import StreamIdGenerator
from storage.notifier import Notifier
from storage.stores.events import EventsStore
from storage.stores.federation import FederationStore
from storage.stores.federation_sender import FederationSenderStore
from storage.streams import STREAMS, StreamName, create_id_generator
from storage.embedded import EmbeddedPostgres, find_binaries
from storage.metrics import StorageMetrics, StreamMetrics
from storage.prepare import check_server_name, prepare_database
from storage.kernel.background import register_metrics as register_background_metrics, run_in_background

logger = logging.getLogger(__name__)


def new_registry() -> CollectorRegistry:
    """A metrics registry with the process, platform and GC collectors and build info."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    register_background_metrics(registry)
    Info("tributary_build", "Tributary version and Python implementation of this process.", registry=registry).info(
        {"version": __version__}
    )
    return registry


class HomeServer:
    """One process: the main process (``instance_name`` "master") or a worker named in
    ``workers`` whose role (workers/roles.py) decides what it serves."""

    def __init__(self, config: HomeserverConfig, reactor: Any, *, registry: CollectorRegistry | None = None,
                 instance_name: str = MAIN_INSTANCE) -> None:
        self.config = config
        # The name of this process among the writers of streams (and in tokens, metrics, logs).
        self.instance_name = instance_name
        self.layout = Layout(config, instance_name)
        self.role: WorkerRole = MAIN if self.layout.is_main else load_role(self.layout.app)
        self.listeners = config.listeners if self.layout.is_main else config.workers[instance_name].listeners
        self.reactor = reactor
        self.registry = registry if registry is not None else new_registry()
        self.http_metrics = HttpMetrics.create(self.registry)
        self.storage_metrics = StorageMetrics.create(self.registry)
        self.router = JsonRouter(self.http_metrics)
        # Served on listeners with the federation or keys resource (homeserver/federation/).
        self.federation_router = JsonRouter(self.http_metrics)
        # /_tributary/replication/...: what other processes ask of this one (workers/internal_api.py).
        self.internal_router = JsonRouter(self.http_metrics)
        self.internal_api = InternalApiServer(self.internal_router, config.worker_replication_secret)
        self.internal_client: InternalApiClient | None = None
        # Replication consumers that services add before replication starts.
        self._row_handlers: list[RowHandler] = []
        self._remote_up_listeners: list[Callable[[str], None]] = []
        self.pruner: StreamPruner | None = None
        # Who syncs here, for the presence writer (USER_SYNC from workers).
        self.sync_tracker = SyncTracker(reactor, self._report_user_sync)
        self.federation: FederationServices | None = None
        self.federation_sender: FederationSender | None = None
        self.embedded_db: EmbeddedPostgres | None = None
        self.db: Database | None = None
        self.signing_key: SigningKey | None = None
        self.accounts: AccountServices | None = None
        self.rooms: RoomServices | None = None
        self.streams: dict[StreamName, StreamIdGenerator] = {}
        self.notifier = Notifier(reactor)
        self.caches = CacheRegistry()
        self.cache_invalidation: CacheInvalidationStream | None = None
        self.replication: ReplicationService | None = None
        self.events_store: EventsStore | None = None
        self.persister: EventPersister | None = None
        self.room_events: RoomEventCreator | None = None
        self.persistence_metrics = PersistenceMetrics.create(self.registry)
        self.stream_metrics = StreamMetrics.create(self.registry)
        self.reactor_monitor = ReactorTickMonitor(reactor, ReactorMetrics.create(self.registry))
        self.ports: list[IListeningPort] = []
        self.ready = False
        self.stopping = False
        self.started_at: float | None = None

    # --- start ----------------------------------------------------------------------

    async def start(self) -> None:
        start = time.monotonic()
        self.reactor_monitor.start()
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        self.db = await self._open_database()
        applied = await prepare_database(self.db)
        self.storage_metrics.migrations_applied.inc(applied)
        await check_server_name(self.db, self.config.server_name)
        self.signing_key = load_or_create_signing_key(self.config.effective_signing_key_path)
        await self._start_streams()
        self._build_services()
        assert self.rooms is not None
        await self.rooms.room_tokens.start()
        self._build_federation_sender()
        await self._start_replication()
        self._start_pruner()
        if self.federation_sender is not None:
            await self.federation_sender.start()
        self._register_servlets()
        if self.role.start is not None:
            await self.role.start(self)
        for listener in self.listeners:
            self._listen(listener)
        self.ready = True
        self.started_at = time.monotonic()
        logger.info(
            "%s ready in %.2fs (Tributary %s, %s as %s)", self.config.server_name, time.monotonic() - start,
            __version__, self.instance_name, self.role.name,
        )

    async def _open_database(self) -> Database:
        dsn = self.config.database.url
        if dsn is None:
            self.embedded_db = EmbeddedPostgres(self.config.data_dir, find_binaries(self.config.database.embedded.binaries))
            dsn = await deferToThread(self.embedded_db.start)
        db = Database(
            self.reactor,
            dsn,
            metrics=self.storage_metrics,
            min_connections=self.config.database.min_connections,
            max_connections=self.config.database.max_connections,
        )
        db.start()
        self.db = db
        version = await db.check_connection()
        logger.info("connected to PostgreSQL %s%s", version, " (embedded)" if self.embedded_db else "")
        return db

    async def _start_streams(self) -> None:
        """One ID generator per stream; this single process writes every stream."""
        db = self.db
        assert db is not None

        async def create(name: StreamName) -> StreamIdGenerator:
            return await create_id_generator(
                db, self.reactor, STREAMS[name], instance_name=self.instance_name, writers=self.layout.writers(name)
            )

        names = list(StreamName)
        generators = await gatherResults([Deferred.fromCoroutine(create(name)) for name in names], consumeErrors=True)
        for name, generator in zip(names, generators, strict=True):
            self.streams[name] = generator
            self.notifier.add_stream(generator)
            self.stream_metrics.track(generator)
        if self.layout.writes(StreamName.CACHES):
            self.cache_invalidation = CacheInvalidationStream(self.streams[StreamName.CACHES], self.caches, self.reactor)

    async def _start_replication(self) -> None:
        """Tell other processes of every stream fact: over the replication
        listeners (TCP), or the Redis channel when ``redis.enabled``."""
        assert self.db is not None
        listens = any(listener.type == "replication" for listener in self.listeners)
        if not (listens or self.config.redis.enabled or not self.layout.is_main):
            return
        generators = {str(name): generator for name, generator in self.streams.items()}
        self.replication = await start_replication(
            self.reactor,
            self.config,
            self.registry,
            instance_name=self.instance_name,
            sources=stream_sources(STREAMS, generators, self.db),
            writes=[name for name, g in generators.items() if g.instance_name == self.instance_name],
            connect_to=None if self.layout.is_main else self._main_replication_address(),
        )
        handler = self.replication.handler
        handler.add_row_handler(CacheInvalidationHandler(self._invalidate_replicated))
        assert self.rooms is not None and self.federation is not None
        handler.add_row_handler(ReplicatedTyping(self.rooms.typing))
        for row_handler in self._row_handlers:
            handler.add_row_handler(row_handler)
        for listener in self._remote_up_listeners:
            handler.add_remote_server_up_listener(listener)
        if self.layout.writes(StreamName.PRESENCE):
            presence = self.rooms.presence

            def user_sync(command: UserSyncCommand) -> None:
                run_in_background("user_sync", presence.user_syncing(command.instance, command.user_id,
                                                                     command.is_syncing))

            def clear_user_sync(instance: str) -> None:
                run_in_background("clear_user_sync", presence.clear_process(instance))

            handler.add_user_sync_listener(user_sync)
            handler.add_clear_user_sync_listener(clear_user_sync)
        if self.layout.config.federation_sender_instances:
            # Inbound requests prove a server is up: tell the process that sends to it.
            self.federation.remote_up_hooks.append(handler.send_remote_server_up)
        connect_streams(handler, generators)

    def _start_pruner(self) -> None:
        """Stream table pruning (workers/pruning.py): on the background worker, or the main
        process when the layout has none."""
        has_background = any(worker.app == "background" for worker in self.config.workers.values())
        if not (self.role.name == "background" or (self.layout.is_main and not has_background)):
            return
        assert self.db is not None
        pruner = StreamPruner(PruningStore(self.db), self.reactor,
                              federation_senders=self.config.federation_sender_instances)
        if self.replication is not None:
            self.replication.handler.add_federation_ack_listener(pruner.on_federation_ack)
        pruner.start()
        self.pruner = pruner

    def _report_user_sync(self, user_id: str, syncing: bool) -> Any:
        """``SyncTracker``'s report: to the presence handler here, or to its writer by USER_SYNC."""
        if self.layout.writes(StreamName.PRESENCE):
            assert self.rooms is not None
            return Deferred.fromCoroutine(self.rooms.presence.user_syncing(self.instance_name, user_id, syncing))
        if self.replication is not None:
            self.replication.handler.send_user_sync(user_id, None, syncing, int(self.reactor.seconds() * 1000))
        return None

    def _send_federation_ack(self, token: int) -> None:
        if self.replication is not None:
            self.replication.handler.send_federation_ack(token)

    def _main_replication_address(self) -> tuple[str, int] | None:
        """Where a worker reaches the main process over TCP (without Redis): its replication listener."""
        if self.config.redis.enabled:
            return None
        for listener in self.config.listeners:
            if listener.type == "replication":
                main = self.config.instance_map.get(MAIN_INSTANCE)
                host = main.host if main is not None else listener.bind_addresses[0]
                return ("127.0.0.1" if host in ("0.0.0.0", "::") else host), listener.port
        raise ConfigError("listeners", "workers need Redis (redis.enabled) or a replication listener on the main process")

    def _invalidate_replicated(self, cache_name: str, keys: tuple[JsonValue, ...] | None) -> None:
        # Cache keys are tuples of strings; a replicated row carries them as JSON.
        self.caches.invalidate(cache_name, None if keys is None else tuple(str(k) for k in keys))

    def _build_services(self) -> None:
        assert self.db is not None and self.signing_key is not None
        self.events_store = EventsStore(self.db)
        persister = local_persister = EventPersister(
            store=self.events_store,
            stream_ids=self.streams[StreamName.EVENTS],
            server_name=self.config.server_name,
            instance_name=self.instance_name,
            metrics=self.persistence_metrics,
            backfill_ids=self.streams[StreamName.BACKFILL],
        )
        creator_options: dict[str, Any] = dict(
            store=self.events_store,
            server_name=self.config.server_name,
            signing_key=self.signing_key,
            default_room_version=self.config.default_room_version,
            clock_ms=lambda: int(self.reactor.seconds() * 1000),
        )
        sharded: ShardedRoomEventCreator | None = None
        if self.layout.has_workers:
            # Every room's events are written by its owner (workers/forwarding.py).
            client = self.internal_client = InternalApiClient(
                self.reactor, self.layout, self.config.worker_replication_secret
            )
            # Reads stay local; persisting goes to the room's owner (the same interface, duck-typed).
            persister = RoutedPersister(local_persister, self.layout, client)  # type: ignore[assignment]
            sharded = ShardedRoomEventCreator(layout=self.layout, client=client, persister=persister,
                                              **creator_options)
            self.room_events = sharded
        else:
            self.room_events = RoomEventCreator(persister=persister, **creator_options)
        self.persister = persister
        self.accounts = AccountServices.build(
            self.config,
            self.db,
            self.reactor,
            account_data_stream_ids=self.streams[StreamName.ACCOUNT_DATA].get_next,
            instance_name=self.instance_name,
        )
        self.rooms = RoomServices.build(
            db=self.db,
            reactor=self.reactor,
            server_name=self.config.server_name,
            streams=self.streams,
            notifier=self.notifier,
            events_store=self.events_store,
            persister=persister,
            room_events=self.room_events,
            accounts=self.accounts,
            sync_metrics=SyncMetrics.create(self.registry),
        )
        self.federation = FederationServices.build(
            self.config,
            self.reactor,
            signing_key=self.signing_key,
            store=self.events_store,
            persister=persister,
            federation_store=FederationStore(self.db),
            metrics=FederationMetrics.create(self.registry),
        )
        self.rooms.rooms.set_remote_membership(self.federation.membership)
        self.federation.membership.invites = self.rooms.remote_invites
        self.rooms.messages.set_backfill(self.federation.backfill.backfill)
        register_edu_handlers(self.federation.transactions, typing=self.rooms.typing, receipts=self.rooms.receipts,
                              presence=self.rooms.presence, e2e=self.rooms.e2e)
        if self.cache_invalidation is not None:
            stream = self.cache_invalidation

            def revoked(hashes: list[bytes]) -> None:
                run_in_background("stream_revoked_tokens", stream.invalidate_and_stream(
                    TokenCacheInvalidation.name, tuple(digest.hex() for digest in hashes)))

            self.accounts.auth.revoked_hooks.append(revoked)
        self.caches.register(TokenCacheInvalidation(self.accounts.auth))
        if sharded is not None:
            assert self.internal_client is not None
            if self.layout.writes(StreamName.EVENTS):
                register_event_operations(self.internal_api, self.layout, sharded, local_persister)
            install_forwarding(self, self.layout, self.internal_api, self.internal_client)

    def _build_federation_sender(self) -> None:
        """Outbound federation: in the main process (``send_federation``), or in federation
        sender workers, each for the destinations it owns (workers/federation.py)."""
        assert self.db is not None and self.federation is not None and self.events_store is not None
        assert self.rooms is not None
        sends = self.config.send_federation if self.layout.is_main else self.role.sends_federation
        store = self.events_store
        sink: EduSink | None = None
        if sends:
            events = self.streams[StreamName.EVENTS]
            sender = FederationSender(
                server_name=self.config.server_name,
                config=self.config.federation_sender,
                store=FederationSenderStore(self.db),
                transport=client_transport(self.federation.client),
                clock=self.reactor,
                current_position=events.get_current_token,
                metrics=FederationSenderMetrics.create(self.registry),
                joined_servers=store.get_joined_servers,
                should_handle=self.layout.sends_to,
            )
            self.federation_sender = sender
            events.add_position_listener(lambda stream, instance, old, new: sender.notify_new_events(
                events.get_current_token()))
            self.federation.membership.forward = sender.forward
            self.federation.remote_up_hooks.append(sender.notify_remote_server_up)
            # EDUs from the federation stream (sender workers) and outbox wake-ups from other
            # to-device writers (any sender): replication brings both.
            self._row_handlers.append(FederationStreamReader(sender, self._send_federation_ack))
            if self.layout.is_main:
                sink = sender
            else:
                self._remote_up_listeners.append(sender.notify_remote_server_up)
        elif self.layout.writes(StreamName.FEDERATION):
            stream_sink = sink = FederationStreamSink(self.db, self.streams[StreamName.FEDERATION],
                                                      server_name=self.config.server_name,
                                                      joined_servers=store.get_joined_servers)
            self.federation.membership.forward = stream_sink.forward
        elif self.internal_client is not None and any(
            self.layout.writes(s) for s in (StreamName.TYPING, StreamName.RECEIPTS, StreamName.PRESENCE)
        ):
            sink = RemoteEduSink(self.internal_client)  # a worker writing ephemeral streams
        if self.layout.has_workers:
            register_main_operations(self.federation.membership, sink, self.layout, self.internal_api,
                                     self.internal_client)
        if sink is not None:
            sender_store = FederationSenderStore(self.db)
            edus = OutboundEdus(
                server_name=self.config.server_name, sink=sink, joined_servers=store.get_joined_servers,
                sharing_servers=store.get_servers_sharing_rooms, add_to_outbox=sender_store.add_to_outbox,
                clock_ms=lambda: int(self.reactor.seconds() * 1000),
            )
            self.rooms.typing.federation = edus
            self.rooms.receipts.federation = edus
            self.rooms.presence.federation = edus
            self.rooms.e2e.federation = edus

    def _register_servlets(self) -> None:
        """The client and federation servlets this process's role serves."""
        assert self.accounts is not None
        if self.role.servlets == "none":
            return
        router: Any = _RoleRouter(self.router, self.role)
        register_versions(router)
        register_client_api_servlets(router, self.config, self.accounts)
        assert self.rooms is not None
        register_room_api_servlets(router, self.rooms, self.accounts, self.sync_tracker)
        assert self.federation is not None
        assert self.db is not None
        register_federation_servlets(
            _RoleRouter(self.federation_router, self.role),  # type: ignore[arg-type]
            self.federation,
            profile_lookup=self.accounts.profiles.get_profile,
            alias_lookup=self.rooms.timeline.get_alias,
            devices=FederationDeviceHandler(
                server_name=self.config.server_name, store=E2eStore(self.db), e2e=self.rooms.e2e,
                devices=self.accounts.devices.get_devices,
                device_list_position=self.streams[StreamName.DEVICE_LISTS].get_current_token,
            ),
        )

    def _listen(self, listener: ListenerConfig) -> None:
        if listener.type == "replication":
            return  # opened by start_replication
        root = self._root_resource(listener)
        site = make_site(root)
        for address in listener.bind_addresses:
            if listener.tls:
                context = self._tls_context()
                port = self.reactor.listenSSL(listener.port, site, context, interface=address)
            else:
                port = self.reactor.listenTCP(listener.port, site, interface=address)
            self.ports.append(port)
            logger.info("listening for %s on %s:%d%s", listener.type, address, listener.port, " (TLS)" if listener.tls else "")

    def _root_resource(self, listener: ListenerConfig) -> Resource:
        if listener.type == "metrics":
            from prometheus_client.twisted import MetricsResource

            root = Resource()
            root.putChild(b"metrics", MetricsResource(registry=self.registry))  # type: ignore[no-untyped-call]
            root.putChild(b"health", HealthResource(self))
            return root
        if listener.type == "http":
            federation = self.federation_router if {"federation", "keys"} & set(listener.resources) else None
            # A listener without the client resource serves no client API paths.
            main = self.router if "client" in listener.resources else self.federation_router
            internal = self.internal_router if "replication" in listener.resources else None
            return RootResource(main, HealthResource(self) if "health" in listener.resources else None, federation,
                                internal)
        raise ValueError(f"{listener.type} listeners are served by the replication package")

    def _tls_context(self) -> Any:
        # Imported here: pyOpenSSL costs a quarter of a second at start-up,
        # which processes without a TLS listener need not pay.
        from twisted.internet import ssl

        cert_path = self.config.effective_tls_certificate_path
        key_path = self.config.effective_tls_private_key_path
        if self.config.tls_certificate_path is None:
            ensure_self_signed_certificate(cert_path, key_path, self.config.server_name)
        pem = cert_path.read_bytes() + b"\n" + key_path.read_bytes()
        return ssl.PrivateCertificate.loadPEM(pem).options()

    # --- stop -----------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop accepting, finish what is in flight, then release the database. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        self.ready = False
        self.reactor_monitor.stop()
        for port in self.ports:
            stopped = port.stopListening()
            if stopped is not None:
                await stopped
        self.ports.clear()
        grace = self.config.shutdown_grace_period.total_seconds()
        if self.router.in_flight:
            logger.info("waiting up to %.0fs for %d requests in flight", grace, self.router.in_flight)
            drained = self.router.wait_drained()
            drained.addTimeout(grace, self.reactor)
            try:
                await drained
            except Exception:
                logger.warning("%d requests still in flight after %.0fs; stopping anyway", self.router.in_flight, grace)
        if self.pruner is not None:
            self.pruner.stop()
        syncing = self.sync_tracker.stop()
        if self.replication is not None and not self.layout.writes(StreamName.PRESENCE):
            self.replication.handler.send_clear_user_sync()  # the presence writer forgets our users
        elif self.rooms is not None and syncing:
            for user_id in syncing:
                try:
                    await self.rooms.presence.user_syncing(self.instance_name, user_id, False)
                except Exception as e:
                    logger.warning("could not mark %d syncing users offline: %s", len(syncing), e)
                    break
        if self.rooms is not None:
            self.rooms.stop()  # typing timers must not fire into a closed database
        if self.federation_sender is not None:
            await self.federation_sender.stop()
        if self.federation is not None:
            await self.federation.stop()
        if self.internal_client is not None:
            await self.internal_client.close()
        if self.replication is not None:
            replication, self.replication = self.replication, None
            await replication.stop()
        for generator in self.streams.values():
            if generator.instance_name is not None:
                try:
                    await generator.flush()
                except Exception:
                    logger.warning("could not persist the %s stream position on shutdown", generator.stream_name)
        if self.db is not None:
            db, self.db = self.db, None
            await deferToThread(db.close)
        if self.embedded_db is not None:
            embedded, self.embedded_db = self.embedded_db, None
            await deferToThread(embedded.stop)
        logger.info("stopped")


class HealthResource(Resource):
    """``GET /health``: 200 once the process is ready, 503 while starting or stopping."""

    isLeaf = True

    def __init__(self, hs: HomeServer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._hs = hs

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"Content-Type", b"text/plain")
        if self._hs.ready:
            return b"OK"
        request.setResponseCode(503)
        return b"stopping" if self._hs.stopping else b"starting"


class RootResource(Resource):
    """Sends ``/health`` to the health check, ``/_matrix/federation`` and ``/_matrix/key``
    to the federation router (when this listener serves them) and everything else to the JSON router."""

    def __init__(self, router: JsonRouter, health: Resource | None, federation: JsonRouter | None = None,
                 internal: JsonRouter | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._router = router
        self._health = health
        self._federation = federation
        self._internal = internal

    def getChildWithDefault(self, path: bytes, request: Request) -> Resource:
        if path == b"health" and self._health is not None and not request.postpath:
            return self._health
        if path == b"_tributary" and self._internal is not None:
            return self._internal
        if (self._federation is not None and path == b"_matrix" and request.postpath
                and request.postpath[0] in (b"federation", b"key")):
            return self._federation
        # The router matches on request.path as a whole; the traversal state is unused.
        return self._router

    def render(self, request: Request) -> Any:
        return self._router.render(request)


class _RoleRouter:
    """Registers on ``router`` only the servlets ``role`` serves; the rest answer M_UNRECOGNIZED."""

    def __init__(self, router: JsonRouter, role: WorkerRole) -> None:
        self._router = router
        self._role = role

    def register(self, methods: Any, pattern: str, handler: Any, servlet: str) -> None:
        if self._role.serves_servlet(servlet):
            self._router.register(methods, pattern, handler, servlet)
