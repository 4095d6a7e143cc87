"""Room stream tokens as the database sees them: a position per events writer.

With several event persisters, the ``events`` stream advances per writer, and
a ``/sync`` or ``/messages`` token is a vector clock (``RoomStreamToken``,
``m{min}~{id}.{pos}...``): writer ``i`` is at ``get(i)``, every other writer at
the minimum. An event belongs before a token when its stream ordering is at or
below its own writer's position there, so a reader never waits for the slowest
persister to see another persister's events, and nothing is seen twice.

The stores read events up to such a bound given as a ``RoomPosition``
(``storage.stores.timeline``): the token with writers named as in
``events.instance_name``, what SQL can compare. ``RoomTokens`` turns tokens
into positions and mints the current token, using the ``instance_map`` table's
small IDs for the token's short form.
"""

# tests: tests/integration/test_room_tokens.py, tests/unit/handlers/test_room_parsing.py, tests/integration/test_workers.py

from __future__ import annotations

from storage.id_generators import StreamIdGenerator
from storage.stores.instance_map import InstanceMap
from storage.stores.timeline import RoomPosition
from storage.tokens import InvalidTokenError, RoomStreamToken


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
