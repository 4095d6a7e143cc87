"""Builds the room, history, sync, typing and receipt handlers from the homeserver's parts.

One place to wire them, so ``homeserver/app.py`` needs one call; nothing here
decides anything.
"""

# tests: tests/integration/test_client_rooms.py

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from homeserver.events import constants as C
from homeserver.handlers.rooms.partial_state import PartialStateWaiter
from homeserver.wiring.accounts import AccountServices
from homeserver.handlers.rooms.aggregations import Aggregator
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.e2e.cross_signing import CrossSigningHandler
from homeserver.handlers.directory.directory import DirectoryHandler, PublicRoomsClient
from homeserver.handlers.e2e.key_backup import KeyBackupHandler
from homeserver.handlers.e2e.e2e import E2eHandler, RemoteKeys
from homeserver.handlers.directory.hierarchy import HierarchyHandler
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.ephemeral.federation_edus import OutboundEdus
from homeserver.handlers.rooms.messages import Backfill, MessagesHandler
from homeserver.handlers.sync.metrics import SyncMetrics
from homeserver.handlers.ephemeral.presence import PresenceHandler
from homeserver.handlers.ephemeral.receipts import ReceiptsHandler
from homeserver.handlers.rooms.relations import RelationsHandler
from homeserver.handlers.rooms.remote_invites import RemoteInvites
from homeserver.handlers.rooms.room_events import RoomEventCreator
from homeserver.handlers.rooms.room_upgrade import RoomUpgradeHandler
from homeserver.handlers.directory.search import SearchHandler
from homeserver.handlers.rooms.rooms import RemoteDirectory, RemoteMembership, RoomHandler
from homeserver.handlers.sync.sliding_sync import SlidingSyncHandler
from homeserver.handlers.sync.sync import SyncHandler
from homeserver.handlers.ephemeral.typing import TypingHandler
from homeserver.handlers.writers import Writers
from storage.database import Database
from storage.kernel.written_events import KeyNotes, WrittenEvents
from storage.tokens import SyncStreamKey
from storage.stores.partial_state import PartialStateStore
from storage.stores.admin import AdminStore
from storage.id_generators import StreamIdGenerator
from storage.notifier import Notifier
from storage.stores.accounts import AccountStore
from storage.stores.account_data import AccountDataStore
from storage.stores.directory import DirectoryStore
from storage.stores.e2e import CrossSigningStore, E2eStore
from storage.stores.key_backup import KeyBackupStore
from storage.stores.push import PushStore
from storage.stores.events import EventsStore
from storage.room_tokens import RoomTokens
from storage.stores.instance_map import InstanceMap
from storage.stores.presence import PresenceStore
from storage.stores.relations import RelationsStore
from storage.stores.search import SearchStore
from storage.stores.streams import insert_typing_txn
from storage.stores.timeline import TimelineStore
from storage.stores.sliding_sync import SlidingSyncStore
from storage.stores.user_directory import UserDirectoryStore
from storage.streams import StreamName

logger = logging.getLogger(__name__)


@attrs.frozen
class RoomServices:
    timeline: TimelineStore
    client_events: ClientEvents
    rooms: RoomHandler
    messages: MessagesHandler
    typing: TypingHandler
    receipts: ReceiptsHandler
    sync: SyncHandler
    e2e: E2eHandler
    presence: PresenceHandler
    # Room stream tokens <-> per-writer positions; ``await room_tokens.start()`` before serving.
    room_tokens: RoomTokens
    remote_invites: RemoteInvites
    # /relations and /threads (the aggregations themselves are bundled by ``client_events``).
    relations: RelationsHandler
    # The room directory (/publicRooms, here and over federation) and the user directory.
    directory: DirectoryHandler
    # POST /search over the events' full-text index.
    search: SearchHandler
    # Spaces: /hierarchy for clients and for other servers.
    hierarchy: HierarchyHandler
    # POST /rooms/{roomId}/upgrade.
    upgrades: RoomUpgradeHandler
    # Simplified sliding sync (MSC4186).
    sliding_sync: SlidingSyncHandler

    @classmethod
    def build(
        cls,
        *,
        db: Database,
        reactor: Any,
        server_name: str,
        streams: Mapping[StreamName, StreamIdGenerator],
        notifier: Notifier,
        events_store: EventsStore,
        loader: EventLoader,
        room_events: RoomEventCreator,
        accounts: AccountServices,
        remote_invites: RemoteInvites,
        remote: RemoteMembership | None,
        backfill: Backfill | None,
        edus: OutboundEdus | None,
        sync_metrics: SyncMetrics | None = None,
        directory: RemoteDirectory | None = None,
        public_rooms_client: PublicRoomsClient | None = None,
        remote_keys: RemoteKeys | None = None,
        search_all_users: bool = False,
        written: WrittenEvents | None = None,
        key_notes: Mapping[SyncStreamKey, KeyNotes] | None = None,
    ) -> RoomServices:
        """``remote`` and ``backfill`` come from federation (None: this server's rooms only);
        ``edus`` takes typing, receipts, presence and to-device to other servers (None: this
        process sends none); ``written``: the notes of the events this process knows of, and
        ``key_notes`` what the positions of other streams are about (rooms, users), which let
        a waiting ``/sync`` sleep through what is not for its user (their writers here note
        them)."""
        key_notes = key_notes or {}
        def clock_ms() -> int:
            return int(reactor.seconds() * 1000)

        timeline = TimelineStore(db)
        relations_store = RelationsStore(db)
        partial_state = PartialStateStore(db)

        client_events = ClientEvents(
            loader=loader, events_store=events_store, timeline=timeline, clock_ms=clock_ms,
            erased_users=AccountStore(db).get_erased_users,
            aggregator=Aggregator(store=relations_store, loader=loader),
        )

        async def is_joined(user_id: str, room_id: str) -> bool:
            entry = (await timeline.get_rooms_for_user(user_id)).get(room_id)
            return entry is not None and entry[0] == C.JOIN

        async def event_room(event_id: str) -> str | None:
            event = await loader.get_event(event_id)
            return None if event is None else event.room_id

        room_directory = DirectoryHandler(
            store=DirectoryStore(db), events_store=events_store, loader=loader, server_name=server_name,
            clock_ms=clock_ms, remote=public_rooms_client, is_joined=is_joined,
            users=UserDirectoryStore(db), search_all_users=search_all_users,
        )
        admin_store = AdminStore(db)

        async def blocked_rooms(room_id: str) -> bool:
            return await admin_store.get_block(room_id) is not None

        rooms = RoomHandler(
            room_events=room_events,
            loader=loader,
            events_store=events_store,
            timeline=timeline,
            client_events=client_events,
            profiles=accounts.profiles,
            server_name=server_name,
            clock_ms=clock_ms,
            ratelimiters=accounts.ratelimiters,
            remote=remote,
            directory=directory,
            publish=room_directory.publish,
            app_services=accounts.auth.app_services,
            ask_services_alias=accounts.app_service_queries.query_alias if accounts.auth.app_services else None,
            is_blocked=blocked_rooms,
            partial_state=PartialStateWaiter(
                partial_state, reactor,
                seen=lambda instance, position: streams[StreamName.EVENTS].get_position(instance) >= position),
        )
        accounts.profiles.profile_changed_hooks.append(rooms.on_profile_changed)
        room_tokens = RoomTokens(streams[StreamName.EVENTS], InstanceMap(db))
        messages = MessagesHandler(
            events_store=events_store,
            timeline=timeline,
            client_events=client_events,
            room_tokens=room_tokens,
            backfill=backfill,
        )
        typing_stream = streams[StreamName.TYPING]

        async def record_typing(stream_id: int, room_id: str, user_ids: list[str]) -> None:
            await db.run_interaction(
                "record_typing", insert_typing_txn, stream_id, str(typing_stream.instance_name), room_id, user_ids
            )

        def noting(key: SyncStreamKey) -> Callable[[int, frozenset[str]], None] | None:
            notes = key_notes.get(key)
            return None if notes is None else notes.note

        typing = TypingHandler(stream=typing_stream, clock=reactor, is_joined=is_joined, record=record_typing,
                               federation=edus, noted=noting(SyncStreamKey.TYPING))
        receipts = ReceiptsHandler(
            stream=streams[StreamName.RECEIPTS],
            timeline=timeline,
            is_joined=is_joined,
            event_room=event_room,
            clock_ms=clock_ms,
            account_data=AccountDataStore(db),
            account_data_stream=streams[StreamName.ACCOUNT_DATA],
            federation=edus,
            noted=noting(SyncStreamKey.RECEIPTS),
            account_data_noted=noting(SyncStreamKey.ACCOUNT_DATA),
        )
        async def device_ids(user_id: str) -> list[str]:
            return [device.device_id for device in await accounts.devices.get_devices(user_id)]

        e2e_store = E2eStore(db)
        e2e = E2eHandler(
            store=e2e_store,
            to_device_stream=streams[StreamName.TO_DEVICE],
            server_name=server_name,
            device_ids=device_ids,
            device_lists_stream=streams[StreamName.DEVICE_LISTS],
            federation=edus,
            remote=remote_keys,
            room_position=room_tokens.position,
            noted=noting(SyncStreamKey.TO_DEVICE),
        )
        e2e.cross_signing = CrossSigningHandler(
            store=CrossSigningStore(db), e2e_store=e2e_store, keys_changed=e2e.cross_signing_changed
        )
        e2e.key_backup = KeyBackupHandler(KeyBackupStore(db))
        # Device logins, renames and deletions are device-list changes (the main process takes
        # them, and writes the device_lists stream).
        accounts.devices.device_deleted_hooks.append(e2e.devices_deleted)
        accounts.devices.device_changed_hooks.append(e2e.local_devices_changed)
        presence = PresenceHandler(store=PresenceStore(db), stream=streams[StreamName.PRESENCE], clock_ms=clock_ms,
                                   federation=edus)
        sync = SyncHandler(
            streams=streams,
            notifier=notifier,
            clock=reactor,
            events_store=events_store,
            timeline=timeline,
            client_events=client_events,
            account_data=AccountDataStore(db),
            typing=typing,
            receipts=receipts,
            e2e=e2e,
            metrics=sync_metrics,
            presence=presence,
            room_tokens=room_tokens,
            push=PushStore(db),
            partial_state=partial_state,
            written=written,
            key_notes=key_notes,
        )
        sliding_sync = SlidingSyncHandler(
            store=SlidingSyncStore(db), sync=sync, notifier=notifier, clock=reactor, room_tokens=room_tokens,
            timeline=timeline, events_store=events_store, client_events=client_events,
            account_data=AccountDataStore(db), typing=typing, receipts=receipts, e2e=e2e, push=PushStore(db),
            metrics=sync.metrics, partial_state=partial_state,
        )
        relations = RelationsHandler(
            store=relations_store, events_store=events_store, timeline=timeline, client_events=client_events,
            messages=messages, room_tokens=room_tokens,
        )
        upgrades = RoomUpgradeHandler(
            rooms=rooms, room_events=room_events, events_store=events_store, loader=loader, timeline=timeline,
            directory=DirectoryStore(db), clock_ms=clock_ms,
        )
        return cls(timeline, client_events, rooms, messages, typing, receipts, sync, e2e, presence, room_tokens,
                   remote_invites, relations, room_directory,
                   SearchHandler(store=SearchStore(db), events_store=events_store, timeline=timeline,
                                 client_events=client_events),
                   HierarchyHandler(store=DirectoryStore(db), server_name=server_name,
                                    memberships=timeline.get_rooms_for_user, remote=public_rooms_client),
                   upgrades, sliding_sync)

    def stop(self) -> None:
        """Cancel timers; ``HomeServer.stop`` should call this before closing the database."""
        self.typing.stop()

    def local_writers(self, accounts: AccountServices) -> Writers:
        """This process's own handlers as the writers of every single-writer stream."""
        return Writers(typing=self.typing, receipts=self.receipts, fully_read=self.receipts, presence=self.presence,
                       to_device=self.e2e, device_lists=self.e2e, account_data=accounts.account_data,
                       invites=self.remote_invites)
