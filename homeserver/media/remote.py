"""Fetching another server's media for our clients.

First the authenticated federation endpoint (``GET /_matrix/federation/v1/media/download/
{mediaId}``, signed, answered as ``multipart/mixed``: JSON metadata, then the file), then,
when the remote server does not know that endpoint, the older unauthenticated
``/_matrix/media/v3/download/{server}/{mediaId}``. Both go through the one federation client
(server discovery, the IP deny list, timeouts), with a size limit on the body. A part that
answers with a ``Location`` redirect instead of bytes is not followed (the fallback is tried).
"""

# tests: tests/unit/media/test_remote.py, tests/integration/test_media_federation.py

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import quote

import attrs
from twisted.internet.defer import CancelledError

from homeserver.remote.client import FederationClient, HttpResponseError, ResponseTooLarge
from homeserver.media.rules import (
    MultipartError,
    filename_from_disposition,
    normalise_content_type,
    parse_multipart,
)

logger = logging.getLogger(__name__)


@attrs.frozen
class FetchedMedia:
    content_type: str
    upload_name: str | None
    data: bytes
    # "ok" (federation endpoint) or "fallback_ok" (the legacy one).
    how: str


class RemoteMediaNotFound(Exception):
    pass


class RemoteMediaTooLarge(Exception):
    pass


class RemoteMediaUnavailable(Exception):
    pass


def _errcode(body: bytes) -> str | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value.get("errcode") if isinstance(value, dict) and isinstance(value.get("errcode"), str) else None


def media_from_multipart(content_type: str, body: bytes) -> tuple[str, str | None, bytes] | None:
    """(content type, file name, bytes) of a federation media answer; None when its file part is
    a redirect (``Location``) rather than the bytes. MultipartError when it is malformed."""
    parts = parse_multipart(content_type, body)
    if len(parts) < 2:
        raise MultipartError(f"expected two parts (metadata, file), got {len(parts)}")
    try:
        metadata = json.loads(parts[0].body or b"{}")
    except ValueError:
        raise MultipartError("the metadata part is not JSON") from None
    if not isinstance(metadata, dict):
        raise MultipartError("the metadata part is not a JSON object")
    file_part = parts[1]
    if "location" in file_part.headers:
        return None
    return (normalise_content_type(file_part.headers.get("content-type")),
            filename_from_disposition(file_part.headers.get("content-disposition")), file_part.body)


class RemoteMediaFetcher:
    def __init__(self, client: FederationClient) -> None:
        self._client = client

    async def fetch(self, origin: str, media_id: str, *, max_bytes: int, timeout: float) -> FetchedMedia:
        """The media, or RemoteMediaNotFound / RemoteMediaTooLarge / RemoteMediaUnavailable."""
        quoted = quote(media_id, safe="")
        try:
            answer = await self._client.get_bytes(origin, f"/_matrix/federation/v1/media/download/{quoted}",
                                                  query={"timeout_ms": str(int(timeout * 1000))}, signed=True,
                                                  timeout=timeout, max_bytes=max_bytes + 64 * 1024)
            parsed = media_from_multipart(answer.content_type, answer.body)
            if parsed is not None:
                if len(parsed[2]) > max_bytes:
                    raise RemoteMediaTooLarge(f"{origin} sent {len(parsed[2])} bytes")
                return FetchedMedia(parsed[0], parsed[1], parsed[2], "ok")
            logger.info("[%s] media %s: the federation answer is a redirect; trying the legacy endpoint",
                        origin, media_id)
        except (RemoteMediaTooLarge, CancelledError):
            raise
        except ResponseTooLarge as e:
            raise RemoteMediaTooLarge(str(e)) from None
        except HttpResponseError as e:
            if e.code == 404 and _errcode(e.body) == "M_NOT_FOUND":
                raise RemoteMediaNotFound(f"{origin} has no media {media_id}") from None
            logger.info("[%s] federation media endpoint answered %d; trying the legacy endpoint", origin, e.code)
        except MultipartError as e:
            logger.warning("[%s] media %s: malformed multipart answer (%s); trying the legacy endpoint",
                           origin, media_id, e)
        except Exception as e:
            raise RemoteMediaUnavailable(f"{origin}: {e}") from None
        return await self._fetch_legacy(origin, media_id, max_bytes=max_bytes, timeout=timeout)

    async def _fetch_legacy(self, origin: str, media_id: str, *, max_bytes: int, timeout: float) -> FetchedMedia:
        path = f"/_matrix/media/v3/download/{quote(origin, safe='')}/{quote(media_id, safe='')}"
        try:
            answer: Any = await self._client.get_bytes(origin, path, query={"allow_remote": "false"}, signed=False,
                                                       timeout=timeout, max_bytes=max_bytes)
        except CancelledError:
            raise
        except ResponseTooLarge as e:
            raise RemoteMediaTooLarge(str(e)) from None
        except HttpResponseError as e:
            if e.code == 404:
                raise RemoteMediaNotFound(f"{origin} has no media {media_id}") from None
            raise RemoteMediaUnavailable(f"{origin} answered {e.code}") from None
        except Exception as e:
            raise RemoteMediaUnavailable(f"{origin}: {e}") from None
        return FetchedMedia(normalise_content_type(answer.content_type),
                            filename_from_disposition(answer.content_disposition), answer.body, "fallback_ok")
