"""Federation media: ``GET /_matrix/federation/v1/media/download/{mediaId}`` and
``/thumbnail/{mediaId}``, signed requests from other servers for our own media.

The answer is ``multipart/mixed``: a JSON metadata part (``{}``: the spec defines no fields
yet), then the file with its ``Content-Type`` and ``Content-Disposition``. Only local media is
served (a server never proxies a third server's media); quarantined media is 404.
"""

# tests: tests/integration/test_media_federation.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.http.federation.servlets import FED_V1, FederationServices, register_authed
from homeserver.http.client_api.media import thumbnail_query, timeout_ms
from homeserver.http.server import Routes
from homeserver.media.repository import MediaFile, MediaRepository
from homeserver.media.rules import build_multipart, content_disposition, new_boundary


def _multipart(request: Request, media: MediaFile) -> bytes:
    boundary = new_boundary()
    request.setHeader(b"Content-Type", f"multipart/mixed; boundary={boundary}".encode("ascii"))
    headers = ((b"Content-Type", media.content_type.encode("ascii", "replace")),
               (b"Content-Disposition", content_disposition(media.content_type, media.upload_name)))
    return build_multipart(boundary, b"{}", headers, media.data)


def register_federation_media_servlets(router: Routes, fed: FederationServices, repo: MediaRepository) -> None:
    async def download(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        media = await repo.download(repo.server_name, p["media_id"], allow_remote=False,
                                    timeout_ms=timeout_ms(request))
        return 200, _multipart(request, media)

    async def thumbnail(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        width, height, method, animated = thumbnail_query(request)
        media = await repo.thumbnail(repo.server_name, p["media_id"], width, height, method, animated=animated,
                                     allow_remote=False, timeout_ms=timeout_ms(request))
        return 200, _multipart(request, media)

    register_authed(router, fed, "GET", rf"{FED_V1}/media/download/(?P<media_id>[^/]+)", download,
                    "media_federation_download")
    register_authed(router, fed, "GET", rf"{FED_V1}/media/thumbnail/(?P<media_id>[^/]+)", thumbnail,
                    "media_federation_thumbnail")
