"""The media repository's pure rules: media IDs, file names and Content-Disposition, thumbnail
sizing, multipart bodies; and the metrics' pre-initialised series."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from homeserver.media.metrics import MediaMetrics
from homeserver.media.remote import media_from_multipart
from homeserver.media.rules import (
    DEFAULT_THUMBNAIL_SIZES,
    MultipartError,
    ThumbnailSpec,
    build_multipart,
    choose_thumbnail,
    content_disposition,
    crop_plan,
    filename_from_disposition,
    is_valid_media_id,
    new_media_id,
    normalise_content_type,
    parse_multipart,
    parse_thumbnail_query,
    safe_upload_name,
    scaled_size,
)


@pytest.mark.parametrize("media_id", ["..", "../etc/passwd", "a/b", "a\\b", "", "a" * 256, "a\x00b", "%2e%2e",
                                      "a.b", "ü", "a b"])
def test_media_ids_that_could_name_a_path_are_refused(media_id: str) -> None:
    assert not is_valid_media_id(media_id)


def test_new_media_ids_are_valid_and_distinct() -> None:
    ids = {new_media_id() for _ in range(200)}
    assert len(ids) == 200 and all(is_valid_media_id(i) for i in ids)


@given(st.text(max_size=300))
def test_any_text_is_either_a_valid_media_id_or_refused_never_a_path(text: str) -> None:
    if is_valid_media_id(text):
        assert "/" not in text and "." not in text and "\\" not in text and text


def test_content_type_is_normalised() -> None:
    assert normalise_content_type("Image/PNG") == "image/png"
    assert normalise_content_type("text/plain; charset=UTF-8; x=y") == "text/plain; charset=UTF-8"
    assert normalise_content_type("text/html\r\nX-Evil: 1") == "application/octet-stream"
    assert normalise_content_type(None) == "application/octet-stream"
    assert normalise_content_type("nonsense") == "application/octet-stream"


def test_upload_names_lose_paths_and_control_characters() -> None:
    assert safe_upload_name("../../etc/passwd") == "passwd"
    assert safe_upload_name("C:\\Users\\x\\cat.png") == "cat.png"
    assert safe_upload_name('a"b\r\nc.txt') == "abc.txt"
    assert safe_upload_name("..") is None
    assert safe_upload_name("") is None
    assert len(safe_upload_name("é" * 300).encode()) <= 255  # type: ignore[union-attr]


def test_disposition_is_inline_only_for_safe_types() -> None:
    assert content_disposition("image/png", "cat.png") == b'inline; filename="cat.png"'
    assert content_disposition("text/html", "x.html") == b'attachment; filename="x.html"'
    assert content_disposition("image/svg+xml", None) == b"attachment"
    assert content_disposition("text/plain; charset=utf-8", None) == b"inline"


@given(st.text(max_size=300))
def test_disposition_is_always_one_ascii_header_line_that_round_trips(name: str) -> None:
    header = content_disposition("application/pdf", name)
    assert b"\r" not in header and b"\n" not in header and header.isascii()
    text = header.decode()
    safe = safe_upload_name(name)
    if safe is not None:
        assert filename_from_disposition(text) == safe


def test_utf8_file_names_use_rfc6266() -> None:
    header = content_disposition("image/png", "Käse.png").decode()
    assert header.startswith("inline; filename*=utf-8''")
    assert unquote(header.split("''", 1)[1]) == "Käse.png"


def test_choose_thumbnail_picks_the_smallest_big_enough_size_of_the_method() -> None:
    sizes = DEFAULT_THUMBNAIL_SIZES
    assert choose_thumbnail(32, 32, "crop", sizes) == ThumbnailSpec(32, 32, "crop")
    assert choose_thumbnail(50, 50, "crop", sizes) == ThumbnailSpec(96, 96, "crop")
    assert choose_thumbnail(500, 500, "crop", sizes) == ThumbnailSpec(96, 96, "crop")  # the largest crop
    assert choose_thumbnail(300, 200, "scale", sizes) == ThumbnailSpec(320, 240, "scale")
    assert choose_thumbnail(5000, 5000, "scale", sizes) == ThumbnailSpec(800, 600, "scale")
    assert choose_thumbnail(10, 10, "crop", [ThumbnailSpec(100, 100, "scale")]) == ThumbnailSpec(100, 100, "scale")


@given(st.integers(1, 20000), st.integers(1, 20000), st.integers(1, 2000), st.integers(1, 2000))
def test_scaled_size_keeps_inside_the_box_and_never_upscales(w: int, h: int, mw: int, mh: int) -> None:
    out_w, out_h = scaled_size(w, h, mw, mh)
    assert 1 <= out_w <= max(1, min(w, mw)) + 1 and 1 <= out_h <= max(1, min(h, mh)) + 1
    assert out_w <= w and out_h <= h


@given(st.integers(1, 20000), st.integers(1, 20000), st.integers(1, 2000), st.integers(1, 2000))
def test_crop_box_is_inside_the_source_and_output_inside_the_target(w: int, h: int, tw: int, th: int) -> None:
    (left, top, right, bottom), (ow, oh) = crop_plan(w, h, tw, th)
    assert 0 <= left < right <= w and 0 <= top < bottom <= h
    assert 1 <= ow <= tw and 1 <= oh <= th


def test_thumbnail_query_is_checked() -> None:
    assert parse_thumbnail_query("32", "32", "crop", None) == (32, 32, "crop", False)
    assert parse_thumbnail_query("10", "20", None, "true") == (10, 20, "scale", True)
    for bad in [("0", "1", None, None), ("-1", "1", None, None), ("1.5", "1", None, None), ("1", "1", "zoom", None),
                (None, "1", None, None), ("1", "1", None, "yes"), ("9" * 20, "1", None, None)]:
        with pytest.raises(ValueError):
            parse_thumbnail_query(*bad)


def test_multipart_round_trip() -> None:
    body = build_multipart("b0undary", b"{}", [(b"Content-Type", b"image/png"),
                                              (b"Content-Disposition", b'inline; filename="a.png"')],
                           b"\x89PNG\r\n--other boundary\r\n")
    parts = parse_multipart("multipart/mixed; boundary=b0undary", body)
    assert [p.body for p in parts] == [b"{}", b"\x89PNG\r\n--other boundary\r\n"]
    assert media_from_multipart("multipart/mixed; boundary=b0undary", body) == (
        "image/png", "a.png", b"\x89PNG\r\n--other boundary\r\n")


def test_multipart_redirect_part_and_bad_bodies() -> None:
    body = build_multipart("xyz", b"{}", [(b"Location", b"https://example.org/x")], b"")
    assert media_from_multipart("multipart/mixed; boundary=xyz", body) is None
    for content_type, raw in [("text/plain", body), ("multipart/mixed", body),
                              ("multipart/mixed; boundary=xyz", b"--xyz\r\nno end"),
                              ("multipart/mixed; boundary=xyz", b"nothing")]:
        with pytest.raises(MultipartError):
            media_from_multipart(content_type, raw)


@given(st.binary(max_size=500))
def test_multipart_parser_only_raises_multipart_error(raw: bytes) -> None:
    try:
        parse_multipart("multipart/mixed; boundary=q", raw)
    except MultipartError:
        pass


def test_metrics_series_start_at_zero() -> None:
    registry = CollectorRegistry()
    MediaMetrics.create(registry)
    assert registry.get_sample_value("tributary_media_uploads_total", {"outcome": "stored"}) == 0
    assert registry.get_sample_value("tributary_media_downloads_total", {"source": "remote_cached"}) == 0
    assert registry.get_sample_value("tributary_media_remote_fetches_total", {"outcome": "fallback_ok"}) == 0
