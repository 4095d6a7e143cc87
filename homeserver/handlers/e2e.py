"""To-device messages and end-to-end keys, the minimum that encryption-capable clients need.

``sendToDevice`` writes local inboxes on the to_device stream (messages to other
servers are dropped until federation carries EDUs); ``/sync`` reads them and
deletes what the client acknowledged with its ``since``. Keys are stored as
uploaded, one-time keys are handed out once. No cross-signing, no fallback keys,
no device-list tracking (``/keys/changes`` is always empty).
"""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from homeserver.handlers.federation_edus import OutboundEdus
from homeserver.handlers.auth import Requester
from homeserver.handlers.validation import is_local_user_id, is_storable_text
from storage.kernel.errors import bad_json, invalid_param
from homeserver.events.identifiers import is_valid_user_id
from storage.id_generators import StreamIdGenerator
from storage.stores.e2e import E2eStore

MAX_KEYS_PER_UPLOAD = 1000
MAX_QUERY_USERS = 1000


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 255 or not is_storable_text(value):
        raise bad_json(f"{what} must be a non-empty string of at most 255 characters")
    return value


class E2eHandler:
    def __init__(
        self,
        *,
        store: E2eStore,
        to_device_stream: StreamIdGenerator,
        server_name: str,
        device_ids: Callable[[str], Awaitable[list[str]]],
        device_lists_stream: StreamIdGenerator | None = None,
        federation: OutboundEdus | None = None,
    ) -> None:
        self._device_lists_stream = device_lists_stream
        self._store = store
        self._stream = to_device_stream
        self._server_name = server_name
        self._device_ids = device_ids
        # To-device messages and device changes for other servers go through this; None in a
        # process that sends no EDUs.
        self._federation = federation

    def current_position(self) -> int:
        return self._stream.get_current_token()

    async def send_to_device(self, requester: Requester, event_type: str, txn_id: str, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if not isinstance(messages, dict):
            raise bad_json("'messages' must be an object of user ID -> device ID -> content")
        rows: list[tuple[str, str, str]] = []
        remote: dict[str, dict[str, Any]] = {}
        for user_id, by_device in messages.items():
            if not isinstance(by_device, dict):
                raise bad_json("each user's messages must be an object of device ID -> content")
            if not is_local_user_id(user_id, self._server_name):
                if not is_valid_user_id(user_id):
                    raise invalid_param(f"not a user ID: {user_id[:100]!r}")
                if not all(isinstance(content, dict) for content in by_device.values()):
                    raise bad_json("each message must be an object")
                remote[user_id] = by_device
                continue
            for device_id, content in by_device.items():
                if not isinstance(content, dict):
                    raise bad_json("each message must be an object")
                targets = await self._device_ids(user_id) if device_id == "*" else [_text(device_id, "device ID")]
                payload = json.dumps({"type": event_type, "sender": requester.user_id, "content": content})
                rows.extend((user_id, target, payload) for target in targets)
        if not await self._store.claim_to_device_txn(requester.user_id, requester.device_id, txn_id):
            return
        if self._federation is None:
            remote.clear()  # nothing sends to other servers from this process
        if not rows and not remote:
            return
        instance = self._stream.instance_name or "master"
        async with self._stream.get_next() as stream_id:
            if rows:
                await self._store.add_to_device(stream_id, instance, rows)
            if remote and self._federation is not None:
                await self._federation.to_device(stream_id, instance, requester.user_id, event_type, remote)

    async def apply_remote_to_device(
        self, sender: str, event_type: str, message_id: str, messages: Mapping[str, Any]
    ) -> int:
        """An ``m.direct_to_device`` EDU (checked by the caller): deliver to local devices,
        once per (sender, message_id). How many device inboxes got the message."""
        rows: list[tuple[str, str, str]] = []
        for user_id, by_device in messages.items():
            if not isinstance(by_device, dict) or not is_local_user_id(user_id, self._server_name):
                continue
            for device_id, content in by_device.items():
                if not isinstance(content, dict) or not is_storable_text(device_id) or len(device_id) > 255:
                    continue
                targets = await self._device_ids(user_id) if device_id == "*" else [device_id]
                payload = json.dumps({"type": event_type, "sender": sender, "content": content})
                rows.extend((user_id, target, payload) for target in targets)
        if not await self._store.claim_to_device_txn(sender, "*federation*", message_id):
            return 0
        if rows:
            async with self._stream.get_next() as stream_id:
                await self._store.add_to_device(stream_id, self._stream.instance_name or "master", rows)
        return len(rows)

    async def apply_remote_device_list_update(
        self, user_id: str, device_id: str, *, deleted: bool, keys: Mapping[str, Any] | None
    ) -> None:
        """An ``m.device_list_update`` EDU (checked by the caller): cache the device's keys (so
        ``/keys/query`` answers for it) and tell local users' ``/sync`` (``device_lists.changed``)."""
        if deleted:
            await self._store.delete_device_keys(user_id, device_id)
        elif keys is not None:
            await self._store.set_device_keys(user_id, device_id, json.dumps(keys))
        if self._device_lists_stream is not None:
            stream = self._device_lists_stream
            async with stream.get_next() as stream_id:
                await self._store.add_device_list_change(stream_id, stream.instance_name or "master", user_id, device_id)

    async def device_list_changes(self, user_id: str, after: int, upto: int) -> list[str]:
        """Users sharing a room with ``user_id`` whose devices changed in (after, upto]."""
        return await self._store.get_device_list_changes(user_id, after, upto)

    async def to_device_for(self, requester: Requester, after: int, upto: int) -> list[Any]:
        return [json.loads(m) for m in await self._store.get_to_device(requester.user_id, requester.device_id, after, upto)]

    async def upload_keys(self, requester: Requester, body: dict[str, Any]) -> dict[str, Any]:
        device_keys = body.get("device_keys")
        if device_keys is not None:
            if not isinstance(device_keys, dict):
                raise bad_json("'device_keys' must be an object")
            if device_keys.get("user_id") != requester.user_id or device_keys.get("device_id") != requester.device_id:
                raise invalid_param("device_keys must be for the requesting user and device")
            await self._store.set_device_keys(requester.user_id, requester.device_id, json.dumps(device_keys))
            if self._federation is not None:
                # No per-user device stream to chain updates on: an empty prev_id tells the
                # receiver it cannot tell whether it missed any, so it refreshes the list.
                await self._federation.device_list_update({
                    "user_id": requester.user_id, "device_id": requester.device_id,
                    "stream_id": time.time_ns() // 1000, "prev_id": [], "deleted": False, "keys": device_keys,
                })
        one_time = body.get("one_time_keys")
        if one_time is not None:
            if not isinstance(one_time, dict) or len(one_time) > MAX_KEYS_PER_UPLOAD:
                raise bad_json(f"'one_time_keys' must be an object of at most {MAX_KEYS_PER_UPLOAD} keys")
            rows = []
            for full_id, key in one_time.items():
                algorithm, sep, key_id = _text(full_id, "one-time key ID").partition(":")
                if not sep or not algorithm or not key_id:
                    raise bad_json("one-time key IDs are '<algorithm>:<key_id>'")
                if not isinstance(key, (dict, str)):
                    raise bad_json("a one-time key must be a string or an object")
                rows.append((algorithm, key_id, json.dumps(key)))
            await self._store.add_one_time_keys(requester.user_id, requester.device_id, rows)
        return {"one_time_key_counts": await self.one_time_key_counts(requester)}

    async def one_time_key_counts(self, requester: Requester) -> dict[str, int]:
        counts = await self._store.count_one_time_keys(requester.user_id, requester.device_id)
        counts.setdefault("signed_curve25519", 0)
        return counts

    async def query_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        wanted = body.get("device_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'device_keys' must be an object of user ID -> device IDs")
        query: dict[str, list[str]] = {}
        for user_id, device_ids in wanted.items():
            if not isinstance(device_ids, list):
                raise bad_json("each user's device IDs must be a list")
            query[_text(user_id, "user ID")] = [_text(d, "device ID") for d in device_ids]
        found = await self._store.get_device_keys(query)
        return {
            "device_keys": {
                user: {device: json.loads(keys) for device, keys in devices.items()} for user, devices in found.items()
            },
            "failures": {},
        }

    async def claim_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        wanted = body.get("one_time_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'one_time_keys' must be an object of user ID -> device ID -> algorithm")
        query: list[tuple[str, str, str]] = []
        for user_id, devices in wanted.items():
            if not isinstance(devices, dict):
                raise bad_json("each user's entry must be an object of device ID -> algorithm")
            for device_id, algorithm in devices.items():
                query.append((_text(user_id, "user ID"), _text(device_id, "device ID"), _text(algorithm, "algorithm")))
        claimed = await self._store.claim_one_time_keys(query[:MAX_KEYS_PER_UPLOAD])
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for user_id, device_id, algorithm, key_id, key_json in claimed:
            out.setdefault(user_id, {}).setdefault(device_id, {})[f"{algorithm}:{key_id}"] = json.loads(key_json)
        return {"one_time_keys": out, "failures": {}}
