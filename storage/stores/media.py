"""The media repository's metadata: local uploads, the remote media cache, thumbnails, admins.

This store owns ``local_media``, ``remote_media`` and ``media_thumbnails`` (0012_media.sql),
and reads ``users.admin``. It knows nothing of files: the bytes live in a storage provider
(homeserver/media/storage.py) under their SHA-256, which is why deleting a row answers
whether any other row still names the same hash (only then may the file go).
"""

# tests: tests/integration/test_media.py, tests/integration/test_media_retention.py

from __future__ import annotations

import attrs

from storage.database import Database, Transaction

_LOCAL_COLUMNS = ("media_id, user_id, created_ts, content_type, upload_name, size, sha256, unused_expires_ts, "
                  "quarantined_by, authenticated")


@attrs.frozen
class LocalMedia:
    media_id: str
    user_id: str
    created_ts: int
    content_type: str | None
    upload_name: str | None
    size: int | None
    # None while an asynchronous upload waits for its bytes.
    sha256: str | None
    unused_expires_ts: int | None
    quarantined_by: str | None
    # Stored while the unauthenticated endpoints were frozen: never served by them.
    authenticated: bool = False


@attrs.frozen
class RemoteMedia:
    origin: str
    media_id: str
    content_type: str | None
    upload_name: str | None
    size: int
    sha256: str
    quarantined_by: str | None
    authenticated: bool = False


@attrs.frozen
class Thumbnail:
    width: int
    height: int
    method: str
    animated: bool
    content_type: str
    size: int
    sha256: str


def _local(row: tuple[object, ...]) -> LocalMedia:
    return LocalMedia(*row)  # type: ignore[arg-type]


def _get_local_txn(txn: Transaction, media_id: str) -> LocalMedia | None:
    txn.execute(f"SELECT {_LOCAL_COLUMNS} FROM local_media WHERE media_id = %s", (media_id,))
    row = txn.fetchone()
    return None if row is None else _local(row)


def _create_pending_txn(txn: Transaction, media_id: str, user_id: str, now_ms: int, expires_ms: int,
                        max_pending: int, authenticated: bool) -> bool:
    """Reserve ``media_id`` for a later upload; False when the user already has ``max_pending``."""
    txn.execute("SELECT pg_advisory_xact_lock(hashtext('media_pending:' || %s))", (user_id,))
    txn.execute("SELECT count(*) FROM local_media WHERE user_id = %s AND sha256 IS NULL AND unused_expires_ts > %s",
                (user_id, now_ms))
    row = txn.fetchone()
    if row is not None and row[0] >= max_pending:
        return False
    txn.execute("INSERT INTO local_media (media_id, user_id, created_ts, unused_expires_ts, authenticated)"
                " VALUES (%s, %s, %s, %s, %s)", (media_id, user_id, now_ms, expires_ms, authenticated))
    return True


def _insert_local_txn(txn: Transaction, media_id: str, user_id: str, now_ms: int, content_type: str,
                      upload_name: str | None, size: int, sha256: str, authenticated: bool) -> None:
    txn.execute(
        "INSERT INTO local_media (media_id, user_id, created_ts, content_type, upload_name, size, sha256,"
        " uploaded_ts, last_access_ts, authenticated) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (media_id, user_id, now_ms, content_type, upload_name, size, sha256, now_ms, now_ms, authenticated),
    )


def _fill_pending_txn(txn: Transaction, media_id: str, user_id: str, now_ms: int, content_type: str,
                      upload_name: str | None, size: int, sha256: str) -> str:
    """Give a pending media ID its bytes: "ok", or why not ("not_found", "forbidden", "exists",
    "expired")."""
    txn.execute("SELECT user_id, sha256, unused_expires_ts FROM local_media WHERE media_id = %s FOR UPDATE",
                (media_id,))
    row = txn.fetchone()
    if row is None:
        return "not_found"
    if row[0] != user_id:
        return "forbidden"
    if row[1] is not None:
        return "exists"
    if row[2] is not None and row[2] <= now_ms:
        return "expired"
    txn.execute(
        "UPDATE local_media SET content_type = %s, upload_name = %s, size = %s, sha256 = %s, uploaded_ts = %s,"
        " last_access_ts = %s, unused_expires_ts = NULL WHERE media_id = %s",
        (content_type, upload_name, size, sha256, now_ms, now_ms, media_id),
    )
    return "ok"


def _get_remote_txn(txn: Transaction, origin: str, media_id: str) -> RemoteMedia | None:
    txn.execute("SELECT origin, media_id, content_type, upload_name, size, sha256, quarantined_by, authenticated"
                " FROM remote_media WHERE origin = %s AND media_id = %s", (origin, media_id))
    row = txn.fetchone()
    return None if row is None else RemoteMedia(*row)


def _insert_remote_txn(txn: Transaction, media: RemoteMedia, now_ms: int) -> None:
    txn.execute(
        "INSERT INTO remote_media (origin, media_id, content_type, upload_name, size, sha256, fetched_ts,"
        " last_access_ts, authenticated) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
        " ON CONFLICT (origin, media_id) DO NOTHING",
        (media.origin, media.media_id, media.content_type, media.upload_name, media.size, media.sha256, now_ms,
         now_ms, media.authenticated),
    )


def _touch_txn(txn: Transaction, origin: str | None, media_id: str, now_ms: int) -> None:
    if origin is None:
        txn.execute("UPDATE local_media SET last_access_ts = %s WHERE media_id = %s", (now_ms, media_id))
    else:
        txn.execute("UPDATE remote_media SET last_access_ts = %s WHERE origin = %s AND media_id = %s",
                    (now_ms, origin, media_id))


def _quarantine_txn(txn: Transaction, origin: str | None, media_id: str, by: str) -> bool:
    if origin is None:
        txn.execute("UPDATE local_media SET quarantined_by = %s WHERE media_id = %s", (by, media_id))
    else:
        txn.execute("UPDATE remote_media SET quarantined_by = %s WHERE origin = %s AND media_id = %s",
                    (by, origin, media_id))
    return bool(txn.rowcount)


def _hashes_unused_txn(txn: Transaction, hashes: set[str]) -> list[str]:
    """Those of ``hashes`` that no row names any more (their files may be deleted)."""
    unused = []
    for digest in sorted(hashes):
        txn.execute(
            "SELECT EXISTS (SELECT 1 FROM local_media WHERE sha256 = %s)"
            " OR EXISTS (SELECT 1 FROM remote_media WHERE sha256 = %s)"
            " OR EXISTS (SELECT 1 FROM media_thumbnails WHERE sha256 = %s)",
            (digest, digest, digest),
        )
        row = txn.fetchone()
        if row is not None and not row[0]:
            unused.append(digest)
    return unused


def _delete_media_txn(txn: Transaction, origin: str | None, key_origin: str,
                      media_id: str) -> tuple[bool, list[str]]:
    """Delete a media ID and its thumbnails: whether the media ID was known (its thumbnails, left
    by a generation that raced a delete, go all the same), and the hashes no row names any more."""
    hashes: set[str] = set()
    if origin is None:
        txn.execute("DELETE FROM local_media WHERE media_id = %s RETURNING sha256", (media_id,))
    else:
        txn.execute("DELETE FROM remote_media WHERE origin = %s AND media_id = %s RETURNING sha256",
                    (origin, media_id))
    row = txn.fetchone()
    if row is not None and row[0] is not None:
        hashes.add(row[0])
    txn.execute("DELETE FROM media_thumbnails WHERE origin = %s AND media_id = %s RETURNING sha256",
                (key_origin, media_id))
    hashes.update(r[0] for r in txn.fetchall())
    return row is not None, _hashes_unused_txn(txn, hashes)


def _media_exists_txn(txn: Transaction, origin: str | None, media_id: str) -> bool:
    if origin is None:
        txn.execute("SELECT 1 FROM local_media WHERE media_id = %s", (media_id,))
    else:
        txn.execute("SELECT 1 FROM remote_media WHERE origin = %s AND media_id = %s", (origin, media_id))
    return txn.fetchone() is not None


def _get_thumbnails_txn(txn: Transaction, origin: str, media_id: str) -> list[Thumbnail]:
    txn.execute("SELECT width, height, method, animated, content_type, size, sha256 FROM media_thumbnails"
                " WHERE origin = %s AND media_id = %s", (origin, media_id))
    return [Thumbnail(*row) for row in txn.fetchall()]


def _insert_thumbnail_txn(txn: Transaction, origin: str, media_id: str, thumb: Thumbnail) -> None:
    txn.execute(
        "INSERT INTO media_thumbnails (origin, media_id, width, height, method, animated, content_type, size, sha256)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
        (origin, media_id, thumb.width, thumb.height, thumb.method, thumb.animated, thumb.content_type, thumb.size,
         thumb.sha256),
    )


def _expired_txn(txn: Transaction, now_ms: int, local_before: int | None, remote_before: int | None,
                 limit: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Media IDs past retention: local (not accessed since ``local_before``, or pending uploads that
    expired) and remote (not accessed since ``remote_before``), at most ``limit`` of each."""
    txn.execute("SELECT media_id FROM local_media WHERE (sha256 IS NULL AND unused_expires_ts <= %s)"
                " OR (%s::bigint IS NOT NULL AND sha256 IS NOT NULL AND last_access_ts < %s) LIMIT %s",
                (now_ms, local_before, local_before, limit))
    local = [row[0] for row in txn.fetchall()]
    remote: list[tuple[str, str]] = []
    if remote_before is not None:
        txn.execute("SELECT origin, media_id FROM remote_media WHERE last_access_ts < %s LIMIT %s",
                    (remote_before, limit))
        remote = [(row[0], row[1]) for row in txn.fetchall()]
    return local, remote


class MediaStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_local(self, media_id: str) -> LocalMedia | None:
        return await self._db.run_interaction("get_local_media", _get_local_txn, media_id)

    async def create_pending(self, media_id: str, user_id: str, now_ms: int, expires_ms: int, max_pending: int,
                             authenticated: bool = False) -> bool:
        return await self._db.run_interaction("create_pending_media", _create_pending_txn, media_id, user_id, now_ms,
                                              expires_ms, max_pending, authenticated)

    async def insert_local(self, media_id: str, user_id: str, now_ms: int, content_type: str,
                           upload_name: str | None, size: int, sha256: str, authenticated: bool = False) -> None:
        await self._db.run_interaction("insert_local_media", _insert_local_txn, media_id, user_id, now_ms,
                                       content_type, upload_name, size, sha256, authenticated)

    async def fill_pending(self, media_id: str, user_id: str, now_ms: int, content_type: str,
                           upload_name: str | None, size: int, sha256: str) -> str:
        return await self._db.run_interaction("fill_pending_media", _fill_pending_txn, media_id, user_id, now_ms,
                                              content_type, upload_name, size, sha256)

    async def get_remote(self, origin: str, media_id: str) -> RemoteMedia | None:
        return await self._db.run_interaction("get_remote_media", _get_remote_txn, origin, media_id)

    async def insert_remote(self, media: RemoteMedia, now_ms: int) -> None:
        await self._db.run_interaction("insert_remote_media", _insert_remote_txn, media, now_ms)

    async def touch(self, origin: str | None, media_id: str, now_ms: int) -> None:
        """Record a view (retention counts from the last one); ``origin`` None for local media."""
        await self._db.run_interaction("touch_media", _touch_txn, origin, media_id, now_ms)

    async def quarantine(self, origin: str | None, media_id: str, by: str) -> bool:
        return await self._db.run_interaction("quarantine_media", _quarantine_txn, origin, media_id, by)

    async def delete_media(self, origin: str | None, key_origin: str, media_id: str) -> tuple[bool, list[str]]:
        return await self._db.run_interaction("delete_media", _delete_media_txn, origin, key_origin, media_id)

    async def media_exists(self, origin: str | None, media_id: str) -> bool:
        return await self._db.run_interaction("media_exists", _media_exists_txn, origin, media_id)

    async def get_thumbnails(self, origin: str, media_id: str) -> list[Thumbnail]:
        return await self._db.run_interaction("get_media_thumbnails", _get_thumbnails_txn, origin, media_id)

    async def insert_thumbnail(self, origin: str, media_id: str, thumb: Thumbnail) -> None:
        await self._db.run_interaction("insert_media_thumbnail", _insert_thumbnail_txn, origin, media_id, thumb)

    async def unused_hashes(self, hashes: set[str]) -> list[str]:
        return await self._db.run_interaction("unused_media_hashes", _hashes_unused_txn, hashes)

    async def expired(self, now_ms: int, local_before: int | None, remote_before: int | None,
                      limit: int = 500) -> tuple[list[str], list[tuple[str, str]]]:
        return await self._db.run_interaction("expired_media", _expired_txn, now_ms, local_before, remote_before,
                                              limit)

