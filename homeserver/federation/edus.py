"""Inbound EDUs of ``PUT /send``: typing, receipts, presence, to-device messages, device lists.

Each handler checks the EDU's shape and that the origin speaks only for its own
users (and only about rooms those users are joined to, as we see them), then
hands the data to the local handler that owns its stream (typing, receipts,
presence, e2e), which wakes ``/sync``. A malformed or unauthorised EDU raises
``EduRejected``; the transaction handler logs it as a warning and carries on.
Outbound EDUs are the federation sender's job, not this module's.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from homeserver.events.identifiers import server_name_of
from homeserver.handlers.e2e.e2e_rules import parse_prev_ids, parse_stream_id
from homeserver.handlers.ephemeral.presence import PRESENCE_STATES
from homeserver.events.validation import is_storable_text
from homeserver.handlers.writers import (
    DeviceListWriter,
    PresenceWriter,
    ReceiptsWriter,
    ToDeviceWriter,
    TypingWriter,
    Writers,
)
from storage.kernel.errors import MatrixError

logger = logging.getLogger(__name__)

MAX_ID_LENGTH: Final = 255
MAX_PRESENCE_PUSH: Final = 1000
MAX_RECEIPTS_PER_EDU: Final = 1000


class EduRejected(ValueError):
    """An EDU that is malformed, or speaks for a user of another server: dropped."""


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or not is_storable_text(value):
        raise EduRejected(f"{what} must be a non-empty string of at most {MAX_ID_LENGTH} characters, got {value!r:.80}")
    return value


def _user_of(origin: str, value: object, what: str = "user_id") -> str:
    user_id = _text(value, what)
    if not user_id.startswith("@") or server_name_of(user_id) != origin:
        raise EduRejected(f"{origin} may not speak for {user_id[:MAX_ID_LENGTH]!r} ({what})")
    return user_id


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise EduRejected(f"{what} must be an object, got {type(value).__name__}")
    return value


class EduHandlers:
    """Inbound EDUs, checked here and written through the writer of each stream (``routing/writers.py``)."""

    def __init__(self, *, typing: TypingWriter, receipts: ReceiptsWriter, presence: PresenceWriter,
                 to_device: ToDeviceWriter, device_lists: DeviceListWriter) -> None:
        self._typing = typing
        self._receipts = receipts
        self._presence = presence
        self._to_device = to_device
        self._device_lists = device_lists

    def handlers(self) -> dict[str, Any]:
        """``edu_type -> handler(origin, content)`` for ``TransactionHandler.register_edu_handler``."""
        return {
            "m.typing": self.on_typing,
            "m.receipt": self.on_receipt,
            "m.presence": self.on_presence,
            "m.direct_to_device": self.on_direct_to_device,
            "m.device_list_update": self.on_device_list_update,
            "m.signing_key_update": self.on_signing_key_update,
        }

    async def on_typing(self, origin: str, content: object) -> None:
        body = _object(content, "m.typing content")
        room_id = _text(body.get("room_id"), "room_id")
        user_id = _user_of(origin, body.get("user_id"))
        typing = body.get("typing")
        if not isinstance(typing, bool):
            raise EduRejected("m.typing 'typing' must be true or false")
        if not await self._typing.apply_remote(room_id, user_id, typing):
            raise EduRejected(f"{user_id} is not joined to {room_id}")

    async def on_receipt(self, origin: str, content: object) -> None:
        rooms = _object(content, "m.receipt content")
        applied = 0
        for room_id, by_type in rooms.items():
            _text(room_id, "room ID")
            for receipt_type, by_user in _object(by_type, "receipts of a room").items():
                for user_id, receipt in _object(by_user, "receipts of a type").items():
                    _user_of(origin, user_id, "receipt user")
                    entry = _object(receipt, "a receipt")
                    event_ids = entry.get("event_ids")
                    if not isinstance(event_ids, list) or not event_ids:
                        raise EduRejected("a receipt's 'event_ids' must be a non-empty list")
                    data = entry.get("data", {})
                    if not isinstance(data, dict):
                        raise EduRejected("a receipt's 'data' must be an object")
                    applied += 1
                    if applied > MAX_RECEIPTS_PER_EDU:
                        raise EduRejected(f"more than {MAX_RECEIPTS_PER_EDU} receipts in one EDU")
                    event_id = _text(event_ids[-1], "receipt event ID")
                    if not await self._receipts.apply_remote(room_id, receipt_type, user_id, event_id, dict(data)):
                        logger.warning("TX [%s] receipt of %s in %s ignored (type %r, or not joined)",
                                       origin, user_id, room_id, receipt_type[:50])

    async def on_presence(self, origin: str, content: object) -> None:
        push = _object(content, "m.presence content").get("push")
        if not isinstance(push, list) or len(push) > MAX_PRESENCE_PUSH:
            raise EduRejected(f"m.presence 'push' must be a list of at most {MAX_PRESENCE_PUSH} updates")
        for update in push:
            try:
                entry = _object(update, "a presence update")
                user_id = _user_of(origin, entry.get("user_id"))
                state = entry.get("presence")
                if state not in PRESENCE_STATES:
                    raise EduRejected(f"presence must be one of {sorted(PRESENCE_STATES)}, got {state!r:.50}")
                ago = entry.get("last_active_ago", 0)
                if isinstance(ago, bool) or not isinstance(ago, int) or not 0 <= ago < 2**53:
                    raise EduRejected("'last_active_ago' must be a non-negative integer")
                status_msg = entry.get("status_msg")
                if status_msg is not None and (not isinstance(status_msg, str) or len(status_msg) > 2048
                                               or not is_storable_text(status_msg)):
                    raise EduRejected("'status_msg' must be a string of at most 2048 characters")
                active = entry.get("currently_active", False)
                await self._presence.apply_remote(user_id, str(state), status_msg, ago, active is True)
            except EduRejected as e:  # one bad update does not spoil the others
                logger.warning("TX [%s] presence update dropped: %s", origin, e)

    async def on_direct_to_device(self, origin: str, content: object) -> None:
        body = _object(content, "m.direct_to_device content")
        sender = _user_of(origin, body.get("sender"), "sender")
        event_type = _text(body.get("type"), "type")
        message_id = _text(body.get("message_id"), "message_id")
        messages = _object(body.get("messages"), "messages")
        await self._to_device.apply_remote_to_device(sender, event_type, message_id, messages)

    async def on_device_list_update(self, origin: str, content: object) -> None:
        body = _object(content, "m.device_list_update content")
        user_id = _user_of(origin, body.get("user_id"))
        device_id = _text(body.get("device_id"), "device_id")
        deleted = body.get("deleted", False) is True
        try:
            # Without a stream ID the update cannot be placed: the receiver fetches the whole list.
            stream_id = None if body.get("stream_id") is None else parse_stream_id(body.get("stream_id"))
            prev_ids = parse_prev_ids(body.get("prev_id"))
        except MatrixError as e:
            raise EduRejected(e.error) from None
        name = body.get("device_display_name")
        if name is not None and (not isinstance(name, str) or len(name) > 1000 or not is_storable_text(name)):
            name = None
        keys = body.get("keys")
        if keys is not None:
            keys = _object(keys, "keys")
            if keys.get("user_id", user_id) != user_id or keys.get("device_id", device_id) != device_id:
                raise EduRejected("'keys' are for another user or device")
        await self._device_lists.apply_remote_device_list_update(
            user_id, device_id, deleted=deleted, keys=keys, stream_id=stream_id, prev_ids=prev_ids,
            display_name=name,
        )


    async def on_signing_key_update(self, origin: str, content: object) -> None:
        body = _object(content, "m.signing_key_update content")
        user_id = _user_of(origin, body.get("user_id"))
        keys: dict[str, Mapping[str, Any] | None] = {}
        for field in ("master_key", "self_signing_key"):
            value = body.get(field)
            keys[field] = None if value is None else _object(value, field)
        await self._device_lists.apply_remote_signing_key_update(user_id, keys["master_key"], keys["self_signing_key"])


def register_edu_handlers(transactions: Any, writers: Writers) -> EduHandlers:
    """Register every inbound EDU handler on a ``TransactionHandler``."""
    edus = EduHandlers(typing=writers.typing, receipts=writers.receipts, presence=writers.presence,
                       to_device=writers.to_device, device_lists=writers.device_lists)
    for edu_type, handler in edus.handlers().items():
        transactions.register_edu_handler(edu_type, handler)
    return edus
