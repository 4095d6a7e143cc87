"""What the sender's loop needs of the database: the methods it calls, as a protocol.

``storage.stores.federation_sender.FederationSenderStore`` is the real one (all
the SQL is there); the loop's unit tests pass an in-memory one. The row types
are the store's.
"""

# tests: tests/unit/federation_sender/test_sender.py

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from storage.stores.federation_sender import (
    CatchUpData,
    DestinationRow,
    DeviceListRead,
    FanoutEvent,
    OutboxRow,
    SentMark,
)


class SenderStore(Protocol):
    async def get_fanout_events(self, after: int, upto: int, limit: int) -> list[FanoutEvent]: ...

    async def get_backing_off(self) -> list[DestinationRow]: ...

    async def get_needing_catch_up(self, upto: int) -> list[DestinationRow]: ...

    async def set_retry(
        self, destination: str, retry_last_ts: int, retry_interval: int, failure_ts: int | None
    ) -> None: ...

    async def mark_sent_many(self, marks: Sequence[SentMark]) -> None: ...

    async def record_pdu_errors(self, destination: str, errors: Mapping[str, str], now_ms: int) -> None: ...

    async def begin_catch_up(self, destination: str) -> tuple[int, int]: ...

    async def end_catch_up(self, destination: str) -> None: ...

    async def get_catch_up_rooms(
        self, destination: str, after: int, upto: int | None, limit: int
    ) -> list[tuple[str, int]]: ...

    async def get_catch_up_data(
        self, destination: str, rooms: Sequence[tuple[str, int, int]], missed_per_room: int
    ) -> CatchUpData: ...

    async def get_outbox(self, destination: str, limit: int) -> list[OutboxRow]: ...

    async def get_outbox_destinations(self) -> list[str]: ...

    async def get_device_list_updates(
        self, destination: str, local_server: str, upto: int, limit: int
    ) -> DeviceListRead: ...

    async def get_device_lists_destinations(self, local_server: str) -> list[str]: ...
