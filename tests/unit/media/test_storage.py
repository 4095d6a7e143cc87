"""The local-disk storage provider: sharded paths, content addressing, atomic writes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from homeserver.media.storage import LocalDiskStorage, shard_path
from tests.twisted_plugin import reactor


def test_shard_path_is_two_levels_and_refuses_anything_but_a_hash(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    assert shard_path(tmp_path, digest) == tmp_path / digest[:2] / digest[2:4] / digest[4:]
    for bad in ["../../etc/passwd", digest.upper(), digest[:-1], digest + "0", "", "/" + digest[1:]]:
        with pytest.raises(ValueError):
            shard_path(tmp_path, bad)


async def test_store_fetch_delete(tmp_path: Path) -> None:
    storage = LocalDiskStorage(tmp_path / "media", reactor)
    data = b"hello media"
    digest = hashlib.sha256(data).hexdigest()
    assert await storage.fetch(digest) is None
    await storage.store(digest, data)
    await storage.store(digest, data)  # a second store of the same bytes is a no-op
    assert await storage.fetch(digest) == data
    assert [p.name for p in (tmp_path / "media").rglob("*") if p.is_file()] == [digest[4:]]
    await storage.delete(digest)
    await storage.delete(digest)
    assert await storage.fetch(digest) is None
