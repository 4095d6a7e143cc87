"""Fixtures for the stream integration tests (no tests here).

Cloning a database per test costs most of a second, so the stream tests share
one migrated database per module and reset the stream tables and sequences
before each test (milliseconds). ``StreamEnv.make`` builds generators and
remembers them, so that their background position writes are flushed before
the next test resets the tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from prometheus_client import CollectorRegistry

from storage.database import Database, Transaction
from storage.id_generators import StreamIdGenerator
from storage.metrics import StorageMetrics
from storage.streams import STREAMS, StreamDefinition, StreamName, create_id_generator
from tests.conftest import scratch_database
from tests.twisted_plugin import reactor, run_sync


_STREAM_TABLES = sorted(
    {source.table for stream in STREAMS.values() for source in stream.sources if not source.may_be_missing}
)
_SEQUENCES = sorted({stream.sequence for stream in STREAMS.values()})


@pytest.fixture(scope="module")
def module_database_dsn(postgres_template: str) -> Iterator[str]:
    """One fresh migrated database for a whole test module."""
    with scratch_database(postgres_template) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def module_database(module_database_dsn: str) -> Iterator[Database]:
    db = Database(reactor, module_database_dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=8)
    db.start()
    try:
        yield db
    finally:
        db.close()


def _reset_txn(txn: Transaction) -> None:
    txn.execute(f"TRUNCATE stream_positions, instance_map, {', '.join(_STREAM_TABLES)}")
    for sequence in _SEQUENCES:
        txn.execute(f"ALTER SEQUENCE {sequence} RESTART")


@attrs.define
class StreamEnv:
    db: Database
    dsn: str
    generators: list[StreamIdGenerator] = attrs.Factory(list)

    async def make(
        self,
        stream: StreamDefinition[Any] = STREAMS[StreamName.CACHES],
        instance: str = "main",
        writers: tuple[str, ...] = ("main",),
        **kwargs: Any,
    ) -> StreamIdGenerator:
        generator = await create_id_generator(
            self.db, reactor, stream, instance_name=instance, writers=writers, **kwargs
        )
        self.generators.append(generator)
        return generator

    async def settle(self) -> None:
        for generator in self.generators:
            await generator.flush()


@pytest.fixture
def streams_env(module_database: Database, module_database_dsn: str) -> Iterator[StreamEnv]:
    """The module's database with empty stream tables and restarted sequences."""
    run_sync(module_database.run_interaction("reset_streams", _reset_txn))
    env = StreamEnv(module_database, module_database_dsn)
    try:
        yield env
    finally:
        run_sync(env.settle())
