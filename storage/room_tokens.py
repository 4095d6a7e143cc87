"""Room stream tokens as the database sees them: a position per events writer.

With several event persisters, the ``events`` stream advances per writer, and
a ``/sync`` or ``/messages`` token is a vector clock (``RoomStreamToken``,
``m{min}~{id}.{pos}...``): writer ``i`` is at ``get(i)``, every other writer at
the minimum. An event belongs before a token when its stream ordering is at or
below its own writer's position there, so a reader never waits for the slowest
persister to see another persister's events, and nothing is seen twice.

``RoomPosition`` is that token with writers named as in ``events.instance_name``
(what SQL can compare), and renders the bound as a SQL condition. With one
writer (one process, or one persister) it is a plain ``stream_ordering`` bound:
the form and the query plans of a single process do not change.
``RoomTokens`` turns tokens into positions and mints the current token, using
the ``instance_map`` table's small IDs for the token's short form.
"""

# tests: tests/integration/test_room_tokens.py, tests/unit/handlers/test_room_parsing.py, tests/integration/test_workers.py

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from storage.id_generators import StreamIdGenerator
from storage.stores.instance_map import InstanceMap
from storage.tokens import InvalidTokenError, RoomStreamToken


@attrs.frozen
class RoomPosition:
    """Every writer at ``minimum``, except those in ``ahead`` (instance name -> position)."""

    minimum: int
    ahead: tuple[tuple[str, int], ...] = ()

    @classmethod
    def at(cls, position: int) -> RoomPosition:
        return cls(position)

    @classmethod
    def of(cls, minimum: int, ahead: Mapping[str, int]) -> RoomPosition:
        return cls(minimum, tuple(sorted((name, pos) for name, pos in ahead.items() if pos > minimum)))

    @property
    def maximum(self) -> int:
        return max((pos for _, pos in self.ahead), default=self.minimum)

    def get(self, instance_name: str) -> int:
        for name, position in self.ahead:
            if name == instance_name:
                return position
        return self.minimum

    def capped(self, position: int) -> RoomPosition:
        """No writer past ``position``."""
        return RoomPosition.of(min(self.minimum, position), {n: min(p, position) for n, p in self.ahead})

    def covers(self, instance_name: str, stream_ordering: int) -> bool:
        """Whether an event of ``instance_name`` at ``stream_ordering`` is at or before this position."""
        return stream_ordering <= self.get(instance_name)

    def sql_upto(self, alias: str = "") -> tuple[str, list[Any]]:
        """``stream_ordering`` at or before this position, as SQL (with its parameters)."""
        return self._sql(alias, "<=")

    def sql_after(self, alias: str = "") -> tuple[str, list[Any]]:
        """``stream_ordering`` after this position, as SQL (with its parameters)."""
        return self._sql(alias, ">")

    def _sql(self, alias: str, op: str) -> tuple[str, list[Any]]:
        so, instance = f"{alias}stream_ordering", f"{alias}instance_name"
        if not self.ahead:
            return f"{so} {op} %s", [self.minimum]
        # The plain range first (what the index serves), then each row against its writer's position.
        outer = self.maximum if op == "<=" else self.minimum
        per_writer = f"{so} {op} COALESCE((%s::jsonb ->> {instance})::bigint, %s)"
        return f"{so} {op} %s AND {per_writer}", [outer, json.dumps(dict(self.ahead)), self.minimum]


class RoomTokens:
    """Room stream tokens <-> ``RoomPosition``s, for one process's view of the events stream."""

    def __init__(self, events: StreamIdGenerator, instances: InstanceMap) -> None:
        self._events = events
        self._instances = instances

    async def start(self) -> None:
        """Give every events writer its instance ID (the tokens' short names for them)."""
        for writer in self._events.writers:
            await self._instances.get_or_create_id(writer)
        await self._instances.load()

    def current(self) -> RoomStreamToken:
        """Where this process has seen every writer get to (a vector clock when they differ)."""
        return RoomStreamToken.from_writer_positions(
            self._events.get_positions(), self._events.writers, self._instances.ids()
        )

    async def position(self, token: RoomStreamToken) -> RoomPosition:
        """``token`` for SQL; raises ``InvalidTokenError`` for a writer ID no process ever had."""
        ahead = {}
        for instance_id, position in token.instance_positions:
            name = self._instances.get_cached_name(instance_id) or await self._instances.get_name(instance_id)
            if name is None:
                raise InvalidTokenError("room stream token", token.to_string(), f"unknown writer {instance_id}")
            ahead[name] = position
        return RoomPosition.of(token.minimum, ahead)

    def token(self, position: RoomPosition) -> RoomStreamToken:
        """The token for a position (the inverse of ``position``)."""
        ids = self._instances.ids()
        return RoomStreamToken.from_positions({ids[name]: pos for name, pos in position.ahead}, position.minimum)
