"""The media repository: what upload, download, thumbnail, quarantine and retention do.

One ``MediaRepository`` per process that serves media (the main process, or the
``media_repository`` worker: docs/workers.md); it alone writes the media tables. Bytes go to
a storage provider under their SHA-256 (homeserver/media/storage.py), metadata to
PostgreSQL (storage/stores/media.py). Servlets parse requests and call these methods; every
refusal is a ``MatrixError``. Pillow runs on the reactor's thread pool, never on the reactor.
"""

# tests: tests/integration/test_media.py, tests/integration/test_media_federation.py,
#        tests/integration/test_media_retention.py, tests/unit/media/test_repository.py

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import Deferred, DeferredLock, DeferredSemaphore
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool

from homeserver.remote.ttl_cache import TtlCache
from storage.kernel.ratelimit import Ratelimiter, ratelimit
from homeserver.media.config import MediaConfig
from homeserver.media.metrics import MediaMetrics
from homeserver.media.remote import (
    RemoteMediaFetcher,
    RemoteMediaNotFound,
    RemoteMediaTooLarge,
    RemoteMediaUnavailable,
)
from homeserver.media.rules import (
    THUMBNAIL_SOURCE_TYPES,
    ThumbnailSpec,
    base_type,
    choose_thumbnail,
    is_valid_media_id,
    new_media_id,
)
from homeserver.media.storage import MediaStorageProvider
from homeserver.media.thumbnailer import Rendered, ThumbnailError, TooManyPixels, probe, render
from storage.kernel.background import run_in_background
from storage.kernel.errors import MatrixError, forbidden, invalid_param, not_found
from storage.stores.media import MediaStore, RemoteMedia, Thumbnail

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long a download of a pending asynchronous upload waits for its bytes, by default and at most.
DEFAULT_PENDING_WAIT_MS = 20_000
MAX_PENDING_WAIT_MS = 60_000
TOUCH_INTERVAL_SECONDS = 3600.0
MAX_CONCURRENT_REMOTE_FETCHES = 10


@attrs.frozen
class MediaFile:
    """What a download or thumbnail serves."""

    content_type: str
    upload_name: str | None
    data: bytes


def too_large(error: str) -> MatrixError:
    return MatrixError(413, "M_TOO_LARGE", error)


class MediaRepository:
    def __init__(self, *, config: MediaConfig, server_name: str, store: MediaStore, storage: MediaStorageProvider,
                 remote: RemoteMediaFetcher, reactor: Any, metrics: MediaMetrics) -> None:
        self.config = config
        self.server_name = server_name
        self._store = store
        self._storage = storage
        self._remote = remote
        self._reactor = reactor
        self._metrics = metrics
        self._upload_limiter = Ratelimiter(config.rc_upload.per_second, config.rc_upload.burst_count)
        # Remote fetches in flight, so that concurrent requests for one remote file fetch it once.
        self._fetching: dict[tuple[str, str], list[Deferred[RemoteMedia]]] = {}
        # Media IDs whose last view was recorded within the hour (retention counts in days).
        self._recently_touched: TtlCache[tuple[str, str], bool] = TtlCache(ttl=TOUCH_INTERVAL_SECONDS,
                                                                           max_entries=100_000)
        # Remote files being fetched at once (each may be max_remote_media_size in memory).
        self._fetch_slots = DeferredSemaphore(MAX_CONCURRENT_REMOTE_FETCHES)
        # One lock per file hash being stored or deleted (see _keep).
        self._hash_locks: dict[str, DeferredLock] = {}
        # Downloads waiting for a pending upload's bytes (this process alone writes media).
        self._pending_waiters: dict[str, list[Deferred[None]]] = {}

    @property
    def metrics(self) -> MediaMetrics:
        return self._metrics

    def _now_ms(self) -> int:
        return int(self._reactor.seconds() * 1000)

    # --- upload ------------------------------------------------------------------------

    def check_upload_allowed(self, user_id: str, size: int) -> None:
        """Size first (413 M_TOO_LARGE), then the user's upload rate (429)."""
        if size > self.config.max_upload_size:
            self._metrics.uploads.labels(outcome="refused").inc()
            raise too_large(f"Upload is {size} bytes; the limit is {self.config.max_upload_size}")
        try:
            ratelimit(self._upload_limiter, user_id, self._reactor.seconds())
        except MatrixError:
            self._metrics.uploads.labels(outcome="refused").inc()
            raise

    # Files are shared by every row that names their hash, so storing a file and recording a row
    # that names it is one step, and so is checking no row names a hash and deleting its file: a
    # per-hash lock orders the two (only this process writes media), so an upload of identical
    # bytes never loses its file to a concurrent delete.

    async def _locked(self, digest: str, work: Callable[[], Awaitable[T]]) -> T:
        lock = self._hash_locks.setdefault(digest, DeferredLock())
        await lock.acquire()
        try:
            return await work()
        finally:
            lock.release()
            if not lock.locked and not lock.waiting:
                self._hash_locks.pop(digest, None)

    async def _keep(self, digest: str, data: bytes, record: Callable[[], Awaitable[T]]) -> T:
        """Store ``data`` under ``digest`` (a no-op when the file exists), then ``record`` the row."""

        async def work() -> T:
            await self._storage.store(digest, data)
            return await record()

        return await self._locked(digest, work)

    async def _drop_files(self, hashes: Iterable[str]) -> None:
        """Delete the files of those ``hashes`` that no row names (checked again under the lock)."""
        for digest in hashes:
            async def work(digest: str = digest) -> None:
                if await self._store.unused_hashes({digest}):
                    await self._storage.delete(digest)

            await self._locked(digest, work)

    async def _count_upload(self, digest: str, size: int) -> None:
        is_new = bool(await self._store.unused_hashes({digest}))
        self._metrics.uploads.labels(outcome="stored" if is_new else "deduplicated").inc()
        self._metrics.upload_bytes.inc(size)

    async def upload(self, user_id: str, data: bytes, content_type: str, upload_name: str | None) -> str:
        """Store a new upload; return its ``mxc://`` URI."""
        self.check_upload_allowed(user_id, len(data))
        digest = hashlib.sha256(data).hexdigest()
        await self._count_upload(digest, len(data))
        media_id = new_media_id()
        await self._keep(digest, data, lambda: self._store.insert_local(
            media_id, user_id, self._now_ms(), content_type, upload_name, len(data), digest, self.config.freeze_unauthenticated_media))
        self._after_upload(media_id, content_type, data)
        return f"mxc://{self.server_name}/{media_id}"

    async def store_preview_image(self, user_id: str, data: bytes, content_type: str) -> tuple[str, int, int]:
        """An image a URL preview fetched, stored as the asking user's media (no upload rate limit:
        the preview has its own limits): (``mxc://`` URI, width, height)."""
        pixels = self.config.max_image_pixels
        info = await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), lambda: probe(data, pixels))
        digest = hashlib.sha256(data).hexdigest()
        await self._count_upload(digest, len(data))
        media_id = new_media_id()
        await self._keep(digest, data, lambda: self._store.insert_local(
            media_id, user_id, self._now_ms(), content_type, None, len(data), digest, self.config.freeze_unauthenticated_media))
        self._after_upload(media_id, content_type, data)
        return f"mxc://{self.server_name}/{media_id}", info.width, info.height

    async def create(self, user_id: str) -> tuple[str, int]:
        """Reserve a media ID for an asynchronous upload: (``mxc://`` URI, expiry in ms)."""
        ratelimit(self._upload_limiter, user_id, self._reactor.seconds())
        now = self._now_ms()
        expires = now + int(self.config.unused_expiration_time.total_seconds() * 1000)
        media_id = new_media_id()
        if not await self._store.create_pending(media_id, user_id, now, expires, self.config.max_pending_uploads,
                                                self.config.freeze_unauthenticated_media):
            raise MatrixError(429, "M_LIMIT_EXCEEDED",
                              f"You have {self.config.max_pending_uploads} uploads waiting for their content already",
                              retry_after_ms=60_000)
        return f"mxc://{self.server_name}/{media_id}", expires

    async def upload_pending(self, user_id: str, server: str, media_id: str, data: bytes, content_type: str,
                             upload_name: str | None) -> None:
        """The bytes of an asynchronous upload (``PUT /upload/{server}/{mediaId}``)."""
        if server != self.server_name:
            raise forbidden("Media of another server cannot be uploaded here")
        if not is_valid_media_id(media_id):
            raise not_found("Unknown media ID")
        if len(data) > self.config.max_upload_size:
            self._metrics.uploads.labels(outcome="refused").inc()
            raise too_large(f"Upload is {len(data)} bytes; the limit is {self.config.max_upload_size}")
        digest = hashlib.sha256(data).hexdigest()
        await self._count_upload(digest, len(data))
        outcome = await self._keep(digest, data, lambda: self._store.fill_pending(
            media_id, user_id, self._now_ms(), content_type, upload_name, len(data), digest))
        if outcome != "ok":
            await self._drop_files([digest])
            if outcome == "not_found" or outcome == "expired":
                raise not_found("Unknown media ID, or its upload window has passed")
            if outcome == "forbidden":
                raise forbidden("This media ID was created by another user")
            raise MatrixError(409, "M_CANNOT_OVERWRITE_MEDIA", "This media ID already has content")
        for waiter in self._pending_waiters.pop(media_id, []):
            waiter.callback(None)
        self._after_upload(media_id, content_type, data)

    def _after_upload(self, media_id: str, content_type: str, data: bytes) -> None:
        if base_type(content_type) in THUMBNAIL_SOURCE_TYPES:
            run_in_background("media_pregenerate_thumbnails",
                              self._pregenerate(self.server_name, media_id, data))

    async def _pregenerate(self, origin: str, media_id: str, data: bytes) -> None:
        for spec in self.config.thumbnail_sizes:
            try:
                await self._generate(origin, media_id, data, spec, animated=False, kind="pregenerated")
            except (ThumbnailError, MatrixError) as e:
                logger.info("no thumbnails for %s/%s: %s", origin, media_id, e)
                return

    # --- download ----------------------------------------------------------------------

    async def download(self, server: str, media_id: str, *, allow_remote: bool = True,
                       timeout_ms: int | None = None, unauthenticated: bool = False) -> MediaFile:
        """The media; ``unauthenticated``: asked on a legacy endpoint, which never serves media
        stored while those endpoints were frozen."""
        if not is_valid_media_id(media_id):
            raise not_found("Unknown media ID")
        if server == self.server_name:
            local = await self._local(media_id, timeout_ms, unauthenticated)
            data = await self._read(local[0])
            await self._touch(None, media_id)
            self._metrics.downloads.labels(source="local").inc()
            return MediaFile(local[1], local[2], data)
        remote, fetched = await self._remote_media(server, media_id, allow_remote, unauthenticated)
        data = await self._read(remote.sha256)
        await self._touch(server, media_id)
        self._metrics.downloads.labels(source="remote_fetched" if fetched else "remote_cached").inc()
        return MediaFile(remote.content_type or "application/octet-stream", remote.upload_name, data)

    async def _touch(self, origin: str | None, media_id: str) -> None:
        """Record a view for retention, at most once an hour per media ID (not a write per download)."""
        key = (origin or "", media_id)
        now = self._reactor.seconds()
        if self._recently_touched.get(key, now) is not None:
            return
        self._recently_touched.set(key, True, now)
        await self._store.touch(origin, media_id, int(now * 1000))

    async def _read(self, digest: str) -> bytes:
        data = await self._storage.fetch(digest)
        if data is None:
            logger.error("media file %s is missing from the storage provider", digest)
            raise not_found("Media file is missing")
        return data

    async def _local(self, media_id: str, timeout_ms: int | None,
                     unauthenticated: bool = False) -> tuple[str, str, str | None]:
        """(sha256, content type, upload name) of a local media ID; waits for a pending upload."""
        wait_ms = min(MAX_PENDING_WAIT_MS, DEFAULT_PENDING_WAIT_MS if timeout_ms is None else max(0, timeout_ms))
        deadline = self._reactor.seconds() + wait_ms / 1000
        while True:
            row = await self._store.get_local(media_id)
            if row is None or row.quarantined_by is not None or (unauthenticated and row.authenticated):
                raise not_found("Unknown media ID")
            if row.sha256 is not None:
                return row.sha256, row.content_type or "application/octet-stream", row.upload_name
            if row.unused_expires_ts is not None and row.unused_expires_ts <= self._now_ms():
                raise not_found("Unknown media ID")
            remaining = deadline - self._reactor.seconds()
            if remaining <= 0:
                raise MatrixError(504, "M_NOT_YET_UPLOADED", "The content of this media has not been uploaded yet")
            waiter: Deferred[None] = Deferred()
            self._pending_waiters.setdefault(media_id, []).append(waiter)
            waiter.addTimeout(min(remaining, 5.0), self._reactor, onTimeoutCancel=lambda *_: None)
            await waiter
            waiters = self._pending_waiters.get(media_id)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._pending_waiters[media_id]

    async def _remote_media(self, origin: str, media_id: str, allow_remote: bool,
                            unauthenticated: bool = False) -> tuple[RemoteMedia, bool]:
        """The cached row of remote media, fetched first when missing (``True`` then)."""
        row = await self._store.get_remote(origin, media_id)
        if row is not None:
            if row.quarantined_by is not None or (unauthenticated and row.authenticated):
                raise not_found("Unknown media ID")
            return row, False
        if unauthenticated and self.config.freeze_unauthenticated_media:
            raise not_found("Remote media is fetched for the authenticated endpoints only")
        if not allow_remote:
            raise not_found("Remote media is not cached here and allow_remote is false")
        key = (origin, media_id)
        if key in self._fetching:
            d: Deferred[RemoteMedia] = Deferred()
            self._fetching[key].append(d)
            return await d, True
        self._fetching[key] = []
        try:
            fetched = await self._fetch_remote(origin, media_id)
        except BaseException as e:
            for waiter in self._fetching.pop(key, []):
                waiter.errback(e)
            raise
        for waiter in self._fetching.pop(key, []):
            waiter.callback(fetched)
        return fetched, True

    async def _fetch_remote(self, origin: str, media_id: str) -> RemoteMedia:
        config = self.config
        try:
            fetched = await self._fetch_slots.run(
                lambda: Deferred.fromCoroutine(self._remote.fetch(
                    origin, media_id, max_bytes=config.max_remote_media_size,
                    timeout=config.remote_media_timeout.total_seconds())))
        except RemoteMediaNotFound:
            self._metrics.remote_fetches.labels(outcome="not_found").inc()
            raise not_found("Remote media not found") from None
        except RemoteMediaTooLarge:
            self._metrics.remote_fetches.labels(outcome="too_large").inc()
            raise too_large(f"Remote media is larger than {config.max_remote_media_size} bytes") from None
        except RemoteMediaUnavailable as e:
            self._metrics.remote_fetches.labels(outcome="error").inc()
            logger.warning("[%s] could not fetch media %s: %s", origin, media_id, e)
            raise MatrixError(502, "M_UNKNOWN", "Could not fetch the media from its server") from None
        self._metrics.remote_fetches.labels(outcome=fetched.how).inc()
        digest = hashlib.sha256(fetched.data).hexdigest()
        row = RemoteMedia(origin, media_id, fetched.content_type, fetched.upload_name, len(fetched.data), digest, None,
                          self.config.freeze_unauthenticated_media)
        await self._keep(digest, fetched.data, lambda: self._store.insert_remote(row, self._now_ms()))
        return row

    # --- thumbnails --------------------------------------------------------------------

    async def thumbnail(self, server: str, media_id: str, width: int, height: int, method: str, *,
                        animated: bool = False, allow_remote: bool = True, timeout_ms: int | None = None,
                        unauthenticated: bool = False) -> MediaFile:
        if not is_valid_media_id(media_id):
            raise not_found("Unknown media ID")
        if self.config.dynamic_thumbnails:
            spec = ThumbnailSpec(min(width, 4096), min(height, 4096), method)
        else:
            spec = choose_thumbnail(width, height, method, self.config.thumbnail_sizes)
        if server == self.server_name:
            digest, content_type, _ = await self._local(media_id, timeout_ms, unauthenticated)
            origin, source_label = self.server_name, "local"
        else:
            remote, fetched = await self._remote_media(server, media_id, allow_remote, unauthenticated)
            digest, content_type = remote.sha256, remote.content_type or ""
            origin, source_label = server, "remote_fetched" if fetched else "remote_cached"
        if base_type(content_type) not in THUMBNAIL_SOURCE_TYPES:
            raise MatrixError(400, "M_UNKNOWN", f"Cannot thumbnail media of type {base_type(content_type)[:60]}")
        existing = await self._store.get_thumbnails(origin, media_id)
        match = next((t for t in existing if (t.width, t.height, t.method, t.animated)
                      == (spec.width, spec.height, spec.method, animated)), None)
        if match is not None:
            data = await self._storage.fetch(match.sha256)
            if data is not None:
                self._metrics.downloads.labels(source=source_label).inc()
                return MediaFile(match.content_type, None, data)
        original = await self._read(digest)
        try:
            rendered = await self._generate(origin, media_id, original, spec, animated=animated, kind="on_demand")
        except TooManyPixels:
            raise too_large("The image has too many pixels to thumbnail") from None
        except ThumbnailError as e:
            raise MatrixError(400, "M_UNKNOWN", f"Cannot thumbnail this media: {str(e)[:200]}") from None
        self._metrics.downloads.labels(source=source_label).inc()
        return MediaFile(rendered.content_type, None, rendered.data)

    async def _generate(self, origin: str, media_id: str, data: bytes, spec: ThumbnailSpec, *, animated: bool,
                        kind: str) -> Rendered:
        start = time.perf_counter()
        pixels = self.config.max_image_pixels
        rendered: Rendered = await deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(),
            lambda: render(data, spec, animated=animated, max_pixels=pixels))
        self._metrics.thumbnail_seconds.labels(kind=kind).observe(time.perf_counter() - start)
        digest = hashlib.sha256(rendered.data).hexdigest()
        await self._keep(digest, rendered.data, lambda: self._store.insert_thumbnail(origin, media_id, Thumbnail(
            spec.width, spec.height, spec.method, animated, rendered.content_type, len(rendered.data), digest)))
        if not await self._store.media_exists(None if origin == self.server_name else origin, media_id):
            # The media was deleted while this thumbnail was made: take the thumbnail with it.
            await self._delete(origin, media_id)
        return rendered

    # --- administration and retention ------------------------------------------------------

    async def quarantine(self, admin: str, server: str, media_id: str) -> None:
        """Serve this media ID to nobody any more (404), keeping its bytes for inspection.
        ``admin`` is a server admin (the servlet's guard checked it)."""
        if not is_valid_media_id(media_id):
            raise invalid_param("Not a valid media ID")
        origin = None if server == self.server_name else server
        if not await self._store.quarantine(origin, media_id, admin):
            raise not_found("Unknown media ID")
        logger.info("media %s/%s quarantined by %s", server, media_id, admin)

    async def delete(self, admin: str, server: str, media_id: str) -> None:
        """Delete a media ID, its thumbnails and (unless shared with other media) its files.
        ``admin`` is a server admin (the servlet's guard checked it)."""
        if not is_valid_media_id(media_id):
            raise invalid_param("Not a valid media ID")
        if not await self._delete(server, media_id):
            raise not_found("Unknown media ID")
        logger.info("media %s/%s deleted by %s", server, media_id, admin)

    async def _delete(self, server: str, media_id: str) -> bool:
        origin = None if server == self.server_name else server
        found, unused = await self._store.delete_media(origin, server, media_id)
        await self._drop_files(unused)
        return found

    async def purge_expired(self) -> int:
        """One retention pass: expired pending uploads, local media not viewed within
        ``local_media_lifetime``, cached remote media not viewed within ``remote_media_lifetime``."""
        now = self._now_ms()
        config = self.config
        local_before = (None if config.local_media_lifetime is None
                        else now - int(config.local_media_lifetime.total_seconds() * 1000))
        remote_before = (None if config.remote_media_lifetime is None
                         else now - int(config.remote_media_lifetime.total_seconds() * 1000))
        local, remote = await self._store.expired(now, local_before, remote_before)
        for media_id in local:
            await self._delete(self.server_name, media_id)
        for origin, media_id in remote:
            await self._delete(origin, media_id)
        if local or remote:
            logger.info("media retention: deleted %d local and %d remote media", len(local), len(remote))
        return len(local) + len(remote)


RETENTION_INTERVAL_SECONDS = 3600.0


class MediaRetention:
    """Runs ``purge_expired`` at start and every hour on the process that serves media."""

    def __init__(self, repo: MediaRepository, reactor: Any, interval: float = RETENTION_INTERVAL_SECONDS) -> None:
        self._call = LoopingCall(lambda: run_in_background("media_retention", repo.purge_expired()))
        self._call.clock = reactor
        self._call.start(interval, now=True)

    def stop(self) -> None:
        if self._call.running:
            self._call.stop()


def start_media_retention(repo: MediaRepository, reactor: Any) -> MediaRetention:
    return MediaRetention(repo, reactor)
