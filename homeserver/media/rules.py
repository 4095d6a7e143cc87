"""The pure rules of the media repository: media IDs, file names, response headers, thumbnail
sizes and the multipart/mixed body of federation media.

Everything here decides from its arguments alone (no disk, no database, no Pillow), so the
rules that keep hostile input out (a media ID that walks the file system, a file name that
breaks a header, a thumbnail size that asks for gigapixels) are unit-tested on their own.
"""

# tests: tests/unit/media/test_rules.py

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Final
from urllib.parse import quote

import attrs

# Media IDs: the spec's "opaque identifier" made concrete. Letters, digits, '_' and '-' only, so
# an ID can never name a path ('..', '/', '\\', NUL) nor need escaping in a URL or a header.
MEDIA_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,255}")
_ID_ALPHABET: Final = string.ascii_letters
NEW_MEDIA_ID_LENGTH: Final = 24
MAX_UPLOAD_NAME_BYTES: Final = 255


def is_valid_media_id(media_id: str) -> bool:
    return MEDIA_ID_RE.fullmatch(media_id) is not None


def new_media_id() -> str:
    """A fresh random media ID (24 letters: 136 bits)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(NEW_MEDIA_ID_LENGTH))


def is_valid_sha256_hex(value: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{64}", value) is not None


# --- names and types -----------------------------------------------------------------------

_CONTENT_TYPE_RE: Final = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,64}/[A-Za-z0-9!#$&^_.+-]{1,64}")
DEFAULT_CONTENT_TYPE: Final = "application/octet-stream"


def normalise_content_type(value: str | None) -> str:
    """The upload's ``Content-Type`` as ``type/subtype`` (lower case, parameters kept only for
    ``charset``); ``application/octet-stream`` when absent or not a media type."""
    if not value:
        return DEFAULT_CONTENT_TYPE
    main, _, params = value.partition(";")
    main = main.strip().lower()
    if _CONTENT_TYPE_RE.fullmatch(main) is None:
        return DEFAULT_CONTENT_TYPE
    for param in params.split(";"):
        name, _, val = param.strip().partition("=")
        val = val.strip().strip('"')
        if name.strip().lower() == "charset" and re.fullmatch(r"[A-Za-z0-9_.:-]{1,40}", val):
            return f"{main}; charset={val}"
    return main


def base_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def safe_upload_name(name: str | None) -> str | None:
    """A file name a client gave, made safe to store and to put in a header: path parts and
    control characters removed, at most 255 UTF-8 bytes; None when nothing is left."""
    if name is None:
        return None
    # Only the last path component: a name is never a path.
    name = re.split(r"[/\\]", name)[-1]
    name = "".join(ch for ch in name if ch.isprintable() and ch not in "\r\n\t\x00\"")
    name = name.strip().strip(".") if name.strip() in {".", ".."} else name.strip()
    while len(name.encode("utf-8")) > MAX_UPLOAD_NAME_BYTES:
        name = name[:-1]
    return name or None


# The types a browser may show inline (the spec's list for Content-Disposition); anything else,
# HTML and SVG above all, is an attachment so that it never runs in our origin.
INLINE_TYPES: Final = frozenset({
    "text/css", "text/plain", "text/csv", "application/json", "application/ld+json",
    "image/jpeg", "image/gif", "image/png", "image/apng", "image/webp", "image/avif",
    "video/mp4", "video/webm", "video/ogg", "video/quicktime",
    "audio/mp4", "audio/webm", "audio/aac", "audio/mpeg", "audio/ogg", "audio/wave", "audio/wav",
    "audio/x-wav", "audio/x-pn-wav", "audio/flac", "audio/x-flac",
})

_TOKEN_NAME_RE: Final = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~ -]{1,255}")


def content_disposition(content_type: str, upload_name: str | None) -> bytes:
    """``Content-Disposition``: ``inline`` only for INLINE_TYPES, else ``attachment``; the file
    name as a quoted ASCII string when it is plain, else RFC 6266 ``filename*=utf-8''...``."""
    kind = "inline" if base_type(content_type) in INLINE_TYPES else "attachment"
    name = safe_upload_name(upload_name)
    if name is None:
        return kind.encode("ascii")
    if _TOKEN_NAME_RE.fullmatch(name):
        return f'{kind}; filename="{name}"'.encode("ascii")
    return f"{kind}; filename*=utf-8''{quote(name, safe='')}".encode("ascii")


# Headers on every media response (the spec's recommendations for downloads): nothing served
# from the media repository may run script, load resources or be framed by another origin.
CONTENT_SECURITY_POLICY: Final = (
    b"sandbox; default-src 'none'; script-src 'none'; plugin-types application/pdf; "
    b"style-src 'unsafe-inline'; media-src 'self'; object-src 'self';"
)
SECURITY_HEADERS: Final = (
    (b"Content-Security-Policy", CONTENT_SECURITY_POLICY),
    (b"Cross-Origin-Resource-Policy", b"cross-origin"),
    (b"X-Content-Type-Options", b"nosniff"),
)


# --- thumbnails ----------------------------------------------------------------------------


@attrs.frozen(order=True)
class ThumbnailSpec:
    """One thumbnail size: at most ``width`` x ``height``, by ``method`` (``crop`` or ``scale``)."""

    width: int
    height: int
    method: str

    def __attrs_post_init__(self) -> None:
        if self.method not in ("crop", "scale"):
            raise ValueError(f"thumbnail method must be crop or scale, got {self.method!r}")
        if not (1 <= self.width <= 10_000 and 1 <= self.height <= 10_000):
            raise ValueError(f"thumbnail size must be 1-10000 pixels, got {self.width}x{self.height}")


# The spec's recommended sizes (client-server API, "Thumbnails").
DEFAULT_THUMBNAIL_SIZES: Final = (
    ThumbnailSpec(32, 32, "crop"),
    ThumbnailSpec(96, 96, "crop"),
    ThumbnailSpec(320, 240, "scale"),
    ThumbnailSpec(640, 480, "scale"),
    ThumbnailSpec(800, 600, "scale"),
)

# Types Pillow decodes for us; anything else gets no thumbnail (400 M_UNKNOWN... see repository).
THUMBNAIL_SOURCE_TYPES: Final = frozenset({"image/jpeg", "image/jpg", "image/png", "image/gif", "image/webp",
                                           "image/apng", "image/bmp"})
ANIMATED_TYPES: Final = frozenset({"image/gif", "image/webp", "image/apng", "image/png"})


def choose_thumbnail(width: int, height: int, method: str, sizes: Sequence[ThumbnailSpec]) -> ThumbnailSpec:
    """The configured size to serve for a request of ``width`` x ``height`` by ``method``: the
    smallest of that method at least as large in both dimensions, else the largest of it; if
    no size has that method, the same among all sizes. The spec lets the server pick a
    larger thumbnail than asked for, never one that is much smaller."""
    if not sizes:
        raise ValueError("no thumbnail sizes configured")
    same = [s for s in sizes if s.method == method] or list(sizes)
    big_enough = sorted((s for s in same if s.width >= width and s.height >= height),
                        key=lambda s: (s.width * s.height, s.width))
    if big_enough:
        return big_enough[0]
    return max(same, key=lambda s: (s.width * s.height, s.width))


def scaled_size(src_width: int, src_height: int, max_width: int, max_height: int) -> tuple[int, int]:
    """``scale``: the largest size with the source's aspect ratio inside ``max_width`` x
    ``max_height``, never larger than the source, never below 1 pixel."""
    if src_width < 1 or src_height < 1:
        raise ValueError(f"source has no pixels: {src_width}x{src_height}")
    factor = min(max_width / src_width, max_height / src_height, 1.0)
    return max(1, round(src_width * factor)), max(1, round(src_height * factor))


def crop_plan(src_width: int, src_height: int, width: int, height: int) -> tuple[tuple[int, int, int, int],
                                                                                   tuple[int, int]]:
    """``crop``: the centred box of the source with the aspect ratio of ``width`` x ``height``
    (left, top, right, bottom), and the size to scale that box to (at most the box, so small
    images are not blown up)."""
    if src_width < 1 or src_height < 1:
        raise ValueError(f"source has no pixels: {src_width}x{src_height}")
    target_ratio = width / height
    if src_width / src_height > target_ratio:  # too wide: cut the sides
        box_w, box_h = max(1, round(src_height * target_ratio)), src_height
    else:  # too tall: cut top and bottom
        box_w, box_h = src_width, max(1, round(src_width / target_ratio))
    left, top = (src_width - box_w) // 2, (src_height - box_h) // 2
    out = (min(width, box_w), min(height, box_h))
    return (left, top, left + box_w, top + box_h), out


def parse_thumbnail_query(width: str | None, height: str | None, method: str | None,
                          animated: str | None) -> tuple[int, int, str, bool]:
    """The thumbnail request's query parameters, or ValueError naming the bad one."""
    if width is None or height is None:
        raise ValueError("width and height are required")
    values = []
    for name, text in (("width", width), ("height", height)):
        if not text.isascii() or not text.isdigit() or len(text) > 6 or not 1 <= int(text) <= 100_000:
            raise ValueError(f"{name} must be a positive integer, got {text[:20]!r}")
        values.append(int(text))
    method = method or "scale"
    if method not in ("crop", "scale"):
        raise ValueError(f"method must be crop or scale, got {method[:20]!r}")
    if animated not in (None, "true", "false"):
        raise ValueError(f"animated must be true or false, got {animated[:20]!r}")
    return values[0], values[1], method, animated == "true"


# --- multipart/mixed (federation media) -----------------------------------------------------


def new_boundary() -> str:
    return secrets.token_hex(16)


def build_multipart(boundary: str, metadata: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The federation media response: a JSON metadata part, then the file part with ``headers``."""
    b = boundary.encode("ascii")
    parts = [b"--" + b + b"\r\nContent-Type: application/json\r\n\r\n" + metadata + b"\r\n"]
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    parts.append(b"--" + b + b"\r\n" + head + b"\r\n" + body + b"\r\n")
    return b"".join(parts) + b"--" + b + b"--\r\n"


class MultipartError(ValueError):
    pass


@attrs.frozen
class MediaPart:
    headers: Mapping[str, str]  # lower-case names
    body: bytes


def multipart_boundary(content_type: str) -> str:
    """The boundary of a ``multipart/mixed`` Content-Type, or MultipartError."""
    main, _, params = content_type.partition(";")
    if main.strip().lower() != "multipart/mixed":
        raise MultipartError(f"expected multipart/mixed, got {main.strip()[:60]!r}")
    for param in params.split(";"):
        name, _, value = param.strip().partition("=")
        if name.strip().lower() == "boundary":
            value = value.strip().strip('"')
            if re.fullmatch(r"[0-9A-Za-z'()+_,./:=? -]{1,70}", value) and not value.endswith(" "):
                return value
            raise MultipartError(f"invalid boundary {value[:80]!r}")
    raise MultipartError("multipart/mixed without a boundary")


def parse_multipart(content_type: str, body: bytes) -> list[MediaPart]:
    """The parts of a ``multipart/mixed`` body (RFC 2046), or MultipartError."""
    delimiter = b"--" + multipart_boundary(content_type).encode("ascii")
    start = body.find(delimiter)
    if start < 0:
        raise MultipartError("no boundary in the body")
    parts: list[MediaPart] = []
    pos = start + len(delimiter)
    while True:
        if body[pos:pos + 2] == b"--":
            return parts
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            raise MultipartError("truncated multipart body")
        pos = eol + 2
        end = body.find(b"\r\n" + delimiter, pos)
        if end < 0:
            raise MultipartError("multipart part without a closing boundary")
        raw = body[pos:end]
        head, sep, content = raw.partition(b"\r\n\r\n")
        if not sep:
            if raw.startswith(b"\r\n"):  # no headers at all
                head, content = b"", raw[2:]
            else:
                raise MultipartError("multipart part without a blank line after its headers")
        headers: dict[str, str] = {}
        for line in head.split(b"\r\n"):
            if not line:
                continue
            name, colon, value = line.partition(b":")
            if not colon:
                raise MultipartError(f"bad part header {line[:80]!r}")
            headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
        parts.append(MediaPart(headers, content))
        if len(parts) > 16:
            raise MultipartError("too many parts")
        pos = end + 2 + len(delimiter)


def filename_from_disposition(value: str | None) -> str | None:
    """The file name of a ``Content-Disposition`` header (``filename*=utf-8''...`` preferred)."""
    if not value:
        return None
    from urllib.parse import unquote

    found: str | None = None
    for param in value.split(";")[1:]:
        name, _, val = param.strip().partition("=")
        name = name.strip().lower()
        if name == "filename*" and val.lower().startswith("utf-8''"):
            try:
                return safe_upload_name(unquote(val[7:], errors="strict"))
            except UnicodeDecodeError:
                continue
        if name == "filename" and found is None:
            found = safe_upload_name(val.strip().strip('"'))
    return found
