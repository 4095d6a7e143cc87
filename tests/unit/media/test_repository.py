"""The repository's ordering of file writes and deletes, with in-memory stand-ins for the
metadata store and the storage provider whose steps the test holds and releases: identical
bytes uploaded while a delete of the same file is under way keep their file."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred

from homeserver.media.config import MediaConfig
from homeserver.media.metrics import MediaMetrics
from homeserver.media.repository import MediaRepository
from tests.twisted_plugin import reactor


class Rows:
    """local_media as a dict: media ID -> sha256."""

    def __init__(self) -> None:
        self.local: dict[str, str] = {}

    async def unused_hashes(self, hashes: set[str]) -> list[str]:
        return sorted(h for h in hashes if h not in self.local.values())

    async def insert_local(self, media_id: str, user_id: str, now_ms: int, content_type: str, upload_name: Any,
                           size: int, sha256: str, authenticated: bool = False) -> None:
        self.local[media_id] = sha256

    async def delete_media(self, origin: Any, key_origin: str, media_id: str) -> tuple[bool, list[str]]:
        digest = self.local.pop(media_id, None)
        return digest is not None, [] if digest is None else await self.unused_hashes({digest})


class Files:
    """Blobs in a dict; ``delete`` waits for ``gate`` when one is set."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.gate: Deferred[None] | None = None

    async def store(self, sha256: str, data: bytes) -> None:
        self.blobs.setdefault(sha256, data)

    async def fetch(self, sha256: str) -> bytes | None:
        return self.blobs.get(sha256)

    async def delete(self, sha256: str) -> None:
        if self.gate is not None:
            await self.gate
        self.blobs.pop(sha256, None)


def repository() -> tuple[MediaRepository, Rows, Files]:
    rows, files = Rows(), Files()
    repo = MediaRepository(config=MediaConfig(), server_name="hs", store=rows, storage=files,  # type: ignore[arg-type]
                           remote=None, reactor=reactor, metrics=MediaMetrics.create(CollectorRegistry()))  # type: ignore[arg-type]
    return repo, rows, files


async def test_an_upload_during_a_delete_of_the_same_bytes_keeps_its_file() -> None:
    repo, rows, files = repository()
    first = (await repo.upload("@a:hs", b"same", "text/plain", None)).rsplit("/", 1)[1]
    files.gate = Deferred()
    deleting = Deferred.fromCoroutine(repo.delete("@admin:hs", "hs", first))
    assert not deleting.called  # the delete holds the file's lock, waiting to remove it
    uploading = Deferred.fromCoroutine(repo.upload("@b:hs", b"same", "text/plain", None))
    assert not uploading.called  # the upload waits for the lock
    files.gate.callback(None)
    await deleting
    second = (await uploading).rsplit("/", 1)[1]
    assert rows.local == {second: rows.local[second]}
    assert list(files.blobs.values()) == [b"same"]


async def test_deleting_one_of_two_identical_uploads_keeps_the_file() -> None:
    repo, rows, files = repository()
    one = (await repo.upload("@a:hs", b"twice", "text/plain", None)).rsplit("/", 1)[1]
    two = (await repo.upload("@a:hs", b"twice", "text/plain", None)).rsplit("/", 1)[1]
    await repo.delete("@admin:hs", "hs", one)
    assert list(files.blobs.values()) == [b"twice"]
    await repo.delete("@admin:hs", "hs", two)
    assert files.blobs == {}
