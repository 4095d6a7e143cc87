"""OpenGraph parsing for URL previews, and the URL checks before any fetch."""

from __future__ import annotations

import pytest

from homeserver.media.opengraph import decode_html, parse_opengraph
from homeserver.media.preview import PreviewRefused, check_preview_url


def test_og_properties_win_and_images_become_absolute() -> None:
    html = """<html><head><title>Plain title</title>
    <meta property="og:title" content="  The   OG title ">
    <meta property="og:image" content="/img/cat.png">
    <meta name="description" content="desc">
    </head><body>x</body></html>"""
    og = parse_opengraph(html, "https://example.org/page")
    assert og == {"og:title": "The OG title", "og:image": "https://example.org/img/cat.png", "og:description": "desc"}


def test_title_stands_in_and_hostile_pages_stay_bounded() -> None:
    assert parse_opengraph("<title>Hi &amp; bye</title>", "http://x/") == {"og:title": "Hi & bye"}
    big = "<meta property='og:x{}' content='{}'>"
    og = parse_opengraph("".join(big.format(i, "a" * 5000) for i in range(500)), "http://x/")
    assert len(og) <= 50 and all(len(v) <= 1000 for v in og.values())
    assert parse_opengraph("<meta property='og:image' content='javascript:alert(1)'>", "http://x/") == {}
    assert parse_opengraph("<<<>>><meta", "http://x/") == {}


def test_decode_html_uses_the_charset() -> None:
    assert decode_html("é".encode("latin-1"), "text/html; charset=latin-1") == "é"
    assert decode_html(b"\xff", "text/html; charset=nonsense") == "\ufffd"


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x/", "http://", "https://user:pw@x/", "x" * 3000,
                                 "http://[::1", "gopher://x", "http://☃.example/",
                                 "http://x/a b"])
def test_urls_that_are_not_previewed(url: str) -> None:
    with pytest.raises(PreviewRefused):
        check_preview_url(url)


def test_preview_url_ports() -> None:
    assert check_preview_url("https://example.org/a") == ("https", "example.org", 443)
    assert check_preview_url("http://example.org:8080/") == ("http", "example.org", 8080)
