"""Where media bytes live: the storage-provider interface and the local-disk provider.

A provider stores opaque blobs under the lower-case hex SHA-256 of their bytes, so identical
uploads (and identical thumbnails) share one blob, and a name can only ever be 64 hex
digits: no media ID, file name or remote answer reaches a path. The metadata (which media ID
names which hash) is in PostgreSQL (storage/stores/media.py); a provider knows none of it.

Another provider (an S3-compatible bucket, say) implements ``MediaStorageProvider`` and is
chosen in ``MediaRepository``'s construction (docs/media.md, "Storage providers").
"""

# tests: tests/unit/media/test_storage.py

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

from twisted.internet.threads import deferToThreadPool

from homeserver.media.rules import is_valid_sha256_hex


class MediaStorageProvider(Protocol):
    """Blobs by SHA-256. Every method may be called concurrently; ``store`` of a hash that
    exists is a no-op success; ``fetch`` of one that does not is None."""

    async def store(self, sha256: str, data: bytes) -> None: ...

    async def fetch(self, sha256: str) -> bytes | None: ...

    async def delete(self, sha256: str) -> None: ...


def shard_path(root: Path, sha256: str) -> Path:
    """``root/ab/cd/<rest>`` for hash ``abcd<rest>``: at most 256 entries per directory level."""
    if not is_valid_sha256_hex(sha256):
        raise ValueError(f"not a lower-case hex SHA-256: {sha256[:80]!r}")
    return root / sha256[:2] / sha256[2:4] / sha256[4:]


class LocalDiskStorage:
    """Files under ``root`` (``media.store_path``, by default ``<data_dir>/media``), written to a
    temporary file and renamed into place, so a reader never sees half a file. Disk I/O runs on
    the reactor's thread pool."""

    def __init__(self, root: Path, reactor: Any) -> None:
        self.root = root
        self._reactor = reactor

    async def _in_thread(self, func: Any, *args: Any) -> Any:
        return await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), func, *args)

    async def store(self, sha256: str, data: bytes) -> None:
        await self._in_thread(self._store_sync, shard_path(self.root, sha256), data)

    @staticmethod
    def _store_sync(path: Path, data: bytes) -> None:
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    async def fetch(self, sha256: str) -> bytes | None:
        result: bytes | None = await self._in_thread(self._fetch_sync, shard_path(self.root, sha256))
        return result

    @staticmethod
    def _fetch_sync(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    async def delete(self, sha256: str) -> None:
        await self._in_thread(self._delete_sync, shard_path(self.root, sha256))

    @staticmethod
    def _delete_sync(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
