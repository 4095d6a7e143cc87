"""To-device messages, end-to-end keys and device lists: what encryption across devices and servers needs.

``sendToDevice`` writes local inboxes on the to_device stream and queues messages
for other servers' users in the federation outbox (``OutboundEdus.to_device``),
each with a message ID the receiver deduplicates by; ``/sync`` reads the inbox
and deletes what the client acknowledged with its ``since``.

Device lists: every change of a local user's devices (keys uploaded or changed,
a device logged in, renamed or deleted) is one fact on the ``device_lists``
stream, written by its writer (the main process); the user's previous fact's ID
is the ``prev_id`` of the ``m.device_list_update`` EDU sent to every server
sharing a room with the user. Remote users' lists are cached: an update that
follows on the cache is applied, one that does not (or one for a user not
cached) makes this server fetch the whole list (``GET /user/devices``), and a
failed fetch marks the cache stale so ``/keys/query`` asks the user's server.

``/keys/query`` and ``/keys/claim`` answer local users from the store and fan
out to the other servers concurrently, each bounded by the request's timeout;
a server that does not answer is named in ``failures``. One-time keys are
handed out once; a device's fallback key when it has none left.
"""

# tests: tests/integration/test_client_e2e.py, tests/unit/handlers/test_e2e_rules.py,
#        tests/integration/test_federation_e2e_nio.py

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol

from twisted.internet.defer import DeferredLock

from homeserver.events.identifiers import is_valid_user_id
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.e2e.cross_signing import CrossSigningHandler
from homeserver.handlers.e2e.key_backup import KeyBackupHandler
from homeserver.handlers.e2e.e2e_rules import (
    Step,
    check_device_keys,
    next_step,
    parse_user_devices,
    split_by_server,
)
from homeserver.handlers.ephemeral.federation_edus import OutboundEdus
from homeserver.events.validation import is_local_user_id, is_storable_text
from storage.id_generators import StreamIdGenerator
from storage.kernel.concurrency import map_concurrently
from storage.kernel.errors import MatrixError, bad_json, invalid_param, missing_param
from storage.stores.e2e import DeviceKeysRow, E2eStore, RemoteDevice
from storage.stores.timeline import RoomPosition
from storage.tokens import InvalidTokenError, RoomStreamToken, StreamToken, SyncStreamKey

logger = logging.getLogger(__name__)

MAX_KEYS_PER_UPLOAD = 1000
MAX_QUERY_USERS = 1000
# Servers asked at once by one /keys/query or /keys/claim.
REMOTE_CONCURRENCY: Final = 10
DEFAULT_REMOTE_TIMEOUT_S: Final = 10.0
MAX_REMOTE_TIMEOUT_S: Final = 30.0


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 255 or not is_storable_text(value):
        raise bad_json(f"{what} must be a non-empty string of at most 255 characters")
    return value


class KeyServerUnreachable(Exception):
    """Another server did not answer a key request (unreachable, timed out, an error status, or
    an answer that is not JSON)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RemoteKeys(Protocol):
    """Asking other servers (``homeserver.federation.devices.FederationKeyClient``); raises
    ``KeyServerUnreachable``."""

    async def user_devices(self, user_id: str) -> Any: ...

    async def query_keys(self, server: str, device_keys: Mapping[str, list[str]], timeout: float) -> Any: ...

    async def claim_keys(self, server: str, one_time_keys: Mapping[str, Any], timeout: float) -> Any: ...


def _request_timeout(body: Mapping[str, Any]) -> float:
    timeout = body.get("timeout", DEFAULT_REMOTE_TIMEOUT_S * 1000)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < 2**53:
        raise bad_json("'timeout' must be a non-negative integer of milliseconds")
    return min(max(timeout / 1000.0, 0.1), MAX_REMOTE_TIMEOUT_S)


def _device_keys_json(row: DeviceKeysRow) -> dict[str, Any]:
    keys: dict[str, Any] = json.loads(row.key_json)
    if row.display_name is not None:
        keys["unsigned"] = {**keys.get("unsigned", {}), "device_display_name": row.display_name}
    return keys


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
        remote: RemoteKeys | None = None,
        room_position: Callable[[RoomStreamToken], Awaitable[RoomPosition]] | None = None,
        noted: Callable[[int, frozenset[str]], None] | None = None,
    ) -> None:
        self._room_position = room_position
        # Told each to-device position this process writes and its local recipients, before
        # the position completes (``KeyNotes``: a waiting /sync sleeps through others' messages).
        self._noted = noted
        # Set by the composition root once built (it reports key changes back here).
        self.cross_signing: CrossSigningHandler | None = None
        # Server-side key backup, served beside the keys (set by the composition root).
        self.key_backup: KeyBackupHandler | None = None
        self._device_lists_stream = device_lists_stream
        self._store = store
        self._stream = to_device_stream
        self._server_name = server_name
        self._device_ids = device_ids
        # To-device messages and device changes for other servers go through this; None in a
        # process that sends no EDUs.
        self._federation = federation
        # Other servers' key answers and device lists; None: local users only.
        self._remote = remote
        # One remote user's updates are applied one at a time (this process writes the stream).
        self._user_locks: dict[str, tuple[DeferredLock, list[int]]] = {}

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
            if self._noted is not None:
                self._noted(stream_id, frozenset(user_id for user_id, _, _ in rows))
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
                if self._noted is not None:
                    self._noted(stream_id, frozenset(user_id for user_id, _, _ in rows))
        return len(rows)

    # --- device lists ---------------------------------------------------------------------------

    async def local_devices_changed(self, user_id: str, device_ids: Sequence[str], *, deleted: bool = False) -> None:
        """A local user's devices were added, renamed, deleted or got new keys: one fact on the
        device-list stream, then the servers sharing a room with the user are told (the federation
        sender reads the ``m.device_list_update`` they get from the stream, with the device's keys
        and name; ``prev_id``: the user's previous fact)."""
        if self._device_lists_stream is None or not device_ids:
            return
        stream = self._device_lists_stream
        async with stream.get_next() as stream_id:
            prev = await self._store.record_device_change(
                stream_id, stream.instance_name or "master", user_id, device_ids, deleted=deleted
            )
        if self._federation is None:
            return
        # A wake-up with the fact's identity: what is sent is read from the stream, so it outlives
        # the destination's downtime and this process (docs/federation-sender.md).
        await self._federation.device_list_update({
            "user_id": user_id, "device_id": device_ids[0], "stream_id": stream_id,
            "prev_id": [] if prev is None else [prev], "deleted": deleted,
        })

    async def cross_signing_changed(self, user_id: str, device_ids: list[str], public_keys: list[str],
                                    update: Mapping[str, Any] | None) -> None:
        """``CrossSigningHandler``'s report: devices that gained signatures are device-list changes
        (their keys go out with the signatures), changed cross-signing keys a fact on the stream and,
        for master and self-signing keys, an ``m.signing_key_update``."""
        if device_ids:
            await self.local_devices_changed(user_id, device_ids)
        if public_keys and self._device_lists_stream is not None:
            stream = self._device_lists_stream
            async with stream.get_next() as stream_id:
                await self._store.record_device_change(
                    stream_id, stream.instance_name or "master", user_id, public_keys)
            if update is not None and self._federation is not None:
                # The fact on the stream is what is sent (durably); this wakes the senders.
                await self._federation.signing_key_update(update, stream_id)

    async def apply_remote_signing_key_update(self, user_id: str, master_key: Mapping[str, Any] | None,
                                              self_signing_key: Mapping[str, Any] | None) -> None:
        """An ``m.signing_key_update`` EDU (checked by the caller): cache the keys and tell local users."""
        if self.cross_signing is None or self._device_lists_stream is None:
            return
        await self.cross_signing.cache_remote(user_id, master_key, self_signing_key)
        stream = self._device_lists_stream
        async with stream.get_next() as stream_id:
            await self._store.record_device_change(stream_id, stream.instance_name or "master", user_id, [""])

    async def devices_deleted(self, user_id: str, device_ids: Sequence[str]) -> None:
        """``DeviceHandler``'s deletion hook: the devices' keys go, and the list changed."""
        await self._store.delete_devices_keys(user_id, device_ids)
        await self.local_devices_changed(user_id, device_ids, deleted=True)

    async def apply_remote_device_list_update(
        self, user_id: str, device_id: str, *, deleted: bool, keys: Mapping[str, Any] | None,
        stream_id: int | None = None, prev_ids: Sequence[int] = (), display_name: str | None = None,
    ) -> None:
        """An ``m.device_list_update`` EDU (checked by the caller): applied when it follows on the
        cached list, ignored when seen already, else the whole list is fetched again; each change
        tells local users' ``/sync`` (``device_lists.changed``)."""
        if self._device_lists_stream is None:
            return
        async with self._user_lock(user_id):
            cached = (await self._store.get_remote_list_state([user_id])).get(user_id)
            step = Step.RESYNC if stream_id is None else next_step(
                None if cached is None else cached.stream_id, stream_id, prev_ids
            )
            if step is Step.APPLY and cached is not None and cached.stale:
                step = Step.RESYNC  # the cache missed something: an update on top of it is not enough
            if step is Step.IGNORE:
                return
            if step is Step.RESYNC or stream_id is None:
                await self._resync(user_id, cached is not None)
                return
            stream = self._device_lists_stream
            async with stream.get_next() as local_id:
                await self._store.apply_remote_device_update(
                    local_id, stream.instance_name or "master", user_id, stream_id, device_id, deleted=deleted,
                    key_json=None if keys is None else json.dumps(keys), display_name=display_name,
                )

    async def _resync(self, user_id: str, cached: bool) -> bool:
        """Fetch ``user_id``'s whole device list from its server into the cache; False (and the
        cache marked stale) when that fails."""
        if self._remote is None or self._device_lists_stream is None:
            return False
        try:
            answer = await self._remote.user_devices(user_id)
            stream_id, devices = parse_user_devices(user_id, answer)
        except (KeyServerUnreachable, MatrixError) as e:
            logger.warning("device list of %s not fetched: %s", user_id, str(e)[:300])
            if cached:
                await self._store.mark_remote_stale(user_id)
            return False
        stream = self._device_lists_stream
        async with stream.get_next() as local_id:
            await self._store.replace_remote_device_list(
                local_id, stream.instance_name or "master", user_id, stream_id,
                [RemoteDevice(d, name, None if keys is None else json.dumps(keys)) for d, name, keys in devices],
            )
        if self.cross_signing is not None:
            await self.cross_signing.cache_remote(user_id, answer.get("master_key"), answer.get("self_signing_key"))
        return True

    @asynccontextmanager
    async def _user_lock(self, user_id: str) -> AsyncIterator[None]:
        """Hold ``user_id``'s lock; the entry goes when nobody holds or waits for it."""
        entry = self._user_locks.get(user_id)
        if entry is None:
            entry = self._user_locks[user_id] = (DeferredLock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            await lock.acquire()
            try:
                yield
            finally:
                lock.release()
        finally:
            users[0] -= 1
            if users[0] == 0:
                self._user_locks.pop(user_id, None)

    async def device_list_changes(self, user_id: str, after: int, upto: int) -> list[str]:
        """Users sharing a room with ``user_id`` (and itself) whose devices changed in (after, upto]."""
        return await self._store.get_device_list_changes(user_id, after, upto)

    async def device_list_summary(
        self, user_id: str, devices_range: tuple[int, int] | None, since: RoomPosition, upto: RoomPosition,
    ) -> dict[str, list[str]]:
        """``device_lists`` of ``/sync`` and ``/keys/changes``: ``changed``, users whose devices changed
        or who began sharing a room with ``user_id``; ``left``, users who no longer share any."""
        changed = set(await self.device_list_changes(user_id, *devices_range)) if devices_range else set()
        if since == upto:  # no membership changed
            return {"changed": sorted(changed), "left": []}
        membership = await self._store.get_membership_device_changes(user_id, since, upto)
        changed |= membership.changed
        return {"changed": sorted(changed), "left": sorted(membership.left - changed)}

    async def to_device_for(self, requester: Requester, after: int, upto: int) -> list[Any]:
        return [json.loads(m) for m in await self._store.get_to_device(requester.user_id, requester.device_id, after, upto)]

    async def to_device_page(self, requester: Requester, after: int, upto: int, limit: int) -> tuple[list[Any], int]:
        """Sliding sync's ``to_device``: at most ``limit`` messages in (after, upto] (those up to
        ``after`` deleted as acknowledged), and the position they reach (its ``next_batch``)."""
        messages, reached = await self._store.get_to_device_page(
            requester.user_id, requester.device_id, after, upto, limit=limit)
        return [json.loads(m) for m in messages], reached

    async def key_changes(self, user_id: str, from_text: str | None, to_text: str | None) -> dict[str, list[str]]:
        """``GET /keys/changes?from=&to=``: ``device_lists`` between two ``/sync`` tokens."""
        if not from_text or not to_text:
            raise missing_param("'from' and 'to' are both required")
        try:
            start, end = StreamToken.parse(from_text), StreamToken.parse(to_text)
            if self._room_position is None:
                raise InvalidTokenError("events", from_text, "this process reads no room positions")
            since, upto = await self._room_position(start.events), await self._room_position(end.events)
        except InvalidTokenError as e:
            raise invalid_param(str(e)) from None
        after = start.get(SyncStreamKey.DEVICE_LISTS).max_position
        until = end.get(SyncStreamKey.DEVICE_LISTS).max_position
        return await self.device_list_summary(user_id, (after, until) if until > after else None, since, upto)

    # --- keys ---------------------------------------------------------------------------------------

    async def upload_keys(self, requester: Requester, body: dict[str, Any]) -> dict[str, Any]:
        user_id, device_id = requester.user_id, requester.device_id
        device_keys = body.get("device_keys")
        one_time = body.get("one_time_keys")
        fallback = body.get("fallback_keys", body.get("org.matrix.msc2732.fallback_keys"))
        keys = None if device_keys is None else check_device_keys(device_keys, user_id, device_id)
        otk_rows = [] if one_time is None else _key_rows(one_time, "one_time_keys")
        fallback_rows = [] if fallback is None else _key_rows(fallback, "fallback_keys")
        if keys is not None and await self._store.set_device_keys(user_id, device_id, json.dumps(keys)):
            await self.local_devices_changed(user_id, [device_id])
        if otk_rows:
            await self._store.add_one_time_keys(user_id, device_id, otk_rows)
        if fallback_rows:
            await self._store.set_fallback_keys(user_id, device_id, fallback_rows)
        return {"one_time_key_counts": await self.one_time_key_counts(requester)}

    async def one_time_key_counts(self, requester: Requester) -> dict[str, int]:
        counts = await self._store.count_one_time_keys(requester.user_id, requester.device_id)
        counts.setdefault("signed_curve25519", 0)
        return counts

    async def unused_fallback_key_types(self, requester: Requester) -> list[str]:
        return await self._store.unused_fallback_key_types(requester.user_id, requester.device_id)

    async def key_counts(self, requester: Requester) -> tuple[dict[str, int], list[str]]:
        """``/sync``'s ``device_one_time_keys_count`` and ``device_unused_fallback_key_types``."""
        counts, fallback = await self._store.key_counts(requester.user_id, requester.device_id)
        counts.setdefault("signed_curve25519", 0)
        return counts, fallback

    async def local_device_keys(self, query: Mapping[str, list[str]]) -> dict[str, dict[str, Any]]:
        """The keys of local users' devices (``/keys/query`` and federation's ``/user/keys/query``)."""
        found = await self._store.get_device_keys(query)
        keys = {user: {d: _device_keys_json(row) for d, row in devices.items()} for user, devices in found.items()}
        if self.cross_signing is not None:
            await self.cross_signing.device_signatures(keys)
        return keys

    async def query_keys(self, body: dict[str, Any], requester_id: str | None = None) -> dict[str, Any]:
        wanted = body.get("device_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'device_keys' must be an object of user ID -> device IDs")
        timeout = _request_timeout(body)
        query: dict[str, list[str]] = {}
        for user_id, device_ids in wanted.items():
            if not isinstance(device_ids, list) or len(device_ids) > MAX_KEYS_PER_UPLOAD:
                raise bad_json("each user's device IDs must be a list")
            query[_text(user_id, "user ID")] = [_text(d, "device ID") for d in device_ids]
        local, remote = split_by_server(query, self._server_name)
        if self._remote is None:
            remote = {}
        # Remote users whose lists are cached and fresh are answered from the cache.
        states = await self._store.get_remote_list_state([u for users in remote.values() for u in users])
        cached = {u: d for users in remote.values() for u, d in users.items() if u in states and not states[u].stale}
        device_keys = await self.local_device_keys({**local, **cached})
        failures: dict[str, Any] = {}
        ask = {server: {u: d for u, d in users.items() if u not in cached} for server, users in remote.items()}
        ask = {server: users for server, users in ask.items() if users}

        answers: dict[str, Any] = {}

        async def one(server: str) -> dict[str, Any]:
            assert self._remote is not None
            try:
                answer = await self._remote.query_keys(server, ask[server], timeout)
            except KeyServerUnreachable as e:
                failures[server] = {"status": e.status, "message": str(e)[:300]}
                return {}
            answers[server] = answer
            return _remote_device_keys(answer, ask[server])

        for found in await map_concurrently(one, sorted(ask), limit=REMOTE_CONCURRENCY):
            device_keys.update(found)
        result: dict[str, Any] = {"device_keys": device_keys, "failures": failures}
        if self.cross_signing is not None:
            result.update(await self.cross_signing.keys_for_query(requester_id or "", [*local, *cached]))
            for server, answer in answers.items():
                for field in ("master_keys", "self_signing_keys"):
                    given = answer.get(field) if isinstance(answer, dict) else None
                    if isinstance(given, dict):
                        result[field].update({u: k for u, k in given.items() if u in ask[server] and isinstance(k, dict)
                                              and k.get("user_id") == u})
        return result

    async def local_claim(self, query: Sequence[tuple[str, str, str]]) -> dict[str, dict[str, dict[str, Any]]]:
        claimed = await self._store.claim_one_time_keys(query[:MAX_KEYS_PER_UPLOAD])
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for user_id, device_id, algorithm, key_id, key_json in claimed:
            out.setdefault(user_id, {}).setdefault(device_id, {})[f"{algorithm}:{key_id}"] = json.loads(key_json)
        return out

    async def claim_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        wanted = body.get("one_time_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'one_time_keys' must be an object of user ID -> device ID -> algorithm")
        timeout = _request_timeout(body)
        query: list[tuple[str, str, str]] = []
        for user_id, devices in wanted.items():
            if not isinstance(devices, dict):
                raise bad_json("each user's entry must be an object of device ID -> algorithm")
            for device_id, algorithm in devices.items():
                query.append((_text(user_id, "user ID"), _text(device_id, "device ID"), _text(algorithm, "algorithm")))
        _, remote = split_by_server(wanted, self._server_name)
        out = await self.local_claim([q for q in query if is_local_user_id(q[0], self._server_name)])
        failures: dict[str, Any] = {}
        if self._remote is None:
            remote = {}

        async def one(server: str) -> dict[str, Any]:
            assert self._remote is not None
            try:
                answer = await self._remote.claim_keys(server, remote[server], timeout)
            except KeyServerUnreachable as e:
                failures[server] = {"status": e.status, "message": str(e)[:300]}
                return {}
            return _remote_one_time_keys(answer, remote[server])

        for found in await map_concurrently(one, sorted(remote), limit=REMOTE_CONCURRENCY):
            out.update(found)
        return {"one_time_keys": out, "failures": failures}


def _key_rows(keys: object, what: str) -> list[tuple[str, str, str]]:
    """``'<algorithm>:<key_id>' -> key`` as (algorithm, key_id, key JSON) rows."""
    if not isinstance(keys, dict) or len(keys) > MAX_KEYS_PER_UPLOAD:
        raise bad_json(f"'{what}' must be an object of at most {MAX_KEYS_PER_UPLOAD} keys")
    rows = []
    for full_id, key in keys.items():
        algorithm, sep, key_id = _text(full_id, f"{what} key ID").partition(":")
        if not sep or not algorithm or not key_id:
            raise bad_json(f"{what} key IDs are '<algorithm>:<key_id>'")
        if not isinstance(key, (dict, str)):
            raise bad_json(f"a key of '{what}' must be a string or an object")
        rows.append((algorithm, key_id, json.dumps(key)))
    return rows


def _remote_device_keys(answer: object, asked: Mapping[str, list[str]]) -> dict[str, dict[str, Any]]:
    """The users asked of a ``/user/keys/query`` answer, each device's keys for that user and device."""
    device_keys = answer.get("device_keys") if isinstance(answer, dict) else None
    if not isinstance(device_keys, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for user_id, devices in device_keys.items():
        if user_id not in asked or not isinstance(devices, dict):
            continue
        out[user_id] = {
            device_id: keys for device_id, keys in devices.items()
            if isinstance(keys, dict) and keys.get("user_id") == user_id and keys.get("device_id") == device_id
        }
    return out


def _remote_one_time_keys(answer: object, asked: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The users and devices asked of a ``/user/keys/claim`` answer."""
    claimed = answer.get("one_time_keys") if isinstance(answer, dict) else None
    if not isinstance(claimed, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for user_id, devices in claimed.items():
        wanted = asked.get(user_id)
        if not isinstance(wanted, dict) or not isinstance(devices, dict) or not is_valid_user_id(user_id):
            continue
        out[user_id] = {d: keys for d, keys in devices.items() if d in wanted and isinstance(keys, dict)}
    return out
