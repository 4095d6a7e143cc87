"""Account data: JSON objects a user keeps on the server, global or per room.

Each write takes a position on the ``account_data`` stream from the injected
``stream_ids`` allocator: an async context manager factory that reserves the
next stream ID and, when the block exits (also on error or cancellation),
marks it finished so stream readers can move past it -- exactly
``StreamIdGenerator.get_next`` of storage/id_generators.py, which the
composition root passes in, with the writer's ``instance_name``.
``account_data_changed_hooks`` (for waking /sync) run after the write. Types the server manages (``m.fully_read`` in
rooms, ``m.push_rules`` globally) are refused with 405, as the spec says;
``m.push_rules`` is written by ``edit_push_rules`` (the ``/pushrules`` API).
"""

# tests: tests/integration/test_client_accounts.py

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

from twisted.internet.defer import DeferredLock

from homeserver.handlers.accounts.auth import Requester
from homeserver.events.push_rules import apply_edit, effective_rules
from homeserver.events.validation import check_event_type, check_room_id, dump_json_object
from storage.kernel.errors import MatrixError, forbidden, not_found
from storage.stores.account_data import AccountDataStore

# Reserve one account_data stream ID for the duration of a write.
StreamIdAllocator = Callable[[], AbstractAsyncContextManager[int]]
# Called with (user_id, room_id or None, type, stream_id) after a write.
AccountDataChangedHook = Callable[[str, str | None, str, int], Awaitable[None]]

SERVER_MANAGED_GLOBAL_TYPES: Final = frozenset({"m.push_rules"})
SERVER_MANAGED_ROOM_TYPES: Final = frozenset({"m.fully_read"})


class AccountDataHandler:
    def __init__(self, store: AccountDataStore, stream_ids: StreamIdAllocator, *, instance_name: str,
                 noted: Callable[[int, frozenset[str]], None] | None = None) -> None:
        self._store = store
        # Told each position this process writes and its user, before the position completes
        # (``KeyNotes``: a waiting /sync sleeps through other users' account data).
        self._noted = noted
        self._stream_ids = stream_ids
        self._instance_name = instance_name
        self.account_data_changed_hooks: list[AccountDataChangedHook] = []
        # Push rule edits read, change and write the whole ruleset: one at a time (they are rare).
        self._push_rules_lock = DeferredLock()

    @staticmethod
    def _check_own(requester: Requester, user_id: str, verb: str) -> None:
        if requester.user_id != user_id:
            raise forbidden(f"Cannot {verb} account data for other users")

    async def set_global(self, requester: Requester, user_id: str, data_type: str, content: dict[str, Any]) -> int:
        """Store global account data; return its stream ID."""
        self._check_own(requester, user_id, "add")
        check_event_type(data_type)
        if data_type in SERVER_MANAGED_GLOBAL_TYPES:
            raise MatrixError(405, "M_BAD_JSON", f"Cannot set {data_type} through this API")
        text = dump_json_object(content)
        return await self._put(user_id, None, data_type, text)

    async def set_room(
        self, requester: Requester, user_id: str, room_id: str, data_type: str, content: dict[str, Any]
    ) -> int:
        """Store per-room account data; return its stream ID."""
        self._check_own(requester, user_id, "add")
        check_room_id(room_id)
        check_event_type(data_type)
        if data_type in SERVER_MANAGED_ROOM_TYPES:
            raise MatrixError(405, "M_BAD_JSON", f"Cannot set {data_type} through this API")
        text = dump_json_object(content)
        return await self._put(user_id, room_id, data_type, text)

    async def get_push_rules(self, user_id: str) -> dict[str, Any]:
        """The user's ``global`` push ruleset: their stored ``m.push_rules`` over the defaults."""
        text = await self._store.get(user_id, None, "m.push_rules")
        return effective_rules(None if text is None else json.loads(text), user_id)

    async def edit_push_rules(self, requester: Requester, edit: dict[str, Any]) -> None:
        """Apply one ``/pushrules`` change (``push_rules.apply_edit``; 400/404 on a bad one) and
        store the whole ruleset as ``m.push_rules``, the spec's account data event."""
        await self._push_rules_lock.acquire()
        try:
            ruleset = await self.get_push_rules(requester.user_id)
            changed = apply_edit(ruleset, edit)
            await self._put(requester.user_id, None, "m.push_rules", dump_json_object({"global": changed}))
        finally:
            self._push_rules_lock.release()

    async def get_global(self, requester: Requester, user_id: str, data_type: str) -> Any:
        self._check_own(requester, user_id, "get")
        check_event_type(data_type)
        text = await self._store.get(user_id, None, data_type)
        if text is None:
            raise not_found("Account data not found")
        return json.loads(text)

    async def get_room(self, requester: Requester, user_id: str, room_id: str, data_type: str) -> Any:
        self._check_own(requester, user_id, "get")
        check_room_id(room_id)
        check_event_type(data_type)
        text = await self._store.get(user_id, room_id, data_type)
        if text is None:
            raise not_found("Room account data not found")
        return json.loads(text)

    async def room_events(self, user_id: str, room_id: str) -> list[dict[str, Any]]:
        """The user's account data in one room as ``{type, content}`` events (the older
        ``/rooms/{roomId}/initialSync``)."""
        data = await self._store.get_for_user(user_id)
        return [{"type": t, "content": json.loads(c)} for t, c in sorted(data.rooms.get(room_id, {}).items())]

    async def _put(self, user_id: str, room_id: str | None, data_type: str, text: str) -> int:
        async with self._stream_ids() as stream_id:
            await self._store.put(
                user_id, room_id, data_type, text, stream_id=stream_id, instance_name=self._instance_name
            )
            if self._noted is not None:
                self._noted(stream_id, frozenset((user_id,)))
        for hook in self.account_data_changed_hooks:
            await hook(user_id, room_id, data_type, stream_id)
        return stream_id
