"""Fetching remote media: the federation endpoint first, the legacy one when the remote server
does not know it, and which answers end the attempt. The client here is a stand-in with the
FederationClient's ``get_bytes`` signature (the real one is exercised between two processes in
tests/integration/test_media_federation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.remote.client import HttpResponseError, RawResponse, ResponseTooLarge
from homeserver.media.remote import (
    RemoteMediaFetcher,
    RemoteMediaNotFound,
    RemoteMediaTooLarge,
)
from homeserver.media.rules import build_multipart


class Remote:
    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, bool]] = []

    async def get_bytes(self, destination: str, path: str, *, query: Any = None, signed: bool = True,
                        timeout: float | None = None, max_bytes: int) -> RawResponse:
        kind = "federation" if path.startswith("/_matrix/federation/") else "legacy"
        self.asked.append((kind, signed))
        answer = self.answers[kind]
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, RawResponse)
        return answer


def fetcher(answers: dict[str, Any]) -> tuple[RemoteMediaFetcher, Remote]:
    remote = Remote(answers)
    return RemoteMediaFetcher(remote), remote  # type: ignore[arg-type]


LEGACY = RawResponse(200, "image/png", 'inline; filename="a.png"', b"legacy bytes")


async def test_federation_endpoint_answer_is_used() -> None:
    body = build_multipart("bb", b"{}", [(b"Content-Type", b"text/plain")], b"fed bytes")
    f, remote = fetcher({"federation": RawResponse(200, "multipart/mixed; boundary=bb", "", body), "legacy": LEGACY})
    got = await f.fetch("remote.example", "abc", max_bytes=100, timeout=5)
    assert (got.content_type, got.data, got.how) == ("text/plain", b"fed bytes", "ok")
    assert remote.asked == [("federation", True)]


@pytest.mark.parametrize("failure", [
    HttpResponseError("r", 404, b'{"errcode":"M_UNRECOGNIZED","error":"x"}'),
    HttpResponseError("r", 400, b"not json"),
    RawResponse(200, "multipart/mixed; boundary=bb", "", build_multipart("bb", b"{}", [(b"Location", b"https://x")],
                                                                          b"")),
    RawResponse(200, "image/png", "", b"not multipart"),
])
async def test_legacy_endpoint_when_the_federation_one_is_unknown_or_unusable(failure: Any) -> None:
    f, remote = fetcher({"federation": failure, "legacy": LEGACY})
    got = await f.fetch("remote.example", "abc", max_bytes=100, timeout=5)
    assert (got.content_type, got.upload_name, got.data, got.how) == ("image/png", "a.png", b"legacy bytes",
                                                                      "fallback_ok")
    assert remote.asked == [("federation", True), ("legacy", False)]


async def test_not_found_and_too_large_end_the_attempt() -> None:
    f, remote = fetcher({"federation": HttpResponseError("r", 404, b'{"errcode":"M_NOT_FOUND","error":"x"}'),
                         "legacy": LEGACY})
    with pytest.raises(RemoteMediaNotFound):
        await f.fetch("remote.example", "abc", max_bytes=100, timeout=5)
    assert remote.asked == [("federation", True)]
    f, remote = fetcher({"federation": ResponseTooLarge("big"), "legacy": LEGACY})
    with pytest.raises(RemoteMediaTooLarge):
        await f.fetch("remote.example", "abc", max_bytes=100, timeout=5)
    f, remote = fetcher({"federation": HttpResponseError("r", 405, b""), "legacy": ResponseTooLarge("big")})
    with pytest.raises(RemoteMediaTooLarge):
        await f.fetch("remote.example", "abc", max_bytes=100, timeout=5)
