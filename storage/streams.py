"""The stream registry: every stream's name, sequence, backing tables and row type.

A ``StreamDefinition`` says where a stream's facts live and how one row looks
(a frozen attrs class); ``get_updates_between`` reads the rows one writer wrote
between two positions, which is how a replication reader fills a gap. The SQL
is in ``storage.stores.streams``; positions and IDs are ``storage.id_generators``.
Adding a stream: docs/streams.md, "Adding a stream".
"""

# tests: tests/integration/test_streams_registry.py

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
from twisted.internet.interfaces import IReactorTime

from storage.database import Database
from storage.id_generators import (
    DEFAULT_PERSIST_INTERVAL,
    MultiWriterIdGenerator,
    SingleWriterIdGenerator,
    StreamIdGenerator,
)
from storage.stores.streams import StreamNotAvailableError, TableSource, get_updates_between_txn

__all__ = [
    "STREAMS",
    "AccountDataStreamRow",
    "BackfillStreamRow",
    "BoundStream",
    "CacheInvalidationRow",
    "DeviceListsStreamRow",
    "EventsStreamRow",
    "FederationStreamRow",
    "PresenceStreamRow",
    "ReceiptsStreamRow",
    "StreamDefinition",
    "StreamName",
    "StreamNotAvailableError",
    "StreamRowError",
    "ToDeviceStreamRow",
    "TypingStreamRow",
    "create_id_generator",
    "get_stream",
]


class StreamName(enum.StrEnum):
    """Every stream, by the name used in replication commands and ``stream_positions``."""

    EVENTS = "events"
    BACKFILL = "backfill"
    CACHES = "caches"
    TYPING = "typing"
    RECEIPTS = "receipts"
    PRESENCE = "presence"
    TO_DEVICE = "to_device"
    ACCOUNT_DATA = "account_data"
    DEVICE_LISTS = "device_lists"
    FEDERATION = "federation"


class StreamRowError(ValueError):
    """A row mapping (e.g. from an RDATA command) that does not fit the stream's row type."""


def _str_tuple(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(value)


def _optional_str_tuple(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


# --- row types: what one row of each stream carries ------------------------------------


@attrs.frozen(slots=True)
class EventsStreamRow:
    """A new event in a room (the full event is read from ``events`` by ID)."""

    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str


@attrs.frozen(slots=True)
class BackfillStreamRow:
    """An event fetched from another server's history (older than the room's timeline)."""

    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str


@attrs.frozen(slots=True)
class CacheInvalidationRow:
    """Invalidate cache ``cache_name`` at ``keys`` (None: the whole cache)."""

    cache_name: str
    keys: tuple[str, ...] | None = attrs.field(converter=_optional_str_tuple)
    invalidation_ts: int


@attrs.frozen(slots=True)
class TypingStreamRow:
    """The users typing in a room now."""

    room_id: str
    user_ids: tuple[str, ...] = attrs.field(converter=_str_tuple)


@attrs.frozen(slots=True)
class ReceiptsStreamRow:
    """A user's latest receipt of a type in a room (and thread)."""

    room_id: str
    receipt_type: str
    user_id: str
    thread_id: str | None
    event_id: str
    data_json: str


@attrs.frozen(slots=True)
class PresenceStreamRow:
    """A user's presence state changed."""

    user_id: str
    state: str
    status_msg: str | None
    last_active_ts: int
    currently_active: bool


@attrs.frozen(slots=True)
class ToDeviceStreamRow:
    """New to-device messages: ``entity`` is a local user ID (``@...``) or a destination server."""

    entity: str


@attrs.frozen(slots=True)
class AccountDataStreamRow:
    """A user's account data of a type changed (``room_id`` None: global)."""

    user_id: str
    room_id: str | None
    data_type: str


@attrs.frozen(slots=True)
class DeviceListsStreamRow:
    """A user's device changed (added, removed, keys or name updated)."""

    user_id: str
    device_id: str


@attrs.frozen(slots=True)
class FederationStreamRow:
    """An EDU queued for a destination, for a federation sender on another process."""

    destination: str
    edu_type: str
    content_json: str


RowT = TypeVar("RowT")


@attrs.frozen
class StreamDefinition(Generic[RowT]):
    """One stream: what the registry knows about it.

    ``sources`` are the backing tables (usually one; ``to_device`` has two),
    each with columns in the order of ``row_type``'s fields. ``multi_writer``
    says whether several instances may be configured as writers.
    ``available_from`` names the migration that creates a table this code does
    not (for events and backfill); until it runs, ``get_updates_between``
    raises ``StreamNotAvailableError``.
    """

    name: StreamName
    sequence: str
    sources: tuple[TableSource, ...]
    row_type: type[RowT]
    multi_writer: bool
    description: str
    available_from: str | None = None

    @property
    def table(self) -> str:
        """The main backing table."""
        return self.sources[0].table

    async def get_updates_between(
        self, db: Database, instance: str, from_token: int, to_token: int, limit: int
    ) -> tuple[list[tuple[int, RowT]], int, bool]:
        """Rows ``instance`` wrote with ``from_token < stream_id <= to_token``, ascending.

        Returns ``(rows, upto_token, limited)``: when ``limited``, there may be
        more rows after ``upto_token`` (call again from it); otherwise
        ``upto_token == to_token``. Rows of one stream ID are never split.
        """
        raw, upto, limited = await db.run_interaction(
            f"get_updates_between_{self.name.value}",
            get_updates_between_txn,
            self.sources,
            instance,
            from_token,
            to_token,
            limit,
        )
        row_type = self.row_type
        return [(stream_id, row_type(*values)) for stream_id, _, values in raw], upto, limited

    @property
    def field_names(self) -> tuple[str, ...]:
        """The row type's fields, in order (the order of the positional wire form)."""
        return tuple(f.name for f in attrs.fields(self.row_type))  # type: ignore[arg-type]

    def row_to_json(self, row: RowT) -> dict[str, Any]:
        """The row as a JSON object by field name."""
        return {name: getattr(row, name) for name in self.field_names}

    def row_from_json(self, data: Mapping[str, Any]) -> RowT:
        """The row from a JSON object; raises StreamRowError when the fields do not match."""
        fields = set(self.field_names)
        if set(data) != fields:
            missing, extra = sorted(fields - set(data)), sorted(set(data) - fields)
            raise StreamRowError(f"{self.name.value} row: missing fields {missing}, unexpected fields {extra}")
        return self._build(data)

    def row_to_tuple(self, row: RowT) -> tuple[Any, ...]:
        """The row as a JSON array of its fields in order (the RDATA row form)."""
        return tuple(getattr(row, name) for name in self.field_names)

    def row_from_tuple(self, values: Sequence[Any]) -> RowT:
        """The row from its positional form; raises StreamRowError on a wrong length or type."""
        names = self.field_names
        if len(values) != len(names):
            raise StreamRowError(
                f"{self.name.value} row: expected {len(names)} values ({', '.join(names)}), got {len(values)}"
            )
        return self._build(dict(zip(names, values, strict=True)))

    def _build(self, data: Mapping[str, Any]) -> RowT:
        try:
            return self.row_type(**data)
        except (TypeError, ValueError) as e:
            raise StreamRowError(f"{self.name.value} row: {e}") from e


_EVENT_COLUMNS = ("event_id", "room_id", "type", "state_key", "sender")


def _define(
    name: StreamName,
    sequence: str,
    row_type: type[RowT],
    sources: tuple[TableSource, ...],
    *,
    multi_writer: bool,
    description: str,
    available_from: str | None = None,
) -> StreamDefinition[RowT]:
    return StreamDefinition(name, sequence, sources, row_type, multi_writer, description, available_from)


#: Every stream, by name. Order is the order replication announces them.
STREAMS: Mapping[StreamName, StreamDefinition[Any]] = {
    d.name: d
    for d in (
        _define(
            StreamName.EVENTS,
            "events_stream_seq",
            EventsStreamRow,
            (
                TableSource(
                    "events", _EVENT_COLUMNS, id_column="stream_ordering", may_be_missing=True
                ),
            ),
            multi_writer=True,
            description="New events in rooms, by stream_ordering; one writer per room (event persisters).",
            available_from="the events migration (0003+, events issue)",
        ),
        _define(
            StreamName.BACKFILL,
            "backfill_stream_seq",
            BackfillStreamRow,
            (
                TableSource(
                    "events", _EVENT_COLUMNS, id_column="stream_ordering", negated=True, may_be_missing=True
                ),
            ),
            multi_writer=True,
            description="Backfilled events, stored with stream_ordering = -(backfill stream ID).",
            available_from="the events migration (0003+, events issue)",
        ),
        _define(
            StreamName.CACHES,
            "cache_invalidation_stream_seq",
            CacheInvalidationRow,
            (TableSource("cache_invalidation_stream", ("cache_name", "keys", "invalidation_ts")),),
            multi_writer=True,
            description="Cache invalidations: every process drops the named cache entries.",
        ),
        _define(
            StreamName.TYPING,
            "typing_stream_seq",
            TypingStreamRow,
            (TableSource("typing_stream", ("room_id", "user_ids")),),
            multi_writer=False,
            description="Who is typing in which room.",
        ),
        _define(
            StreamName.RECEIPTS,
            "receipts_stream_seq",
            ReceiptsStreamRow,
            (
                TableSource(
                    "receipts", ("room_id", "receipt_type", "user_id", "thread_id", "event_id", "data")
                ),
            ),
            multi_writer=True,
            description="Read receipts (latest per room, type, user and thread).",
        ),
        _define(
            StreamName.PRESENCE,
            "presence_stream_seq",
            PresenceStreamRow,
            (
                TableSource(
                    "presence_stream", ("user_id", "state", "status_msg", "last_active_ts", "currently_active")
                ),
            ),
            multi_writer=False,
            description="Presence states (latest per user).",
        ),
        _define(
            StreamName.TO_DEVICE,
            "to_device_stream_seq",
            ToDeviceStreamRow,
            (
                TableSource("device_inbox", ("user_id",)),
                TableSource("device_federation_outbox", ("destination",)),
            ),
            multi_writer=True,
            description="To-device messages for local devices (device_inbox) and other servers (outbox).",
        ),
        _define(
            StreamName.ACCOUNT_DATA,
            "account_data_stream_seq",
            AccountDataStreamRow,
            (TableSource("account_data", ("user_id", "room_id", "account_data_type")),),
            multi_writer=True,
            description="Account data (global and per room), latest per user, room and type.",
        ),
        _define(
            StreamName.DEVICE_LISTS,
            "device_lists_stream_seq",
            DeviceListsStreamRow,
            (TableSource("device_lists_stream", ("user_id", "device_id")),),
            multi_writer=False,
            description="Device list changes of local users.",
        ),
        _define(
            StreamName.FEDERATION,
            "federation_stream_seq",
            FederationStreamRow,
            (TableSource("federation_stream", ("destination", "edu_type", "content")),),
            multi_writer=False,
            description="EDUs for other servers, for a federation sender worker.",
        ),
    )
}


@attrs.frozen
class BoundStream(Generic[RowT]):
    """A stream with this process's database and ID generator.

    Has the shape replication's ``StreamSource`` expects: ``name``,
    ``current_position(instance)`` (the generator's view of that writer) and
    ``get_updates_between(instance, from_token, to_token, limit)`` with rows in
    their positional form (``StreamDefinition.row_to_tuple``).
    """

    definition: StreamDefinition[RowT]
    db: Database
    generator: StreamIdGenerator

    @property
    def name(self) -> str:
        return self.definition.name.value

    def current_position(self, instance: str) -> int:
        return self.generator.get_position(instance)

    async def get_updates_between(
        self, instance: str, from_token: int, to_token: int, limit: int
    ) -> tuple[list[tuple[int, tuple[Any, ...]]], int, bool]:
        rows, upto, limited = await self.definition.get_updates_between(
            self.db, instance, from_token, to_token, limit
        )
        to_tuple = self.definition.row_to_tuple
        return [(stream_id, to_tuple(row)) for stream_id, row in rows], upto, limited


def get_stream(name: str) -> StreamDefinition[Any]:
    """The definition of a stream by name; raises KeyError naming the known streams."""
    try:
        return STREAMS[StreamName(name)]
    except ValueError:
        raise KeyError(f"unknown stream {name!r}; known streams: {sorted(s.value for s in StreamName)}") from None


async def create_id_generator(
    db: Database,
    clock: IReactorTime,
    stream: StreamDefinition[Any],
    *,
    instance_name: str,
    writers: Sequence[str],
    persist: bool = True,
    barrier_timeout: float = 300.0,
    persist_interval: float = DEFAULT_PERSIST_INTERVAL,
) -> StreamIdGenerator:
    """The ID generator of ``stream`` in a process named ``instance_name``.

    ``writers`` are the instances configured to write the stream; the process
    writes if it is one of them and only reads otherwise. A single-writer stream
    refuses more than one writer.
    """
    if not stream.multi_writer:
        if len(writers) != 1:
            raise ValueError(f"stream {stream.name.value} has exactly one writer, got {list(writers)}")
        return await SingleWriterIdGenerator.create_single(
            db,
            clock,
            stream_name=stream.name.value,
            sequence=stream.sequence,
            instance_name=instance_name,
            writer=writers[0],
            tables=stream.sources,
            persist=persist,
            barrier_timeout=barrier_timeout,
            persist_interval=persist_interval,
        )
    return await MultiWriterIdGenerator.create(
        db,
        clock,
        stream_name=stream.name.value,
        sequence=stream.sequence,
        instance_name=instance_name,
        writers=writers,
        tables=stream.sources,
        persist=persist,
        barrier_timeout=barrier_timeout,
        persist_interval=persist_interval,
    )

