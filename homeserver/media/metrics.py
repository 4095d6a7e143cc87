"""Media repository metrics: uploads and their bytes, downloads by cache outcome, thumbnail
generation time, remote fetches by outcome, URL previews."""

# tests: tests/unit/media/test_rules.py, tests/integration/test_media.py

from __future__ import annotations

from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram

UPLOAD_OUTCOMES: Final = ("stored", "deduplicated", "refused")
DOWNLOAD_SOURCES: Final = ("local", "remote_cached", "remote_fetched")
FETCH_OUTCOMES: Final = ("ok", "fallback_ok", "not_found", "too_large", "error")
THUMBNAIL_KINDS: Final = ("pregenerated", "on_demand")
PREVIEW_OUTCOMES: Final = ("ok", "cached", "refused", "error")


@attrs.frozen
class MediaMetrics:
    uploads: Counter
    upload_bytes: Counter
    downloads: Counter
    thumbnail_seconds: Histogram
    remote_fetches: Counter
    previews: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> MediaMetrics:
        metrics = cls(
            uploads=Counter(
                "tributary_media_uploads_total",
                "Media uploads, by outcome: stored as a new file, deduplicated onto an identical file, or refused.",
                ["outcome"], registry=registry,
            ),
            upload_bytes=Counter(
                "tributary_media_upload_bytes_total", "Bytes of media accepted in uploads.", registry=registry,
            ),
            downloads=Counter(
                "tributary_media_downloads_total",
                "Media and thumbnails served, by source: local media, remote media from the cache (a cache hit), "
                "or remote media fetched for this request (a cache miss).",
                ["source"], registry=registry,
            ),
            thumbnail_seconds=Histogram(
                "tributary_media_thumbnail_duration_seconds",
                "Time to generate one thumbnail, on upload (pregenerated) or when first asked for (on_demand).",
                ["kind"], registry=registry,
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            ),
            remote_fetches=Counter(
                "tributary_media_remote_fetches_total",
                "Fetches of remote media from its server, by outcome (fallback_ok: the unauthenticated legacy "
                "endpoint answered after the federation media endpoint did not).",
                ["outcome"], registry=registry,
            ),
            previews=Counter(
                "tributary_media_url_previews_total",
                "URL preview requests, by outcome (refused: preview disabled, a denied address or a bad URL).",
                ["outcome"], registry=registry,
            ),
        )
        for outcome in UPLOAD_OUTCOMES:
            metrics.uploads.labels(outcome=outcome)
        for source in DOWNLOAD_SOURCES:
            metrics.downloads.labels(source=source)
        for kind in THUMBNAIL_KINDS:
            metrics.thumbnail_seconds.labels(kind=kind)
        for outcome in FETCH_OUTCOMES:
            metrics.remote_fetches.labels(outcome=outcome)
        for outcome in PREVIEW_OUTCOMES:
            metrics.previews.labels(outcome=outcome)
        return metrics
