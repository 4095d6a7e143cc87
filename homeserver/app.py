"""The composition root: builds one homeserver process from its config, in stages.

``HomeServer.start()`` opens the database, then builds frozen bundles in order,
each from the ones before it and nothing else:

1. ``Storage``: the database (embedded or at ``database.url``), migrated and
   checked, and the signing key;
2. ``Streams``: one ID generator per stream, the notifier and the caches;
3. replication (when the layout needs it), started here so that the
   services below can be handed its signals; they register their row
   handlers before the reactor runs again, so no row is missed;
4. ``Services``: accounts, event persistence, outbound federation (the sender,
   or the sink that hands EDUs to the process that sends), the federation
   handlers and the room handlers, each built with its collaborators as
   constructor arguments; single-writer streams are written through
   ``Writers`` (``routing/writers.py``), local or remote as the layout says;
5. ``Process``: the above plus what runs (servlets, role hooks, listeners).

``stop()`` takes it down in reverse: stop accepting connections, let requests in
flight finish (bounded by ``shutdown_grace_period``), stop what runs, close the
pool, stop the embedded database. Nothing here looks anything up globally, and
nothing is wired by setting attributes after construction. Worker roles are
plug-ins found by name (``homeserver/roles.py``); this module imports none.
"""

# tests: tests/integration/test_process.py

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, TypeVar

import attrs
from prometheus_client import CollectorRegistry, GCCollector, Info, PlatformCollector, ProcessCollector
from signedjson.types import SigningKey
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IListeningPort
from twisted.internet.threads import deferToThread
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from federation_sender.metrics import FederationSenderMetrics
from federation_sender.sender import FederationSender
from homeserver import __version__
from homeserver.admin.guard import AdminGuard
from homeserver.admin.console import ConsoleServlets
from homeserver.admin.servlets import AdminApi
from homeserver.admin.tasks import TaskTracker
from homeserver.config import MAIN_INSTANCE, ConfigError, HomeserverConfig, ListenerConfig
from homeserver.events import FrozenEvent
from homeserver.events.server_acl import ServerAcls
from homeserver.federation.devices import FederationDeviceHandler, FederationKeyClient
from homeserver.handlers.accounts.deactivate import DeactivationHandler
from homeserver.handlers.sync.legacy_sync import LegacySyncHandler
from homeserver.federation.edus import register_edu_handlers
from homeserver.remote.metrics import FederationMetrics
from homeserver.federation.sender_transport import client_transport
from homeserver.http.federation.directory import FederationDirectoryServlets
from homeserver.http.federation.servlets import DeviceServlets as FederationDeviceServlets
from homeserver.http.federation.servlets import HistoryServlets as FederationHistoryServlets
from homeserver.wiring.federation import FederationServices, build_federation_client, build_remote_queries
from homeserver.http.federation.servlets import (
    MembershipServlets,
    QueryServlets,
    ServerKeyServlets,
    TransactionServlets,
    XMatrixAuth,
)
from homeserver.wiring.accounts import AccountServices
from homeserver.handlers.accounts.auth import TokenCacheInvalidation
from homeserver.handlers.rooms.event_loader import EventCacheMetrics, EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister, PersistenceMetrics
from homeserver.handlers.ephemeral.federation_edus import EduSink, OutboundEdus
from homeserver.handlers.sync.metrics import SyncMetrics
from homeserver.handlers.ephemeral.presence import SyncTracker
from homeserver.handlers.push.push import PushActionsEvaluator, PushersHandler
from storage.kernel.ratelimit import Ratelimiter
from homeserver.handlers.rooms.remote_invites import RemoteInvites
from homeserver.handlers.rooms.room_events import RoomEventCreator
from homeserver.wiring.rooms import RoomServices
from homeserver.handlers.ephemeral.typing import ReplicatedTyping
from homeserver.http.client_api.versions import VersionsServlet
from homeserver.http.client_api.account import DeactivateServlet, LoginServlets, RegistrationServlets
from homeserver.http.client_api.account_data import AccountDataServlets
from homeserver.http.client_api.appservice import AppServiceServlets
from homeserver.http.client_api.devices import DeviceServlets
from homeserver.http.client_api.directory import DirectoryServlets
from homeserver.http.client_api.e2e import CrossSigningServlets, KeysServlets, PresenceServlets, ToDeviceServlets
from homeserver.http.client_api.key_backup import KeyBackupServlets
from homeserver.http.client_api.profile import ProfileServlets
from homeserver.http.client_api.relations import RelationsServlets
from homeserver.http.client_api.room_upgrade import RoomUpgradeServlet
from homeserver.http.client_api.rooms import EphemeralServlets, HistoryServlets, RedactionServlet, RoomServlets
from homeserver.http.client_api.search import SearchServlet
from homeserver.http.client_api.server_info import ServerInfoServlets
from homeserver.http.client_api.sliding_sync import SlidingSyncServlet
from homeserver.http.client_api.sync import LegacySyncServlets, SyncServlet
from homeserver.http.client_api.threepid import ThreepidServlets
from homeserver.http.routes import Gate, Rate, declare
from homeserver.http.client_api.push import PushersServlets, PushRulesServlets
from homeserver.http.client_api.media import (
    MediaAdminServlets,
    register_legacy_download_for_federation,
    register_media_servlets,
)
from homeserver.http.federation.media import register_federation_media_servlets
from homeserver.media.metrics import MediaMetrics
from homeserver.media.preview import UrlPreviewer
from homeserver.media.remote import RemoteMediaFetcher
from homeserver.media.repository import MediaRepository, start_media_retention
from homeserver.media.storage import LocalDiskStorage
from storage.stores.media import MediaStore
from homeserver.http.metrics import HttpMetrics
from homeserver.http.server import FEDERATION_JSON, Handler, JsonRouter, make_site
from homeserver.keys import ensure_self_signed_certificate, load_or_create_signing_key, load_tls_options
from homeserver.metrics import ReactorMetrics, ReactorTickMonitor
from homeserver.config import known_roles
from homeserver.roles import MAIN, RoleContext, RoleHook, Stoppable, WorkerRole, load_role
from homeserver.routing.federation import (
    FederationStreamReader,
    FederationStreamSink,
    RemoteEduSink,
    forward_to_main,
    register_main_operations,
)
from homeserver.routing.forwarding import (
    MAX_INTERNAL_JOIN_BYTES,
    RoutedPersister,
    ShardedRoomEventCreator,
    register_event_operations,
)
from homeserver.routing.internal_api import PREFIX as INTERNAL_PREFIX
from homeserver.routing.internal_api import InternalApiClient, InternalApiServer
from homeserver.routing.layout import Layout
from homeserver.handlers.writers import Writers
from homeserver.routing.writers import build_writers, choose_invite_writer, register_writer_operations
from replication.commands import JsonValue, UserSyncCommand
from replication.handler import CacheInvalidationHandler
from replication.stream_sources import connect_streams, stream_sources
from replication.service import ReplicationService, start_replication
from storage.cache_invalidation import CacheInvalidationStream
from storage.caches import CacheRegistry
from storage.database import Database
from storage.embedded import EmbeddedPostgres, find_binaries
from storage.embedded_supervisor import EmbeddedSupervisor
from storage.id_generators import StreamIdGenerator
from storage.kernel.background import register_metrics as register_background_metrics
from storage.kernel.background import run_in_background
from storage.stores.partial_state import PartialStateStore
from storage.kernel.written_events import KeyNotes, ReplicatedEventNotes, ReplicatedKeyNotes, WrittenEvents
from storage.metrics import StorageMetrics, StreamMetrics
from storage.notifier import Notifier
from storage.tokens import SyncStreamKey
from storage.prepare import apply_migrations, check_server_name, current_schema_version, prepare_database
from storage.stores.admin import AdminStore
from storage.stores.e2e import E2eStore
from storage.stores.events import EventsStore
from storage.stores.federation import FederationStore
from storage.stores.room_state import RoomStateStore
from storage.stores.federation_sender import FederationSenderStore
from storage.stores.push import PushStore
from storage.stores.remote_invites import RemoteInviteStore
from storage.streams import STREAMS, StreamName, create_id_generator

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


# --- the stages ------------------------------------------------------------------------------


@attrs.frozen
class Storage:
    db: Database
    # The embedded PostgreSQL this process started (no ``database.url``), stopped after the pool.
    embedded: EmbeddedPostgres | None
    signing_key: SigningKey


@attrs.frozen
class Streams:
    generators: Mapping[StreamName, StreamIdGenerator]
    notifier: Notifier
    caches: CacheRegistry
    # Where this process tells others to drop cache entries (it writes the caches stream), if it does.
    cache_invalidation: CacheInvalidationStream | None


@attrs.frozen
class Outbound:
    """Outbound federation as this process takes part in it."""

    # This process's sender, when it sends to some destinations.
    sender: FederationSender | None
    # Where typing, receipts, presence and to-device EDUs go (None: this process causes none).
    edus: OutboundEdus | None
    # Where remote members' events we accepted as the resident server go.
    forward: Callable[[FrozenEvent, str], None] | None
    # The sink behind ``edus`` (the sender, or the stream/process that hands EDUs to it).
    sink: EduSink | None


@attrs.frozen
class Services:
    events_store: EventsStore
    persister: EventPersister
    room_events: RoomEventCreator
    accounts: AccountServices
    federation: FederationServices
    rooms: RoomServices
    writers: Writers
    outbound: Outbound
    sync_tracker: SyncTracker
    # A remote server is up (it contacted us, or an admin reset its backoff): send to it now.
    remote_up: Callable[[str], None]
    # Handlers only servlets call: built here with the others, not while servlets are registered.
    pushers: PushersHandler
    deactivation: DeactivationHandler
    legacy_sync: LegacySyncHandler
    federation_devices: FederationDeviceHandler
    # The media repository, on the one process that serves media (homeserver/media/).
    media: MediaRepository | None = None


@attrs.frozen
class Process:
    """Everything one running process is made of; ``HomeServer.process`` once started."""

    storage: Storage
    streams: Streams
    replication: ReplicationService | None
    services: Services
    internal_client: InternalApiClient | None
    # What the role hooks started (periodic jobs), stopped first.
    jobs: tuple[Stoppable, ...]

    # The services tests and tools use most, by name.
    @property
    def db(self) -> Database:
        return self.storage.db

    @property
    def signing_key(self) -> SigningKey:
        return self.storage.signing_key

    @property
    def notifier(self) -> Notifier:
        return self.streams.notifier

    @property
    def events_store(self) -> EventsStore:
        return self.services.events_store

    @property
    def persister(self) -> EventPersister:
        return self.services.persister

    @property
    def room_events(self) -> RoomEventCreator:
        return self.services.room_events

    @property
    def accounts(self) -> AccountServices:
        return self.services.accounts

    @property
    def rooms(self) -> RoomServices:
        return self.services.rooms

    @property
    def federation(self) -> FederationServices:
        return self.services.federation

    @property
    def federation_sender(self) -> FederationSender | None:
        return self.services.outbound.sender


class NotStarted(RuntimeError):
    pass


class HomeServer:
    """One process: the main process (``instance_name`` "master") or a worker named in
    ``workers`` whose role (a plug-in, ``homeserver/roles.py``) decides what it serves."""

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
        # /_tributary/replication/...: what other processes ask of this one (routing/internal_api.py).
        self.internal_router = JsonRouter(self.http_metrics)
        self.internal_api = InternalApiServer(self.internal_router, config.worker_replication_secret)
        # /_synapse/admin/... (the main process only; homeserver/admin/), on listeners with the
        # client or admin resource, and the operator console on those with the admin resource.
        self.admin_router = JsonRouter(self.http_metrics)
        self.console_router = JsonRouter(self.http_metrics)
        self.admin_tasks = TaskTracker()
        self.persistence_metrics = PersistenceMetrics.create(self.registry)
        # What this process persisted at recent events-stream positions: its own readers of the
        # stream (fan-out, user directory) skip queries over ranges it knows hold nothing for them.
        self.written_events = WrittenEvents()
        # What each recent position of these streams is about, rooms or users (their writers
        # here note them, or replication does).
        self.key_notes = {key: KeyNotes() for key in (SyncStreamKey.RECEIPTS, SyncStreamKey.TYPING,
                                                      SyncStreamKey.TO_DEVICE, SyncStreamKey.ACCOUNT_DATA)}
        self.stream_metrics = StreamMetrics.create(self.registry)
        self.reactor_monitor = ReactorTickMonitor(reactor, ReactorMetrics.create(self.registry))
        self.ports: list[IListeningPort] = []
        self.ready = False
        self.stopping = False
        self.started_at: float | None = None
        # The built process, between start() and stop(); a database opened by a start()
        # that failed half way is kept here so that stop() still closes it.
        self._process: Process | None = None
        self._opened: Storage | None = None
        # What ``with_database`` applied (``NNNN_name``), for the tools to report.
        self.last_migrations: tuple[str, ...] = ()
        # Restarts the embedded PostgreSQL when it dies (running ones only: not for the tools).
        self._supervisor: EmbeddedSupervisor | None = None
        # Set when the process must end on its own (supervision gave up): cli.py exits with it.
        self.fatal_error: str | None = None

    @property
    def process(self) -> Process:
        if self._process is None:
            raise NotStarted(f"{self.instance_name} is not running: call start() first")
        return self._process

    # --- start ----------------------------------------------------------------------

    async def start(self) -> None:
        start = time.monotonic()
        self.reactor_monitor.start()
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        storage = self._opened = await self._open_storage()
        streams = await self._build_streams(storage.db)
        replication = await self._start_replication(storage.db, streams)
        internal_client = (InternalApiClient(self.reactor, self.layout, self.config.worker_replication_secret)
                           if self.layout.has_workers else None)
        services = self._build_services(storage, streams, replication, internal_client)
        if replication is not None:
            self._connect_replication(replication, streams, services)
        await services.rooms.room_tokens.start()
        if services.outbound.sender is not None:
            await services.outbound.sender.start()
        self._register_servlets(storage, streams, services)
        if self.layout.is_main:
            await self.admin_tasks.resume()
        jobs = await self._start_jobs(storage, streams, replication)
        if services.media is not None:
            jobs += (start_media_retention(services.media, self.reactor),)
        self._process = Process(storage=storage, streams=streams, replication=replication, services=services,
                                internal_client=internal_client, jobs=jobs)
        for listener in self.listeners:
            self._listen(listener)
        if self.layout.is_main:
            # Rooms joined with partial state before a restart: their resync starts again here,
            # and, every ten minutes, that of rooms still partial after ten minutes.
            run_in_background("partial_state_resume", services.federation.partial_resync.resume())
            services.federation.partial_resync.sweep()
        self.ready = True
        self.started_at = time.monotonic()
        logger.info(
            "%s ready in %.2fs (Tributary %s, %s as %s)", self.config.server_name, time.monotonic() - start,
            __version__, self.instance_name, self.role.name,
        )

    async def _open_database(self) -> tuple[Database, EmbeddedPostgres | None]:
        """The database (the embedded one started first when there is no ``database.url``), connected."""
        dsn = self.config.database.url
        embedded = None
        if dsn is None:
            embedded = EmbeddedPostgres(self.config.data_dir, find_binaries(self.config.database.embedded.binaries))
            dsn = await deferToThread(embedded.start)
        db = Database(
            self.reactor,
            dsn,
            metrics=self.storage_metrics,
            min_connections=self.config.database.min_connections,
            max_connections=self.config.database.max_connections,
        )
        db.start()
        return db, embedded

    async def _open_storage(self) -> Storage:
        """The database, migrated and checked against the server name, and the signing key."""
        db, embedded = await self._open_database()
        storage = Storage(db=db, embedded=embedded, signing_key=load_or_create_signing_key(
            self.config.effective_signing_key_path))
        self._opened = storage
        version = await db.check_connection()
        logger.info("connected to PostgreSQL %s%s", version, " (embedded)" if embedded else "")
        applied = await prepare_database(db)
        self.storage_metrics.migrations_applied.inc(applied)
        await check_server_name(db, self.config.server_name)
        if embedded is not None:
            self._supervisor = EmbeddedSupervisor(embedded, self.reactor, self._give_up)
            self._supervisor.start()
        return storage

    def _give_up(self, reason: str) -> None:
        """Supervision cannot bring the database back: stop, so that the exit code says so."""
        self.fatal_error = reason
        if self.reactor.running:
            self.reactor.stop()

    async def migrate(self) -> tuple[tuple[str, ...], int]:
        """``tributary migrate``: apply pending migrations and close the database again; nothing
        listens, nothing else starts. Returns the migrations applied (``NNNN_name``) and the
        schema version the database is at now."""

        async def migrate(db: Database) -> tuple[tuple[str, ...], int]:
            return self.last_migrations, await current_schema_version(db)

        return await self.with_database(migrate)

    async def with_database(self, use: Callable[[Database], Awaitable[T]]) -> T:
        """For command-line tools (``migrate``, ``register-user``): open the database, apply
        pending migrations (kept in ``last_migrations``), check the server name, run ``use``,
        close it all again. Nothing listens and no service starts."""
        db, embedded = await self._open_database()
        try:
            await db.check_connection()
            applied = await apply_migrations(db)
            self.last_migrations = tuple(f"{m.version:04d}_{m.name}" for m in applied)
            await check_server_name(db, self.config.server_name)
            return await use(db)
        finally:
            await deferToThread(db.close)
            if embedded is not None:
                await deferToThread(embedded.stop)

    async def _build_streams(self, db: Database) -> Streams:
        """One ID generator per stream, writing the streams the layout gives this process."""

        async def create(name: StreamName) -> StreamIdGenerator:
            return await create_id_generator(
                db, self.reactor, STREAMS[name], instance_name=self.instance_name, writers=self.layout.writers(name)
            )

        names = list(StreamName)
        created = await gatherResults([Deferred.fromCoroutine(create(name)) for name in names], consumeErrors=True)
        generators = dict(zip(names, created, strict=True))
        notifier = Notifier(self.reactor)
        for generator in generators.values():
            notifier.add_stream(generator)
            self.stream_metrics.track(generator)
        caches = CacheRegistry()
        invalidation = (CacheInvalidationStream(generators[StreamName.CACHES], caches, self.reactor)
                        if self.layout.writes(StreamName.CACHES) else None)
        return Streams(generators=generators, notifier=notifier, caches=caches, cache_invalidation=invalidation)

    async def _start_replication(self, db: Database, streams: Streams) -> ReplicationService | None:
        """Tell other processes of every stream fact: over the replication listeners (TCP), or
        the Redis channel when ``redis.enabled``. None for a lone process with neither."""
        listens = any(listener.type == "replication" for listener in self.listeners)
        if not (listens or self.config.redis.enabled or not self.layout.is_main):
            return None
        generators = {str(name): generator for name, generator in streams.generators.items()}
        return await start_replication(
            self.reactor,
            self.config.replication,
            self.registry,
            server_name=self.config.server_name,
            instance_name=self.instance_name,
            sources=stream_sources(STREAMS, generators, db),
            writes=[name for name, g in generators.items() if g.instance_name == self.instance_name],
            listen=[(address, listener.port) for listener in self.listeners if listener.type == "replication"
                    for address in listener.bind_addresses],
            connect_to=None if self.layout.is_main else self._main_replication_address(),
        )

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

    def _build_services(self, storage: Storage, streams: Streams, replication: ReplicationService | None,
                        internal_client: InternalApiClient | None) -> Services:
        """Every service, in dependency order; synchronous, so replication rows wait until the
        row handlers exist."""
        config, layout, reactor, db = self.config, self.layout, self.reactor, storage.db
        generators = streams.generators

        def clock_ms() -> int:
            return int(reactor.seconds() * 1000)

        def revoked(hashes: list[bytes]) -> None:
            if streams.cache_invalidation is not None:
                run_in_background("stream_revoked_tokens", streams.cache_invalidation.invalidate_and_stream(
                    TokenCacheInvalidation.name, tuple(digest.hex() for digest in hashes)))

        # The one outbound federation client, first: accounts ask remote servers for profiles through it.
        federation_metrics = FederationMetrics.create(self.registry)
        client = build_federation_client(config, reactor, storage.signing_key, federation_metrics)
        queries = build_remote_queries(config, reactor, client)
        accounts = AccountServices.build(config, db, reactor,
                                         account_data_stream_ids=generators[StreamName.ACCOUNT_DATA].get_next,
                                         instance_name=self.instance_name, remote_profiles=queries,
                                         account_data_noted=self.key_notes[SyncStreamKey.ACCOUNT_DATA].note,
                                         on_tokens_revoked=revoked)
        streams.caches.register(TokenCacheInvalidation(accounts.auth))

        # Events: persisted here for the rooms this process owns, by the room's owner otherwise.
        events_store = EventsStore(db)
        # The read side of events, with the event cache; the persister primes and invalidates it.
        loader = EventLoader(events_store, metrics=EventCacheMetrics.create(self.registry))
        persister_options: dict[str, Any] = dict(
            store=events_store, loader=loader, stream_ids=generators[StreamName.EVENTS], server_name=config.server_name,
            instance_name=self.instance_name, metrics=self.persistence_metrics,
            backfill_ids=generators[StreamName.BACKFILL],
            push=PushActionsEvaluator(config.server_name), written=self.written_events,
        )
        creator_options: dict[str, Any] = dict(
            loader=loader, store=events_store, server_name=config.server_name, signing_key=storage.signing_key,
            default_room_version=config.default_room_version, clock_ms=clock_ms,
        )
        persister: EventPersister
        room_events: RoomEventCreator
        if internal_client is not None:
            persister = RoutedPersister(layout=layout, client=internal_client, **persister_options)
            room_events = sharded = ShardedRoomEventCreator(layout=layout, client=internal_client,
                                                             persister=persister, **creator_options)
            if layout.writes(StreamName.EVENTS):
                register_event_operations(self.internal_api, layout, sharded, persister)
        else:
            persister = EventPersister(**persister_options)
            room_events = RoomEventCreator(persister=persister, **creator_options)

        outbound = self._build_outbound(db, generators, events_store, loader, internal_client, client)
        remote_invites = RemoteInvites(store=RemoteInviteStore(db), stream=generators[StreamName.EVENTS])
        # Federation records invites before the other writers exist: chosen the same way.
        invite_writer = choose_invite_writer(remote_invites, layout, internal_client)

        up_targets: list[Callable[[str], None]] = []
        if outbound.sender is not None:
            up_targets.append(outbound.sender.notify_remote_server_up)
        if replication is not None and config.federation_sender_instances:
            # Inbound requests prove a server is up: tell the process that sends to it.
            up_targets.append(replication.handler.send_remote_server_up)
        remote_up = tuple(up_targets)

        def on_remote_up(origin: str) -> None:
            for target in remote_up:
                target(origin)

        federation = FederationServices.build(
            config, reactor, client=client, signing_key=storage.signing_key, store=events_store,
            persister=persister, loader=loader, federation_store=FederationStore(db), room_state=RoomStateStore(db),
            partial_state=PartialStateStore(db), metrics=federation_metrics,
            invites=remote_invites, invite_writer=invite_writer, forward=outbound.forward, on_remote_up=on_remote_up,
        )
        rooms = RoomServices.build(
            db=db, reactor=reactor, server_name=config.server_name, streams=generators, notifier=streams.notifier,
            events_store=events_store, loader=loader, room_events=room_events, accounts=accounts,
            remote_invites=remote_invites, remote=federation.membership, backfill=federation.backfill.backfill,
            edus=outbound.edus, sync_metrics=SyncMetrics.create(self.registry), directory=queries,
            public_rooms_client=client,
            remote_keys=FederationKeyClient(client),
            search_all_users=config.user_directory.search_all_users,
            written=self.written_events,
            key_notes=self.key_notes,
        )
        local_writers = rooms.local_writers(accounts)
        writers = build_writers(local_writers, layout, internal_client)
        if internal_client is not None:
            register_writer_operations(self.internal_api, layout, local_writers)
        register_edu_handlers(federation.transactions, writers)
        if layout.has_workers and layout.is_main:
            register_main_operations(self.internal_api, outbound.sink, outbound.forward)

        presence_here = layout.writes(StreamName.PRESENCE)

        def report_user_sync(user_id: str, syncing: bool) -> Any:
            """``SyncTracker``'s report: to the presence handler here, or to its writer by USER_SYNC."""
            if presence_here:
                return Deferred.fromCoroutine(rooms.presence.user_syncing(self.instance_name, user_id, syncing))
            if replication is not None:
                replication.handler.send_user_sync(user_id, None, syncing, int(reactor.seconds() * 1000))
            return None

        pushers = PushersHandler(PushStore(db), clock_ms=clock_ms,
                                 current_position=generators[StreamName.EVENTS].get_max_position)
        deactivation = DeactivationHandler(login=accounts.login, rooms=rooms.rooms, profiles=accounts.profiles,
                                           timeline=rooms.timeline)
        legacy_sync = LegacySyncHandler(
            sync=rooms.sync, messages=rooms.messages, rooms=rooms.rooms, timeline=rooms.timeline,
            client_events=rooms.client_events, receipts=rooms.receipts, presence=rooms.presence,
            account_data=accounts.account_data, room_tokens=rooms.room_tokens,
        )
        federation_devices = FederationDeviceHandler(server_name=config.server_name, store=E2eStore(db), e2e=rooms.e2e,
                                                     devices=accounts.devices.get_devices)
        return Services(events_store=events_store, persister=persister, room_events=room_events, accounts=accounts,
                        federation=federation, rooms=rooms, writers=writers, outbound=outbound,
                        sync_tracker=SyncTracker(reactor, report_user_sync), remote_up=on_remote_up,
                        pushers=pushers, deactivation=deactivation, legacy_sync=legacy_sync,
                        federation_devices=federation_devices,
                        media=self._build_media(db, client) if self.serves_media else None)

    @property
    def serves_media(self) -> bool:
        """The media repository runs in one process: the ``media_repository`` worker when the layout
        has one, else the main process (docs/media.md)."""
        if self.config.media_worker is not None:
            return self.instance_name == self.config.media_worker
        return self.layout.is_main

    def _build_media(self, db: Database, client: Any) -> MediaRepository:
        media_metrics = MediaMetrics.create(self.registry)
        return MediaRepository(
            config=self.config.media, server_name=self.config.server_name, store=MediaStore(db),
            storage=LocalDiskStorage(self.config.media_store_path, self.reactor), remote=RemoteMediaFetcher(client),
            reactor=self.reactor, metrics=media_metrics,
        )

    def _build_outbound(self, db: Database, generators: Mapping[StreamName, StreamIdGenerator],
                        store: EventsStore, loader: EventLoader, internal_client: InternalApiClient | None,
                        client: Any) -> Outbound:
        """Outbound federation: a sender here (the main process with ``send_federation``, or a
        federation sender worker, each for the destinations it owns), or a sink that hands EDUs
        to the processes that send (routing/federation.py)."""
        config, layout = self.config, self.layout
        sends = config.send_federation if layout.is_main else self.role.sends_federation
        acls = ServerAcls(store=store, loader=loader)

        async def room_servers(room_id: str) -> set[str]:
            """Where a room's EDUs and forwarded events go: the servers joined to it that its
            server ACL allows (a local event's destinations are chosen the same way at persist)."""
            return await acls.allowed_servers(room_id, await store.get_joined_servers(room_id))

        sender: FederationSender | None = None
        sink: EduSink | None = None
        forward: Callable[[FrozenEvent, str], None] | None = None
        if sends:
            events = generators[StreamName.EVENTS]
            sender = FederationSender(
                server_name=config.server_name,
                config=config.federation_sender,
                store=FederationSenderStore(db),
                transport=client_transport(client),
                clock=self.reactor,
                current_position=events.get_current_token,
                metrics=FederationSenderMetrics.create(self.registry),
                joined_servers=room_servers,
                should_handle=layout.sends_to,
                device_lists_position=generators[StreamName.DEVICE_LISTS].get_current_token,
                written=self.written_events,
            )
            running = sender
            events.add_position_listener(lambda stream, instance, old, new: running.notify_new_events(
                events.get_current_token()))
            generators[StreamName.DEVICE_LISTS].add_position_listener(
                lambda stream, instance, old, new: running.notify_device_lists())
            forward = sender.forward
            if layout.is_main:
                sink = sender
        elif layout.writes(StreamName.FEDERATION):
            stream_sink = FederationStreamSink(db, generators[StreamName.FEDERATION], server_name=config.server_name,
                                               joined_servers=room_servers)
            sink, forward = stream_sink, stream_sink.forward
        elif internal_client is not None:
            if any(layout.writes(s) for s in (StreamName.TYPING, StreamName.RECEIPTS, StreamName.PRESENCE)):
                sink = RemoteEduSink(internal_client)  # a worker writing ephemeral streams
            forward = forward_to_main(internal_client)
        edus = None
        if sink is not None:
            sender_store = FederationSenderStore(db)
            edus = OutboundEdus(
                server_name=config.server_name, sink=sink, joined_servers=room_servers,
                sharing_servers=store.get_servers_sharing_rooms, add_to_outbox=sender_store.add_to_outbox,
                clock_ms=lambda: int(self.reactor.seconds() * 1000),
                note_device_list_change=sender_store.note_device_list_change,
            )
        return Outbound(sender=sender, edus=edus, forward=forward, sink=sink)

    def _connect_replication(self, replication: ReplicationService, streams: Streams, services: Services) -> None:
        """The replication consumers: cache invalidation, typing, the sender's streams, presence."""
        handler = replication.handler
        caches = streams.caches

        def invalidate(cache_name: str, keys: tuple[JsonValue, ...] | None) -> None:
            # Cache keys are tuples of strings; a replicated row carries them as JSON.
            caches.invalidate(cache_name, None if keys is None else tuple(str(k) for k in keys))

        handler.add_row_handler(CacheInvalidationHandler(invalidate))
        handler.add_row_handler(ReplicatedTyping(services.rooms.typing))
        # Other writers' events, receipts, typing, to-device messages and account data, noted
        # before the generators advance (connect_streams, below).
        handler.add_row_handler(ReplicatedEventNotes(self.written_events))
        for key, notes in self.key_notes.items():
            handler.add_row_handler(ReplicatedKeyNotes(key.value, notes))
        sender = services.outbound.sender
        if sender is not None:
            # EDUs from the federation stream (sender workers) and outbox wake-ups from other
            # to-device writers (any sender): replication brings both.
            handler.add_row_handler(FederationStreamReader(sender, handler.send_federation_ack))
            if not self.layout.is_main:
                handler.add_remote_server_up_listener(sender.notify_remote_server_up)
        if self.layout.writes(StreamName.PRESENCE):
            presence = services.rooms.presence

            def user_sync(command: UserSyncCommand) -> None:
                run_in_background("user_sync", presence.user_syncing(command.instance, command.user_id,
                                                                     command.is_syncing))

            def clear_user_sync(instance: str) -> None:
                run_in_background("clear_user_sync", presence.clear_process(instance))

            handler.add_user_sync_listener(user_sync)
            handler.add_clear_user_sync_listener(clear_user_sync)
        connect_streams(handler, {str(name): generator for name, generator in streams.generators.items()})

    async def _start_jobs(self, storage: Storage, streams: Streams,
                          replication: ReplicationService | None) -> tuple[Stoppable, ...]:
        """The role's own hook, and, on the main process, the hooks of roles that must run
        somewhere when no worker of theirs is configured (periodic jobs)."""
        hooks: list[RoleHook] = [] if self.role.start is None else [self.role.start]
        if self.layout.is_main:
            configured = {worker.app for worker in self.config.workers.values()}
            for name in known_roles():
                role = load_role(name)
                if name not in configured and role.main_runs_without_worker and role.start is not None:
                    hooks.append(role.start)

        def on_federation_ack(listener: Callable[[str, int], None]) -> None:
            if replication is not None:
                replication.handler.add_federation_ack_listener(listener)

        context = RoleContext(config=self.config, instance_name=self.instance_name, reactor=self.reactor,
                              db=storage.db, on_federation_ack=on_federation_ack, registry=self.registry,
                              streams={str(name): g for name, g in streams.generators.items()},
                              written_events=self.written_events)
        return tuple([await hook(context) for hook in hooks])

    def _register_servlets(self, storage: Storage, streams: Streams, services: Services) -> None:
        """The client and federation servlets this process's role serves (and, on the main
        process, the admin API)."""
        admin_gate = None
        if self.layout.is_main:
            accounts, rooms = services.accounts, services.rooms
            admin = AdminApi(config=self.config, db=storage.db, reactor=self.reactor, login=accounts.login,
                             devices=accounts.devices, profiles=accounts.profiles, rooms=rooms.rooms,
                             timeline=rooms.timeline, deactivation=services.deactivation,
                             remote_up=services.remote_up, tasks=self.admin_tasks)
            admin_gate = Gate(users=services.accounts.auth, admins=admin.guard,
                              limiters={Rate.SHARED_SECRET_REGISTRATION: admin.register_limiter}, clock=admin.clock)
            admin.register(self.admin_router, admin_gate)
            declare(self.console_router, admin_gate, ConsoleServlets(self.console_status))
        if self.role.servlets == "none":
            return
        router = _RoleRouter(self.router, self.role)
        gate = Gate(users=services.accounts.auth, clock=self.reactor.seconds)
        declare(router, gate, *self._client_servlets(services))
        fed = services.federation
        # Servers sign their requests; the notary's key queries share the one rc_key_query budget per address.
        federation_gate = Gate(servers=XMatrixAuth(fed.server_name, fed.keyring.get_verify_key, fed.on_remote_up,
                                                   fed.acl),
                               limiters={Rate.KEY_QUERY: fed.key_query_limiter}, clock=self.reactor.seconds,
                               json=FEDERATION_JSON)
        declare(_RoleRouter(self.federation_router, self.role), federation_gate, *self._federation_servlets(services))
        media = services.media
        if media is not None:
            previewer = UrlPreviewer(self.config.media.url_preview, self.reactor, media.metrics,
                                     media.store_preview_image)
            # The main process shares the admin API's gate (one rc_admin budget per admin); a
            # media_repository worker has its own.
            if admin_gate is None:
                admin_gate = Gate(users=services.accounts.auth, clock=self.reactor.seconds, admins=AdminGuard(
                    AdminStore(storage.db), Ratelimiter.from_config(self.config.rc_admin)))
            register_media_servlets(self.router, gate, repo=media, previewer=previewer)
            declare(self.admin_router, admin_gate, MediaAdminServlets(media))
            register_federation_media_servlets(self.federation_router, federation_gate, media)
            register_legacy_download_for_federation(self.federation_router, federation_gate, repo=media)

    def _client_servlets(self, services: Services) -> tuple[object, ...]:
        """The client-server servlets, in the order the router matches them, each given the
        handlers it calls (media is the media repository's, registered apart)."""
        accounts, rooms, writers, config = services.accounts, services.rooms, services.writers, self.config
        e2e = rooms.e2e
        return (
            VersionsServlet(),
            AccountDataServlets(accounts.account_data, accounts.filters, writers.account_data),
            RegistrationServlets(config, accounts.auth, accounts.registration, accounts.uia,
                                 accounts.registration_token_valid),
            LoginServlets(config, accounts.auth, accounts.login, accounts.uia),
            DeviceServlets(accounts.devices, accounts.uia),
            ProfileServlets(accounts.profiles),
            ServerInfoServlets(config),
            ThreepidServlets(accounts.uia),
            AppServiceServlets(accounts.app_service_queries),
            RoomServlets(rooms.rooms), HistoryServlets(rooms.messages), RedactionServlet(rooms.rooms),
            EphemeralServlets(writers.typing, writers.receipts, writers.fully_read),
            RelationsServlets(rooms.relations),
            DirectoryServlets(rooms.directory, rooms.hierarchy),
            SearchServlet(rooms.search),
            RoomUpgradeServlet(rooms.upgrades),
            SyncServlet(rooms.sync, accounts.filters, services.sync_tracker),
            SlidingSyncServlet(rooms.sliding_sync, services.sync_tracker),
            ToDeviceServlets(writers.to_device), KeysServlets(e2e),
            *(() if e2e.key_backup is None else (KeyBackupServlets(e2e.key_backup),)),
            CrossSigningServlets(e2e.cross_signing, accounts.uia), PresenceServlets(rooms.presence, writers.presence),
            DeactivateServlet(accounts.uia, services.deactivation),
            LegacySyncServlets(services.legacy_sync),
            PushRulesServlets(accounts.account_data, writers.account_data),
            PushersServlets(services.pushers, rooms.client_events),
        )

    def _federation_servlets(self, services: Services) -> tuple[object, ...]:
        """The server-server servlets (federation media is the media repository's)."""
        fed, accounts, rooms = services.federation, services.accounts, services.rooms
        return (
            ServerKeyServlets(fed.key_response, fed.notary),
            MembershipServlets(fed.membership),
            FederationDeviceServlets(services.federation_devices),
            QueryServlets(fed.server_name, fed.membership.servers_in_room, accounts.profiles.get_profile,
                          rooms.timeline.get_alias),
            TransactionServlets(fed.transactions),
            FederationHistoryServlets(fed.history, fed.acl),
            FederationDirectoryServlets(rooms.directory, rooms.hierarchy),
        )

    def console_status(self) -> dict[str, Any]:
        """What the operator console shows beyond the admin API: every process of the layout
        with the streams it writes and their positions as this process knows them,
        replication connections, and this process's federation sender queues."""
        process = self.process
        generators = process.streams.generators
        names = [MAIN_INSTANCE, *self.config.workers]
        processes = []
        for name in names:
            app = "main" if name == MAIN_INSTANCE else self.config.workers[name].app
            writes = sorted(str(stream) for stream, g in generators.items() if name in g.writers)
            positions = {str(stream): g.get_position(name) for stream, g in sorted(generators.items())
                         if name in g.writers}
            processes.append({"name": name, "app": app, "writes": writes, "positions": positions})
        replication = process.replication
        connections: list[dict[str, Any]] = []
        transport = "none"
        if replication is not None:
            if replication.redis is not None:
                transport = "redis"
                connections.append({"transport": "redis", "peer": "(every process, on the server's channel)"})
            if replication.server is not None:
                transport = "tcp" if transport == "none" else transport + "+tcp"
                connections += [{"transport": "tcp", "peer": protocol.peer_name or "(handshaking)"}
                                for protocol in sorted(replication.server.connections,
                                                       key=lambda p: p.peer_name or "")]
            if replication.client is not None:
                transport = "tcp"
                connections.append({"transport": "tcp", "peer": "main process"})
        sender = process.services.outbound.sender
        return {
            "server_name": self.config.server_name,
            "version": __version__,
            "process": self.instance_name,
            "uptime_seconds": None if self.started_at is None else round(time.monotonic() - self.started_at, 1),
            "processes": processes,
            "streams": {str(stream): g.get_current_token() for stream, g in sorted(generators.items())},
            "replication": {"transport": transport, "connections": connections},
            "sender": [] if sender is None else sender.snapshot(),
        }

    def _listen(self, listener: ListenerConfig) -> None:
        if listener.type == "replication":
            return  # opened by start_replication
        root = self._root_resource(listener)
        # Media uploads may be larger than the JSON bodies of every other endpoint, and so may
        # a big room's state handed to its events writer (only over the internal API, behind its secret).
        large_bodies = (
            ((b"/_matrix/media/",), self.config.media.max_upload_size),
            ((f"{INTERNAL_PREFIX}/persist_join".encode("ascii"),
              f"{INTERNAL_PREFIX}/complete_partial_state".encode("ascii")), MAX_INTERNAL_JOIN_BYTES),
        )
        # Each listener counts its own connections per address (homeserver/http/limits.py).
        site = make_site(root, clock=self.reactor, metrics=self.http_metrics, limits=listener.connection_limits,
                         large_bodies=large_bodies)
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
            admin = self.admin_router if {"client", "admin"} & set(listener.resources) else None
            console = self.console_router if "admin" in listener.resources else None
            return RootResource(main, HealthResource(self) if "health" in listener.resources else None, federation,
                                internal, admin=admin, console=console)
        raise ValueError(f"{listener.type} listeners are served by the replication package")

    def _tls_context(self) -> Any:
        # load_tls_options imports pyOpenSSL, which costs a quarter of a second at start-up,
        # only when called: processes without a TLS listener need not pay.
        cert_path = self.config.effective_tls_certificate_path
        key_path = self.config.effective_tls_private_key_path
        if self.config.tls_certificate_path is None:
            ensure_self_signed_certificate(cert_path, key_path, self.config.server_name)
        return load_tls_options(cert_path, key_path)

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
        if self._process is not None:
            # Long-polls (/sync, /events) answer now with what they have, instead of holding
            # the shutdown until their timeouts.
            self._process.streams.notifier.shut_down()
        grace = self.config.shutdown_grace_period.total_seconds()
        # The client API's requests, and the admin API's (a room deletion writes for a while).
        for router in (self.router, self.admin_router):
            if not router.in_flight:
                continue
            logger.info("waiting up to %.0fs for %d requests in flight", grace, router.in_flight)
            drained = router.wait_drained()
            drained.addTimeout(grace, self.reactor)
            try:
                await drained
            except Exception:
                logger.warning("%d requests still in flight after %.0fs; stopping anyway", router.in_flight, grace)
        if self.admin_tasks.running:
            logger.info("waiting up to %.0fs for %d admin tasks", grace, self.admin_tasks.running)
            idle = Deferred.fromCoroutine(self.admin_tasks.wait_idle())
            idle.addTimeout(grace, self.reactor)
            try:
                await idle
            except Exception:
                logger.warning("%d admin tasks still running after %.0fs; stopping anyway", self.admin_tasks.running,
                               grace)
        process, self._process = self._process, None
        if process is not None:
            await self._stop_process(process)
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        storage, self._opened = self._opened, None
        if storage is not None:
            await deferToThread(storage.db.close)
            if storage.embedded is not None:
                await deferToThread(storage.embedded.stop)
        logger.info("stopped")

    async def _stop_process(self, process: Process) -> None:
        """What runs, in reverse order of starting; the database stays open for ``stop``."""
        services, replication = process.services, process.replication
        for job in process.jobs:
            stopped = job.stop()
            if isinstance(stopped, Deferred):
                # e.g. the pusher records the push in flight before the database closes.
                stopped.addTimeout(self.config.shutdown_grace_period.total_seconds() or 1.0, self.reactor)
                try:
                    await stopped
                except Exception:
                    logger.warning("%r did not stop in time", job)
        syncing = services.sync_tracker.stop()
        if replication is not None and not self.layout.writes(StreamName.PRESENCE):
            replication.handler.send_clear_user_sync()  # the presence writer forgets our users
        elif syncing:
            for user_id in syncing:
                try:
                    await services.rooms.presence.user_syncing(self.instance_name, user_id, False)
                except Exception as e:
                    logger.warning("could not mark %d syncing users offline: %s", len(syncing), e)
                    break
        services.rooms.stop()  # typing timers must not fire into a closed database
        if services.outbound.sender is not None:
            await services.outbound.sender.stop()
        await services.federation.stop()
        if process.internal_client is not None:
            await process.internal_client.close()
        if replication is not None:
            await replication.stop()
        for generator in process.streams.generators.values():
            if generator.instance_name is not None:
                try:
                    await generator.flush()
                except Exception:
                    logger.warning("could not persist the %s stream position on shutdown", generator.stream_name)


#: How long ``/health`` waits for the database's probe before answering 503.
HEALTH_PROBE_TIMEOUT: Final = 2.0


class HealthResource(Resource):
    """``GET /health`` (and ``/health/ready``): 200 once the process is ready and its database
    answers, 503 while starting, stopping or while the database cannot be reached (the pool's
    knowledge, or one shared ``SELECT 1`` a second: ``Database.is_available``). ``GET
    /health/live``: 200 while the process runs and its reactor turns (it answers), whatever
    the database does, so an orchestrator does not restart a process that will recover."""

    isLeaf = True

    def __init__(self, hs: HomeServer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._hs = hs

    def render_GET(self, request: Request) -> bytes | int:
        request.setHeader(b"Content-Type", b"text/plain")
        path = request.postpath or []
        if path == [b"live"]:
            return b"OK"
        if path not in ([], [b""], [b"ready"]):
            request.setResponseCode(404)
            return b"not found"
        storage = self._hs._opened
        if not self._hs.ready or storage is None:
            request.setResponseCode(503)
            return b"stopping" if self._hs.stopping else b"starting"
        Deferred.fromCoroutine(self._answer(request, storage.db))
        return NOT_DONE_YET

    async def _answer(self, request: Request, db: Database) -> None:
        up = await db.is_available(self._hs.reactor, HEALTH_PROBE_TIMEOUT)
        if request._disconnected or request.finished:
            return
        if not up:
            request.setResponseCode(503)
        request.write(b"OK" if up else b"database unreachable")
        request.finish()


class RootResource(Resource):
    """Sends ``/health`` to the health check, ``/_matrix/federation`` and ``/_matrix/key``
    to the federation router (when this listener serves them) and everything else to the JSON router."""

    def __init__(self, router: JsonRouter, health: Resource | None, federation: JsonRouter | None = None,
                 internal: JsonRouter | None = None, *, admin: JsonRouter | None = None,
                 console: Resource | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._router = router
        self._health = health
        self._federation = federation
        self._internal = internal
        self._admin = admin
        self._console = console

    def getChildWithDefault(self, path: bytes, request: Request) -> Resource:
        if path == b"health" and self._health is not None and request.postpath in ([], [b"live"], [b"ready"]):
            return self._health
        rest = request.postpath or []
        if self._admin is not None and (
                (path == b"_synapse" and rest[:1] == [b"admin"])
                or (path == b"_matrix" and rest[:3] in ([b"client", b"v3", b"admin"], [b"client", b"r0", b"admin"]))):
            return self._admin
        if self._console is not None and path == b"_tributary" and rest[:1] == [b"console"]:
            return self._console
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

    def register(self, methods: Iterable[str], pattern: str, handler: Handler, servlet: str) -> None:
        if self._role.serves_servlet(servlet):
            self._router.register(methods, pattern, handler, servlet)
