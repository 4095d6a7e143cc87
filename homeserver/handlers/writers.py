"""The single-writer streams' writes, as the domain sees them: one Protocol per stream write.

Typing, receipts, fully-read markers, presence, to-device messages, device lists of remote
users, account data and invites to rooms this server is not in are each written by one
process. Services and servlets call them through these Protocols; the composition root
hands them the local handler or a stand-in that asks the writer
(homeserver/routing/writers.py). What this module does not know: which process writes.
"""

# tests: tests/unit/routing/test_writers.py, tests/integration/test_workers.py

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from homeserver.handlers.accounts.auth import Requester


class TypingWriter(Protocol):
    async def set_typing(self, requester: Requester, room_id: str, user_id: str, typing: bool,
                         timeout_ms: int | None) -> None: ...

    async def apply_remote(self, room_id: str, user_id: str, typing: bool) -> bool: ...


class ReceiptsWriter(Protocol):
    async def receipt(self, requester: Requester, room_id: str, receipt_type: str, event_id: str,
                      thread_id: str | None) -> None: ...

    async def apply_remote(self, room_id: str, receipt_type: str, user_id: str, event_id: str,
                           data: dict[str, Any]) -> bool: ...


class FullyReadWriter(Protocol):
    async def set_fully_read(self, requester: Requester, room_id: str, event_id: str) -> None: ...


class PresenceWriter(Protocol):
    async def set_status(self, requester: Requester, user_id: str, state: str, status_msg: str | None) -> None: ...

    async def apply_remote(self, user_id: str, state: str, status_msg: str | None, last_active_ago: int,
                           currently_active: bool) -> None: ...


class ToDeviceWriter(Protocol):
    async def send_to_device(self, requester: Requester, event_type: str, txn_id: str,
                             body: dict[str, Any]) -> None: ...

    async def apply_remote_to_device(self, sender: str, event_type: str, message_id: str,
                                     messages: Mapping[str, Any]) -> int: ...


class DeviceListWriter(Protocol):
    async def apply_remote_device_list_update(self, user_id: str, device_id: str, *, deleted: bool,
                                              keys: Mapping[str, Any] | None, stream_id: int | None = None,
                                              prev_ids: Sequence[int] = (),
                                              display_name: str | None = None) -> None: ...

    async def apply_remote_signing_key_update(self, user_id: str, master_key: Mapping[str, Any] | None,
                                              self_signing_key: Mapping[str, Any] | None) -> None: ...


class AccountDataWriter(Protocol):
    async def set_global(self, requester: Requester, user_id: str, data_type: str, content: dict[str, Any]) -> int: ...

    async def set_room(self, requester: Requester, user_id: str, room_id: str, data_type: str,
                       content: dict[str, Any]) -> int: ...

    async def edit_push_rules(self, requester: Requester, edit: dict[str, Any]) -> None: ...


class InviteWriter(Protocol):
    async def record_invite(self, user_id: str, room_id: str, room_version: str, event_id: str,
                            event: dict[str, Any], invite_state: list[Any]) -> None: ...

    async def record_rejection(self, user_id: str, room_id: str, room_version: str, event_id: str,
                               event: dict[str, Any]) -> None: ...

    async def record_knock(self, user_id: str, room_id: str, room_version: str, event_id: str,
                           event: dict[str, Any], knock_state: list[Any]) -> None: ...


@attrs.frozen
class Writers:
    """Where this process's writes to single-writer streams go (local handler or remote writer)."""

    typing: TypingWriter
    receipts: ReceiptsWriter
    fully_read: FullyReadWriter
    presence: PresenceWriter
    to_device: ToDeviceWriter
    device_lists: DeviceListWriter
    account_data: AccountDataWriter
    invites: InviteWriter
