"""OpenGraph from an HTML page, for URL previews: pure, bounded, no network.

``og:*`` meta properties win; without them the ``<title>`` and the ``description`` meta
stand in for ``og:title`` and ``og:description``. Values are trimmed and capped, so a
hostile page cannot make a preview larger than a few kilobytes.
"""

# tests: tests/unit/media/test_opengraph.py

from __future__ import annotations

from html.parser import HTMLParser
from typing import Final
from urllib.parse import urljoin

MAX_VALUE_CHARS: Final = 1000
MAX_PROPERTIES: Final = 50


class _OgParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.og: dict[str, str] = {}
        self.title: str | None = None
        self.description: str | None = None
        self._in_title = False
        self._title_parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k.lower(): (v or "") for k, v in attrs}
        if tag == "meta":
            name = (values.get("property") or values.get("name") or "").strip().lower()
            content = values.get("content")
            if content is None or not name:
                return
            if name.startswith("og:") and name not in self.og and len(self.og) < MAX_PROPERTIES:
                self.og[name] = " ".join(content.split())[:MAX_VALUE_CHARS]
            elif name == "description" and self.description is None:
                self.description = " ".join(content.split())[:MAX_VALUE_CHARS]
        elif tag == "title" and self.title is None:
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "title" and self._in_title:
            self._in_title = False
            self.title = " ".join("".join(self._title_parts).split())[:MAX_VALUE_CHARS]

    def handle_data(self, data: str) -> None:
        if self._in_title and sum(map(len, self._title_parts)) < MAX_VALUE_CHARS:
            self._title_parts.append(data)


def decode_html(body: bytes, content_type: str) -> str:
    """The page as text: the charset of ``Content-Type`` if it names a known one, else UTF-8."""
    charset = "utf-8"
    for param in content_type.split(";")[1:]:
        name, _, value = param.strip().partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"') or charset
    try:
        return body.decode(charset, errors="replace")
    except LookupError:
        return body.decode("utf-8", errors="replace")


def parse_opengraph(html: str, url: str) -> dict[str, str]:
    """The page's OpenGraph properties, ``og:image`` made absolute against ``url``."""
    parser = _OgParser()
    try:
        parser.feed(html)
        parser.close()
    except (AssertionError, ValueError):  # HTMLParser on very broken markup
        pass
    og = dict(parser.og)
    if "og:title" not in og and parser.title:
        og["og:title"] = parser.title
    if "og:description" not in og and parser.description:
        og["og:description"] = parser.description
    if "og:image" in og:
        image = urljoin(url, og["og:image"])
        if image.startswith(("http://", "https://")):
            og["og:image"] = image
        else:
            del og["og:image"]
    return og
