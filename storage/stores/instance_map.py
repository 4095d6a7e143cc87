"""The ``instance_map`` table: a persistent small integer per instance name, for tokens.

Vector-clock tokens (``storage.tokens``) name writers by these integers to stay
short. An ID, once given, never changes or moves to another name. IDs are
handed out densely from 1 (max + 1) so tokens stay short; get-or-create is safe
when several processes start at once. ``InstanceMap`` caches the table in
memory; the mapping only grows, so a cached entry never goes stale.
"""

# tests: tests/integration/test_streams_registry.py

from __future__ import annotations

from collections.abc import Mapping

from storage.database import Database, Transaction

#: Attempts at claiming a new ID before giving up (each loss means another process won a race).
_MAX_ATTEMPTS = 20


class InstanceMapError(RuntimeError):
    """The instance map could not give an ID (or a name) that was asked for."""


def get_instance_map_txn(txn: Transaction) -> dict[str, int]:
    txn.execute("SELECT instance_name, instance_id FROM instance_map")
    return {str(name): int(instance_id) for name, instance_id in txn.fetchall()}


def get_or_create_instance_id_txn(txn: Transaction, instance_name: str) -> int:
    """The ID of ``instance_name``, giving it the next free one if it has none.

    Two processes racing for new names may compute the same ``max + 1``: the
    loser's insert does nothing (``ON CONFLICT DO NOTHING`` covers both unique
    constraints), and it tries again with the new maximum. Under READ COMMITTED
    each statement sees the rows committed before it started.
    """
    for _ in range(_MAX_ATTEMPTS):
        txn.execute("SELECT instance_id FROM instance_map WHERE instance_name = %s", (instance_name,))
        row = txn.fetchone()
        if row is not None:
            return int(row[0])
        txn.execute(
            """
            INSERT INTO instance_map (instance_name, instance_id)
            SELECT %s, COALESCE(MAX(instance_id), 0) + 1 FROM instance_map
            ON CONFLICT DO NOTHING
            """,
            (instance_name,),
        )
    raise InstanceMapError(
        f"could not give instance {instance_name!r} an ID after {_MAX_ATTEMPTS} attempts; "
        "is something inserting into instance_map in a loop?"
    )


class InstanceMap:
    """Instance name <-> instance ID, cached; misses go to the database."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def _remember(self, mapping: Mapping[str, int]) -> None:
        for name, instance_id in mapping.items():
            self._ids[name] = instance_id
            self._names[instance_id] = name

    async def load(self) -> None:
        """Read the whole table (at start-up, and after a miss on an unknown ID)."""
        self._remember(await self._db.run_interaction("get_instance_map", get_instance_map_txn))

    async def get_or_create_id(self, instance_name: str) -> int:
        cached = self._ids.get(instance_name)
        if cached is not None:
            return cached
        instance_id = await self._db.run_interaction(
            "get_or_create_instance_id", get_or_create_instance_id_txn, instance_name
        )
        self._remember({instance_name: instance_id})
        return instance_id

    async def get_name(self, instance_id: int) -> str | None:
        """The name of an ID (None if no instance has it), reloading the table on a miss."""
        name = self._names.get(instance_id)
        if name is None:
            await self.load()
            name = self._names.get(instance_id)
        return name

    def get_id(self, instance_name: str) -> int:
        """The cached ID of an instance ensured earlier with get_or_create_id; raises otherwise."""
        try:
            return self._ids[instance_name]
        except KeyError:
            raise InstanceMapError(
                f"instance {instance_name!r} has no cached ID; call get_or_create_id for every stream "
                "writer at start-up"
            ) from None

    def get_cached_name(self, instance_id: int) -> str | None:
        return self._names.get(instance_id)

    def ids(self) -> Mapping[str, int]:
        return dict(self._ids)
