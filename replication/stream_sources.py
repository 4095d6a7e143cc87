# tests: tests/unit/replication/test_stream_sources.py
"""Adapters from the stream layer (storage/streams.py, storage/id_generators.py)
to replication's seam (``StreamSource``, ``RowHandler``).

This module owns three small conversions: a stream definition plus its ID
generator and the database become a ``StreamSource`` (rows become the RDATA
JSON array: the row's fields in declaration order, as Synapse writes stream
rows); rows from other writers advance this process's view of them in the
generator (which wakes the notifier); and the generators' position listeners
become ``ReplicationHandler.on_stream_advanced``. It matches the stream layer
by shape (the protocols below), not by import, so the two can change apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from replication.commands import Row, freeze_row
from replication.handler import ReplicationHandler, Updates

__all__ = [
    "GeneratorAdvancer",
    "StreamDefinitionSource",
    "connect_streams",
    "row_from_wire",
    "row_to_wire",
    "stream_sources",
]


class StreamDefinitionLike(Protocol):
    """What replication uses of ``storage.streams.StreamDefinition``."""

    @property
    def name(self) -> Any: ...  # a str enum: str(name) is the wire name

    @property
    def row_type(self) -> type[Any]: ...

    async def get_updates_between(
        self, db: Any, instance: str, from_token: int, to_token: int, limit: int
    ) -> tuple[list[tuple[int, Any]], int, bool]: ...


class IdGeneratorLike(Protocol):
    """What replication uses of ``storage.id_generators.StreamIdGenerator``."""

    @property
    def instance_name(self) -> str | None: ...

    def get_position(self, instance: str) -> int: ...

    def advance(self, instance: str, position: int) -> None: ...

    def add_position_listener(self, listener: Callable[[str, str, int, int], None]) -> None: ...


def row_to_wire(row: Any) -> Row:
    """A stream row (a frozen attrs instance) as the RDATA JSON array: its
    fields in declaration order. ``CacheInvalidationRow("get_user_by_id",
    ("@a:hs",), 1)`` is ``["get_user_by_id",["@a:hs"],1]``, Synapse's shape."""
    return freeze_row([getattr(row, field.name) for field in attrs.fields(type(row))])


def row_from_wire(row_type: type[Any], row: Row) -> Any:
    """The stream row back from its RDATA array; raises ``TypeError`` or
    ``ValueError`` if the array does not fit ``row_type``."""
    fields = attrs.fields(row_type)
    if len(row) != len(fields):
        raise ValueError(f"{row_type.__name__} has {len(fields)} fields, the row has {len(row)}: {row!r:.200}")
    return row_type(*row)


class StreamDefinitionSource:
    """A ``StreamSource`` over one registry stream: positions from this
    process's ID generator, rows from the database."""

    def __init__(self, definition: StreamDefinitionLike, generator: IdGeneratorLike, db: Any) -> None:
        self.definition = definition
        self.generator = generator
        self._db = db
        self._name = str(definition.name)

    @property
    def name(self) -> str:
        return self._name

    def current_position(self, instance: str) -> int:
        return self.generator.get_position(instance)

    async def get_updates_between(self, instance: str, from_token: int, to_token: int, limit: int) -> Updates:
        rows, upto, limited = await self.definition.get_updates_between(self._db, instance, from_token, to_token, limit)
        return [(token, row_to_wire(row)) for token, row in rows], upto, limited


class GeneratorAdvancer:
    """A ``RowHandler`` that moves this process's view of the writer in the
    stream's ID generator (``advance``), which wakes whoever waits on the
    stream. Register it after the handlers that act on rows (cache
    invalidation), so that a woken waiter sees their effect."""

    def __init__(self, generators: Mapping[str, IdGeneratorLike]) -> None:
        self._generators = dict(generators)

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
        generator = self._generators.get(stream)
        if generator is not None:
            generator.advance(instance, token)


def connect_streams(
    handler: ReplicationHandler, generators: Mapping[str, IdGeneratorLike]
) -> None:
    """Wire the stream layer to ``handler``: the writer side hears of this
    process's own position changes; the reader side advances the generators.
    Call after registering the row handlers that act on rows."""
    me = handler.instance_name

    def on_position(stream: str, instance: str, old: int, new: int) -> None:
        if instance == me:
            handler.on_stream_advanced(stream)

    for name, generator in generators.items():
        if generator.instance_name == me:
            generator.add_position_listener(on_position)
    handler.add_row_handler(GeneratorAdvancer(generators))


def stream_sources(
    definitions: Mapping[Any, StreamDefinitionLike], generators: Mapping[str, IdGeneratorLike], db: Any
) -> dict[str, StreamDefinitionSource]:
    """One ``StreamDefinitionSource`` per stream that has a generator."""
    sources = {}
    for key, definition in definitions.items():
        name = str(key)
        generator = generators.get(name)
        if generator is not None:
            sources[name] = StreamDefinitionSource(definition, generator, db)
    return sources
