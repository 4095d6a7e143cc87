"""Media against a real database and disk, in-process (its store at hand): a retention pass run
on demand (expired reservations, local media not viewed within ``local_media_lifetime`` and
cached remote media not viewed within ``remote_media_lifetime`` go, with their thumbnails and
files; media viewed recently, and files other media still names, stay), and the freeze of the
unauthenticated endpoints."""

from __future__ import annotations

import hashlib
from pathlib import Path

import psycopg2
from twisted.internet import task

from homeserver.media.storage import LocalDiskStorage
from storage.stores.media import MediaStore, RemoteMedia
from tests.integration.media_support import png
from tests.integration.test_client_support import SERVER_NAME, running_server
from tests.twisted_plugin import reactor

DAY_MS = 86_400_000


def sql(dsn: str, statement: str, *args: object) -> None:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(statement, args)
    conn.close()


async def test_a_retention_pass(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, data_dir=str(tmp_path / "data"), media={
            "local_media_lifetime": "30d", "remote_media_lifetime": "7d"}) as (hs, client):
        repo = hs.process.services.media
        assert repo is not None
        token = (await client.register_ok("keeper"))["access_token"]

        async def upload(data: bytes, content_type: str) -> str:
            response = await client.request("POST", "/_matrix/media/v3/upload", raw=data, token=token,
                                            headers={"Content-Type": content_type})
            assert response.status == 200, response
            return str(response.body["content_uri"]).rsplit("/", 1)[1]

        shared = b"the same bytes twice"
        old, recent = await upload(png(64, 64), "image/png"), await upload(b"recent", "text/plain")
        old_copy, kept_copy = await upload(shared, "text/plain"), await upload(shared, "text/plain")
        thumb = await client.request("GET", f"/_matrix/client/v1/media/thumbnail/{SERVER_NAME}/{old}?width=32&height=32",
                                     token=token)
        assert thumb.status == 200
        reserved = await client.request("POST", "/_matrix/media/v1/create", token=token)
        pending = str(reserved.body["content_uri"]).rsplit("/", 1)[1]

        store, disk = MediaStore(hs.process.db), LocalDiskStorage(tmp_path / "data" / "media", reactor)
        # The upload's five thumbnail sizes are made in the background: let them finish first.
        for _ in range(200):
            if len(await store.get_thumbnails(SERVER_NAME, old)) == 5:
                break
            await task.deferLater(reactor, 0.05, lambda: None)
        assert len(await store.get_thumbnails(SERVER_NAME, old)) == 5

        now = int(reactor.seconds() * 1000)
        sql(database_dsn, "UPDATE local_media SET last_access_ts = %s WHERE media_id IN (%s, %s)",
            now - 31 * DAY_MS, old, old_copy)
        sql(database_dsn, "UPDATE local_media SET unused_expires_ts = %s WHERE media_id = %s", now - 1, pending)
        # Two cached remote files: one viewed 8 days ago, one yesterday.
        for media_id, age in (("stale", 8), ("fresh", 1)):
            data = media_id.encode() * 10
            digest = hashlib.sha256(data).hexdigest()
            await disk.store(digest, data)
            await store.insert_remote(RemoteMedia("remote.example", media_id, "text/plain", None, len(data), digest,
                                                  None), now - age * DAY_MS)

        assert await repo.purge_expired() == 4  # old, old_copy, the reservation, the stale remote file

        for media_id, status in ((old, 404), (old_copy, 404), (pending, 404), (recent, 200), (kept_copy, 200)):
            response = await client.request("GET", f"/_matrix/client/v1/media/download/{SERVER_NAME}/{media_id}"
                                                   "?timeout_ms=0", token=token)
            assert response.status == status, (media_id, response)
        assert await store.get_remote("remote.example", "stale") is None
        assert await store.get_remote("remote.example", "fresh") is not None
        assert await store.get_thumbnails(SERVER_NAME, old) == []
        files = {p.name for p in (tmp_path / "data" / "media").rglob("*") if p.is_file()}
        assert hashlib.sha256(shared).hexdigest()[4:] in files  # still named by kept_copy
        assert hashlib.sha256(b"stale" * 10).hexdigest()[4:] not in files
        assert hashlib.sha256(png(64, 64)).hexdigest()[4:] not in files
        assert await repo.purge_expired() == 0


async def test_frozen_unauthenticated_endpoints(database_dsn: str, tmp_path: Path) -> None:
    """With ``freeze_unauthenticated_media``, media stored from then on is served only by the
    authenticated endpoints; media stored before (unmarked) is still served by the old ones."""
    async with running_server(database_dsn, tmp_path, data_dir=str(tmp_path / "data"),
                              media={"freeze_unauthenticated_media": True}) as (hs, client):
        token = (await client.register_ok("frozen"))["access_token"]
        data = png(40, 40)
        response = await client.request("POST", "/_matrix/media/v3/upload", raw=data, token=token,
                                        headers={"Content-Type": "image/png"})
        new = str(response.body["content_uri"]).rsplit("/", 1)[1]
        store, disk = MediaStore(hs.process.db), LocalDiskStorage(tmp_path / "data" / "media", reactor)
        old_bytes = b"stored before the freeze"
        digest = hashlib.sha256(old_bytes).hexdigest()
        await disk.store(digest, old_bytes)
        await store.insert_local("oldmedia", "@frozen:test.local", 0, "text/plain", None, len(old_bytes), digest)
        thumb = "?width=32&height=32"
        for path, authed, status in [
            (f"/_matrix/client/v1/media/download/{SERVER_NAME}/{new}", True, 200),
            (f"/_matrix/client/v1/media/thumbnail/{SERVER_NAME}/{new}{thumb}", True, 200),
            (f"/_matrix/media/v3/download/{SERVER_NAME}/{new}", False, 404),
            (f"/_matrix/media/v3/thumbnail/{SERVER_NAME}/{new}{thumb}", False, 404),
            (f"/_matrix/media/v3/download/{SERVER_NAME}/oldmedia", False, 200),
            ("/_matrix/media/v3/download/remote.example/notcached", False, 404),
        ]:
            answer = await client.request("GET", path, token=token if authed else None)
            assert answer.status == status, (path, answer)
