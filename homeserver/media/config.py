"""The ``media`` section of homeserver.yaml as typed values (parsed in homeserver/config.py).

docs/media.md describes every key; the defaults here are the documented ones.
"""

# tests: tests/unit/test_config.py, tests/unit/media/test_rules.py

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Final

import attrs

from homeserver.media.rules import DEFAULT_THUMBNAIL_SIZES, ThumbnailSpec

# The ranges a URL preview may never reach unless ``url_preview.ip_range_whitelist`` says so:
# loopback, private, link-local, multicast and the other special-purpose ranges.
DEFAULT_PREVIEW_IP_BLACKLIST: Final = (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24",
    "169.254.0.0/16", "192.88.99.0/24", "198.18.0.0/15", "192.0.2.0/24", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "0.0.0.0/8", "255.255.255.255/32",
    "::1/128", "::/128", "fe80::/10", "fc00::/7", "2001:db8::/32", "ff00::/8", "fec0::/10", "::ffff:0:0/96",
)


@attrs.frozen
class RateLimitSpec:
    per_second: float
    burst_count: int


@attrs.frozen
class UrlPreviewConfig:
    enabled: bool = False
    ip_range_blacklist: tuple[str, ...] = DEFAULT_PREVIEW_IP_BLACKLIST
    ip_range_whitelist: tuple[str, ...] = ()
    max_spider_size: int = 10 * 1024 * 1024
    timeout: timedelta = timedelta(seconds=10)
    cache_duration: timedelta = timedelta(hours=1)


@attrs.frozen
class MediaConfig:
    # Where the local storage provider keeps files; None: ``<data_dir>/media``.
    store_path: Path | None = None
    max_upload_size: int = 50 * 1024 * 1024
    # Images with more pixels than this get no thumbnail (a decompression bomb is refused unread).
    max_image_pixels: int = 32_000_000
    thumbnail_sizes: tuple[ThumbnailSpec, ...] = DEFAULT_THUMBNAIL_SIZES
    # Serve thumbnails at exactly the requested size (generated on demand) instead of the nearest
    # configured size.
    dynamic_thumbnails: bool = False
    # Uploads per user: ``burst_count`` at once, then ``per_second``.
    rc_upload: RateLimitSpec = RateLimitSpec(1.0, 20)
    # Asynchronous uploads (``create``) a user may have waiting for their bytes.
    max_pending_uploads: int = 5
    unused_expiration_time: timedelta = timedelta(hours=24)
    max_remote_media_size: int = 50 * 1024 * 1024
    remote_media_timeout: timedelta = timedelta(seconds=30)
    # Retention: remote media not viewed for this long is dropped from the cache (None: kept);
    # local media not viewed for this long is deleted (None: kept for ever).
    remote_media_lifetime: timedelta | None = timedelta(days=90)
    local_media_lifetime: timedelta | None = None
    url_preview: UrlPreviewConfig = UrlPreviewConfig()
    # Matrix 1.11's freeze: media stored while this is on is never served by the unauthenticated
    # /_matrix/media/v3/download and /thumbnail (clients and older servers), only by the
    # authenticated client and federation endpoints.
    freeze_unauthenticated_media: bool = False
