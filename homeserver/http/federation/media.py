"""Federation media: ``GET /_matrix/federation/v1/media/download/{mediaId}`` and
``/thumbnail/{mediaId}``, signed requests from other servers for our own media.

The answer is ``multipart/mixed``: a JSON metadata part (``{}``: the spec defines no fields
yet), then the file with its ``Content-Type`` and ``Content-Disposition``. Only local media is
served (a server never proxies a third server's media); quarantined media is 404.
"""

# tests: tests/integration/test_media_federation.py

from __future__ import annotations

from twisted.web.server import Request

from homeserver.http.client_api.media import thumbnail_query, timeout_ms
from homeserver.http.federation.servlets import FED_V1
from homeserver.http.routes import Call, Caller, Gate, Response, declare, route
from homeserver.http.server import Routes
from homeserver.media.repository import MediaFile, MediaRepository
from homeserver.media.rules import build_multipart, content_disposition, new_boundary


def _multipart(request: Request, media: MediaFile) -> bytes:
    boundary = new_boundary()
    request.setHeader(b"Content-Type", f"multipart/mixed; boundary={boundary}".encode("ascii"))
    headers = ((b"Content-Type", media.content_type.encode("ascii", "replace")),
               (b"Content-Disposition", content_disposition(media.content_type, media.upload_name)))
    return build_multipart(boundary, b"{}", headers, media.data)


class FederationMediaServlets:
    def __init__(self, repo: MediaRepository) -> None:
        self._repo = repo

    @route("GET", rf"{FED_V1}/media/download/(?P<media_id>[^/]+)", "media_federation_download", caller=Caller.SERVER)
    async def download(self, call: Call) -> Response:
        repo, request = self._repo, call.request
        media = await repo.download(repo.server_name, call.params["media_id"], allow_remote=False,
                                    timeout_ms=timeout_ms(request))
        return 200, _multipart(request, media)

    @route("GET", rf"{FED_V1}/media/thumbnail/(?P<media_id>[^/]+)", "media_federation_thumbnail",
           caller=Caller.SERVER)
    async def thumbnail(self, call: Call) -> Response:
        repo, request = self._repo, call.request
        width, height, method, animated = thumbnail_query(request)
        media = await repo.thumbnail(repo.server_name, call.params["media_id"], width, height, method,
                                     animated=animated, allow_remote=False, timeout_ms=timeout_ms(request))
        return 200, _multipart(request, media)


def register_federation_media_servlets(router: Routes, gate: Gate, repo: MediaRepository) -> None:
    declare(router, gate, FederationMediaServlets(repo))
