"""Server-side key backup (``/room_keys``): versions a user creates, and the room keys clients back up in them.

The server stores what clients send and never reads ``auth_data`` or
``session_data`` (they are the client's, encrypted). What it decides:

- which version is current (the newest not deleted); writing keys to any other
  version is ``403 M_WRONG_ROOM_KEYS_VERSION`` with ``current_version``;
- whether an uploaded key replaces the stored one for its session
  (``should_replace``, the spec's rule: a verified key beats an unverified one,
  then the lower ``first_message_index``, then the lower ``forwarded_count``);
- the ``etag`` (moves on whenever the version's keys change) and ``count``.

No backup at all is ``404 M_NOT_FOUND``, as is an unknown or deleted version.
Backups are per user and no stream carries them: any process serves them.
"""

# tests: tests/unit/handlers/test_key_backup.py, tests/integration/test_client_e2e.py

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from homeserver.handlers.accounts.auth import Requester
from homeserver.events.validation import is_storable_text
from storage.kernel.errors import MatrixError, bad_json, invalid_param, missing_param, not_found
from storage.stores.key_backup import BackupVersion, KeyBackupStore, KeysWritten, RoomKey

MAX_KEYS_PER_UPLOAD: Final = 10_000
MAX_ID_LENGTH: Final = 255


def should_replace(stored: RoomKey, new: RoomKey) -> bool:
    """The spec's rule for a session already backed up: keep the better key."""
    if new.is_verified != stored.is_verified:
        return new.is_verified
    if new.first_message_index != stored.first_message_index:
        return new.first_message_index < stored.first_message_index
    return new.forwarded_count < stored.forwarded_count


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise bad_json(f"'{what}' must be a non-negative integer")
    return value


def _id(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or not is_storable_text(value):
        raise invalid_param(f"{what} must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    return value


def parse_key(room_id: str, session_id: str, data: object) -> RoomKey:
    """A ``KeyBackupData`` object for (room, session)."""
    if not isinstance(data, dict):
        raise bad_json("a backed-up key must be an object")
    verified = data.get("is_verified")
    if not isinstance(verified, bool):
        raise bad_json("'is_verified' must be a boolean")
    session_data = data.get("session_data")
    if not isinstance(session_data, dict):
        raise bad_json("'session_data' must be an object")
    return RoomKey(_id(room_id, "room ID"), _id(session_id, "session ID"),
                   _count(data.get("first_message_index"), "first_message_index"),
                   _count(data.get("forwarded_count"), "forwarded_count"), verified, json.dumps(session_data))


def parse_sessions(room_id: str, body: object) -> list[RoomKey]:
    """``{"sessions": {sessionId: KeyBackupData}}`` of one room."""
    sessions = body.get("sessions") if isinstance(body, dict) else None
    if not isinstance(sessions, dict):
        raise bad_json("'sessions' must be an object of session ID -> key")
    return [parse_key(room_id, session_id, data) for session_id, data in sessions.items()]


def parse_rooms(body: object) -> list[RoomKey]:
    """``{"rooms": {roomId: {"sessions": ...}}}``."""
    rooms = body.get("rooms") if isinstance(body, dict) else None
    if not isinstance(rooms, dict):
        raise bad_json("'rooms' must be an object of room ID -> sessions")
    return [key for room_id, room in rooms.items() for key in parse_sessions(room_id, room)]


def key_json(key: RoomKey) -> dict[str, Any]:
    return {"first_message_index": key.first_message_index, "forwarded_count": key.forwarded_count,
            "is_verified": key.is_verified, "session_data": json.loads(key.session_data)}


def parse_version(value: str | None) -> int:
    """A version as the API names it (a decimal string); anything else is no version of ours."""
    if value is None:
        raise missing_param("'version' is required")
    if not value.isdigit() or len(value) > 18:
        raise not_found(f"Unknown backup version {value[:50]!r}")
    return int(value)


def _version_json(version: BackupVersion) -> dict[str, Any]:
    return {"algorithm": version.algorithm, "auth_data": json.loads(version.auth_data), "count": version.count,
            "etag": str(version.etag), "version": str(version.version)}


def _written(written: KeysWritten | None, version: int) -> dict[str, Any]:
    if written is None:
        raise not_found(f"Unknown backup version {version}")
    if written.current is not None:
        raise MatrixError(403, "M_WRONG_ROOM_KEYS_VERSION", "Wrong backup version",
                          current_version=str(written.current))
    return {"count": written.count, "etag": str(written.etag)}


def _algorithm_and_auth_data(body: Mapping[str, Any]) -> tuple[str, str]:
    algorithm = body.get("algorithm")
    if not isinstance(algorithm, str) or not algorithm or len(algorithm) > MAX_ID_LENGTH:
        raise bad_json("'algorithm' must be a non-empty string")
    auth_data = body.get("auth_data")
    if not isinstance(auth_data, dict):
        raise bad_json("'auth_data' must be an object")
    return algorithm, json.dumps(auth_data)


class KeyBackupHandler:
    def __init__(self, store: KeyBackupStore) -> None:
        self._store = store

    async def create_version(self, requester: Requester, body: Mapping[str, Any]) -> dict[str, Any]:
        algorithm, auth_data = _algorithm_and_auth_data(body)
        return {"version": str(await self._store.create_version(requester.user_id, algorithm, auth_data))}

    async def get_version(self, requester: Requester, version: str | None) -> dict[str, Any]:
        found = await self._store.get_version(requester.user_id, None if version is None else parse_version(version))
        if found is None:
            raise not_found("No current backup version" if version is None else f"Unknown backup version {version}")
        return _version_json(found)

    async def update_version(self, requester: Requester, version: str, body: Mapping[str, Any]) -> dict[str, Any]:
        number = parse_version(version)
        algorithm, auth_data = _algorithm_and_auth_data(body)
        if "version" in body and body["version"] != version:
            raise invalid_param("'version' in the body must match the path")
        found = await self._store.get_version(requester.user_id, number)
        if found is None:
            raise not_found(f"Unknown backup version {version}")
        if found.algorithm != algorithm:
            raise invalid_param("'algorithm' cannot change; create a new version")
        await self._store.update_version(requester.user_id, number, auth_data)
        return {}

    async def delete_version(self, requester: Requester, version: str) -> dict[str, Any]:
        if not await self._store.delete_version(requester.user_id, parse_version(version)):
            raise not_found(f"Unknown backup version {version}")
        return {}

    async def put_keys(self, requester: Requester, version: str | None, room_id: str | None,
                       session_id: str | None, body: object) -> dict[str, Any]:
        number = parse_version(version)
        if room_id is None:
            keys = parse_rooms(body)
        elif session_id is None:
            keys = parse_sessions(room_id, body)
        else:
            keys = [parse_key(room_id, session_id, body)]
        if len(keys) > MAX_KEYS_PER_UPLOAD:
            raise bad_json(f"at most {MAX_KEYS_PER_UPLOAD} keys per upload")
        return _written(await self._store.put_keys(requester.user_id, number, keys, should_replace), number)

    async def get_keys(self, requester: Requester, version: str | None, room_id: str | None,
                       session_id: str | None) -> dict[str, Any]:
        number = parse_version(version)
        if await self._store.get_version(requester.user_id, number) is None:
            raise not_found(f"Unknown backup version {version}")
        keys = await self._store.get_keys(requester.user_id, number, room_id, session_id)
        if session_id is not None:
            if not keys:
                raise not_found("No backed-up key for this session")
            return key_json(keys[0])
        sessions: dict[str, dict[str, Any]] = {}
        for key in keys:
            sessions.setdefault(key.room_id, {})[key.session_id] = key_json(key)
        if room_id is not None:
            return {"sessions": sessions.get(room_id, {})}
        return {"rooms": {room: {"sessions": by_session} for room, by_session in sessions.items()}}

    async def delete_keys(self, requester: Requester, version: str | None, room_id: str | None,
                          session_id: str | None) -> dict[str, Any]:
        number = parse_version(version)
        return _written(await self._store.delete_keys(requester.user_id, number, room_id, session_id), number)
