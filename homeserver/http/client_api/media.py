"""Media servlets: the authenticated ``/_matrix/client/v1/media/...`` API, the older
``/_matrix/media/{v3,r0,v1}/...`` paths, and the admin quarantine and delete endpoints.

Servlets parse the request (query parameters, body, ``Content-Type``, file name) and call
``MediaRepository``; a download answers with the bytes and the headers of
``media_headers`` (type, a safe ``Content-Disposition``, CORP and a strict CSP). Every
servlet name starts with ``media_``: the ``media_repository`` worker serves exactly those
(homeserver/roles.py). docs/media.md lists the endpoints.
"""

# tests: tests/integration/test_media.py, tests/integration/test_media_nio.py

from __future__ import annotations


from twisted.web.server import Request

from homeserver.http.client_api._base import query_bool, query_string
from homeserver.http.routes import Call, Caller, Gate, Response, declare, route
from homeserver.http.server import Routes
from homeserver.media.preview import UrlPreviewer
from homeserver.media.repository import MediaFile, MediaRepository
from homeserver.media.rules import (
    SECURITY_HEADERS,
    content_disposition,
    normalise_content_type,
    parse_thumbnail_query,
    safe_upload_name,
)
from storage.kernel.errors import MatrixError, invalid_param, missing_param

MEDIA_PREFIX = r"/_matrix/media/(?:v3|r0|v1)"
CLIENT_MEDIA = r"/_matrix/client/v1/media"
ADMIN_MEDIA = r"/_synapse/admin/v1/media"
_SEG = r"[^/]+"


def media_headers(request: Request, media: MediaFile, file_name: str | None = None) -> None:
    request.setHeader(b"Content-Type", media.content_type.encode("ascii", "replace"))
    request.setHeader(b"Content-Disposition", content_disposition(media.content_type, file_name or media.upload_name))
    for name, value in SECURITY_HEADERS:
        request.setHeader(name, value)


def _upload_body(request: Request, repo: MediaRepository) -> bytes:
    data = b""
    if not getattr(request, "body_too_large", False):
        assert request.content is not None
        data = request.content.read()
    if getattr(request, "body_too_large", False) or len(data) > repo.config.max_upload_size:
        repo.metrics.uploads.labels(outcome="refused").inc()
        raise MatrixError(413, "M_TOO_LARGE", f"Uploads are limited to {repo.config.max_upload_size} bytes")
    return data


def _upload_type(request: Request) -> str:
    values = request.requestHeaders.getRawHeaders(b"Content-Type") or []
    return normalise_content_type(values[0].decode("latin-1") if values else None)


def thumbnail_query(request: Request) -> tuple[int, int, str, bool]:
    """A thumbnail request's ``width``, ``height``, ``method`` and ``animated`` (client and
    federation endpoints alike); a bad one is ``400 M_INVALID_PARAM``."""
    try:
        return parse_thumbnail_query(query_string(request, "width"), query_string(request, "height"),
                                     query_string(request, "method"), query_string(request, "animated"))
    except ValueError as e:
        raise invalid_param(str(e)) from None


def timeout_ms(request: Request) -> int | None:
    """The ``timeout_ms`` query parameter of a download (client and federation endpoints)."""
    text = query_string(request, "timeout_ms")
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        raise invalid_param("timeout_ms must be a non-negative integer")
    return int(text)


MEDIA = rf"/(?P<server>{_SEG})/(?P<media_id>{_SEG})"
NAMED = rf"{MEDIA}(?:/(?P<file_name>[^/]*))?"  # nio sends a trailing "/" when it has no name


class MediaServlets:
    """Uploads, downloads and thumbnails: the authenticated ``/_matrix/client/v1/media`` paths
    (guests may read) and the older unauthenticated ``/_matrix/media`` reads."""

    def __init__(self, repo: MediaRepository) -> None:
        self._repo = repo

    @route("GET", f"{CLIENT_MEDIA}/config", "media_config", caller=Caller.GUEST)
    @route("GET", f"{MEDIA_PREFIX}/config", "media_config_legacy", caller=Caller.GUEST)
    async def config(self, call: Call) -> Response:
        return 200, {"m.upload.size": self._repo.config.max_upload_size}

    # Uploads read the raw bytes themselves (Body.NONE): they are not JSON.
    @route("POST", f"{MEDIA_PREFIX}/upload", "media_upload", caller=Caller.USER)
    async def upload(self, call: Call) -> Response:
        request = call.request
        data = _upload_body(request, self._repo)
        uri = await self._repo.upload(call.user.user_id, data, _upload_type(request),
                                      safe_upload_name(query_string(request, "filename")))
        return 200, {"content_uri": uri}

    @route("POST", f"{MEDIA_PREFIX}/create", "media_create", caller=Caller.USER)
    async def create(self, call: Call) -> Response:
        uri, expires = await self._repo.create(call.user.user_id)
        return 200, {"content_uri": uri, "unused_expires_at": expires}

    @route("PUT", f"{MEDIA_PREFIX}/upload{MEDIA}", "media_upload_pending", caller=Caller.USER)
    async def upload_pending(self, call: Call) -> Response:
        request, p = call.request, call.params
        data = _upload_body(request, self._repo)
        await self._repo.upload_pending(call.user.user_id, p["server"], p["media_id"], data, _upload_type(request),
                                        safe_upload_name(query_string(request, "filename")))
        return 200, {}

    # The legacy reads declare no caller: ``unauthenticated`` (freeze_unauthenticated_media) is
    # whether the route authenticated anyone.
    @route("GET", f"{CLIENT_MEDIA}/download{NAMED}", "media_download", caller=Caller.GUEST)
    @route("GET", f"{MEDIA_PREFIX}/download{NAMED}", "media_download_legacy", caller=Caller.NONE)
    async def download(self, call: Call) -> Response:
        request, p = call.request, call.params
        media = await self._repo.download(p["server"], p["media_id"],
                                          allow_remote=query_bool(request, "allow_remote", True),
                                          timeout_ms=timeout_ms(request), unauthenticated=call.requester is None)
        media_headers(request, media, safe_upload_name(p.get("file_name")))
        return 200, media.data

    @route("GET", f"{CLIENT_MEDIA}/thumbnail{MEDIA}", "media_thumbnail", caller=Caller.GUEST)
    @route("GET", f"{MEDIA_PREFIX}/thumbnail{MEDIA}", "media_thumbnail_legacy", caller=Caller.NONE)
    async def thumbnail(self, call: Call) -> Response:
        request, p = call.request, call.params
        width, height, method, animated = thumbnail_query(request)
        media = await self._repo.thumbnail(p["server"], p["media_id"], width, height, method, animated=animated,
                                           allow_remote=query_bool(request, "allow_remote", True),
                                           timeout_ms=timeout_ms(request), unauthenticated=call.requester is None)
        media_headers(request, media)
        return 200, media.data


class UrlPreviewServlets:
    def __init__(self, previewer: UrlPreviewer) -> None:
        self._previewer = previewer

    @route("GET", f"{CLIENT_MEDIA}/preview_url", "media_preview_url", caller=Caller.USER)
    @route("GET", f"{MEDIA_PREFIX}/preview_url", "media_preview_url_legacy", caller=Caller.USER)
    async def preview_url(self, call: Call) -> Response:
        url = query_string(call.request, "url")
        if url is None:
            raise missing_param("Missing 'url'")
        return 200, await self._previewer.preview(url, call.user.user_id)


class FederationLegacyDownloadServlets:
    """The unauthenticated legacy download on the federation listener: what servers that do not
    know the federation media endpoint fetch our media from (``allow_remote=false`` is implied:
    a server never proxies a third server's media to another)."""

    def __init__(self, repo: MediaRepository) -> None:
        self._repo = repo

    @route("GET", rf"{MEDIA_PREFIX}/download{MEDIA}(?:/(?P<file_name>{_SEG}))?", "media_download_federation_legacy",
           caller=Caller.NONE)
    async def download(self, call: Call) -> Response:
        request, p = call.request, call.params
        media_file = await self._repo.download(p["server"], p["media_id"], allow_remote=False,
                                               timeout_ms=timeout_ms(request), unauthenticated=True)
        media_headers(request, media_file, safe_upload_name(p.get("file_name")))
        return 200, media_file.data


def register_media_servlets(router: Routes, gate: Gate, *, repo: MediaRepository, previewer: UrlPreviewer) -> None:
    """The media endpoints on ``router`` (quarantine and delete are ``MediaAdminServlets``)."""
    declare(router, gate, MediaServlets(repo), UrlPreviewServlets(previewer))


class MediaAdminServlets:
    """Quarantine and delete, declared on the router that serves ``/_synapse/admin/...`` on this
    process's client and admin listeners, through a gate whose admin check is the admin API's
    guard (admins only, ``rc_admin``, the audit log)."""

    def __init__(self, repo: MediaRepository) -> None:
        self._repo = repo

    @route("POST", f"{ADMIN_MEDIA}/quarantine{MEDIA}", "media_admin_quarantine", caller=Caller.ADMIN)
    async def quarantine(self, call: Call) -> Response:
        await self._repo.quarantine(call.user.user_id, call.params["server"], call.params["media_id"])
        return 200, {}

    @route("DELETE", f"{ADMIN_MEDIA}{MEDIA}", "media_admin_delete", caller=Caller.ADMIN)
    async def delete(self, call: Call) -> Response:
        await self._repo.delete(call.user.user_id, call.params["server"], call.params["media_id"])
        return 200, {"deleted_media": [call.params["media_id"]], "total": 1}


def register_legacy_download_for_federation(router: Routes, gate: Gate, *, repo: MediaRepository) -> None:
    """``FederationLegacyDownloadServlets`` on the federation listener's ``router``."""
    declare(router, gate, FederationLegacyDownloadServlets(repo))
