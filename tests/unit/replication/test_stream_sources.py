# tests: replication/stream_sources.py
"""The adapters between the stream layer and replication, on fakes shaped like
``StreamDefinition`` and ``StreamIdGenerator`` (no database)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from replication.commands import RdataCommand
from replication.handler import ReplicationHandler
from replication.metrics import ReplicationMetrics
from replication.stream_sources import (
    GeneratorAdvancer,
    StreamDefinitionSource,
    connect_streams,
    row_from_wire,
    row_to_wire,
    stream_sources,
)
from replication.transport import TwistedScheduler
from storage.tokens import StreamPosition


class Name(enum.StrEnum):
    CACHES = "caches"


@attrs.frozen
class CacheRow:
    cache_name: str
    keys: tuple[str, ...] | None = attrs.field(converter=lambda v: None if v is None else tuple(v))
    invalidation_ts: int


class FakeDefinition:
    name = Name.CACHES
    row_type = CacheRow

    def __init__(self) -> None:
        self.calls: list[tuple[object, str, int, int, int]] = []

    async def get_updates_between(
        self, db: Any, instance: str, from_token: int, to_token: int, limit: int
    ) -> tuple[list[tuple[int, Any]], int, bool]:
        self.calls.append((db, instance, from_token, to_token, limit))
        return [(3, CacheRow("get_user_by_id", ("@a:hs",), 7)), (4, CacheRow("get_profile", None, 8))], to_token, False


class FakeGenerator:
    def __init__(self, instance_name: str | None, positions: dict[str, int] | None = None) -> None:
        self.instance_name = instance_name
        self.positions = dict(positions or {})
        self.listeners: list[Callable[[str, str, int, int], None]] = []

    def get_position(self, instance: str) -> int:
        return self.positions.get(instance, 0)

    def advance(self, instance: str, position: int) -> None:
        old = self.positions.get(instance, 0)
        self.positions[instance] = position
        for listener in self.listeners:
            listener("caches", instance, old, position)

    def add_position_listener(self, listener: Callable[[str, str, int, int], None]) -> None:
        self.listeners.append(listener)


def test_rows_go_on_the_wire_as_their_fields_in_order_and_come_back() -> None:
    row = CacheRow("get_user_by_id", ("@a:hs",), 1795342117133)
    wire = row_to_wire(row)
    assert RdataCommand("caches", "master", StreamPosition("caches", 5), wire).to_line() == (
        'RDATA caches master 5 ["get_user_by_id",["@a:hs"],1795342117133]'
    )
    assert row_from_wire(CacheRow, wire) == row
    with pytest.raises(ValueError, match="3 fields"):
        row_from_wire(CacheRow, ("x",))


def test_a_definition_and_its_generator_are_a_stream_source() -> None:
    definition, generator, db = FakeDefinition(), FakeGenerator("master", {"master": 9}), object()
    source = StreamDefinitionSource(definition, generator, db)
    assert source.name == "caches" and source.current_position("master") == 9
    result: list[object] = []
    Deferred.fromCoroutine(source.get_updates_between("master", 2, 9, 100)).addCallback(result.append)
    assert result == [([(3, ("get_user_by_id", ("@a:hs",), 7)), (4, ("get_profile", None, 8))], 9, False)]
    assert definition.calls == [(db, "master", 2, 9, 100)]
    assert set(stream_sources({Name.CACHES: definition}, {"caches": generator}, db)) == {"caches"}
    assert stream_sources({Name.CACHES: definition}, {}, db) == {}


def test_connect_streams_wires_writer_listeners_and_reader_advances() -> None:
    clock = Clock()
    writer_gen = FakeGenerator("master")
    writer = ReplicationHandler(
        "master", TwistedScheduler(clock), sources=stream_sources({Name.CACHES: FakeDefinition()}, {"caches": writer_gen}, None),
        writes=["caches"], metrics=ReplicationMetrics.create(CollectorRegistry()),
    )
    connect_streams(writer, {"caches": writer_gen})
    assert len(writer_gen.listeners) == 1
    writer_gen.advance("other", 5)  # another writer's position: not ours to send
    assert not writer.busy()
    writer_gen.advance("master", 4)  # ours: the pump is scheduled
    assert writer.busy()

    reader_gen = FakeGenerator(None)
    advancer = GeneratorAdvancer({"caches": reader_gen})
    advancer.on_rows("caches", "master", 12, ())
    advancer.on_rows("events", "master", 13, ())  # a stream without a generator here
    assert reader_gen.positions == {"master": 12}
