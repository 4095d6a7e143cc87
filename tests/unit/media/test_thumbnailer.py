"""Thumbnails with Pillow: sizes, methods, animation, and refusal of bombs and non-images."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from homeserver.media.rules import ThumbnailSpec
from homeserver.media.thumbnailer import ThumbnailError, TooManyPixels, probe, render

LIMIT = 32_000_000


def image_bytes(width: int, height: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), (200, 10, 10) if mode == "RGB" else None).save(buffer, format=fmt)
    return buffer.getvalue()


def opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def test_scale_keeps_aspect_and_crop_fills_the_box() -> None:
    data = image_bytes(1000, 500)
    scaled = render(data, ThumbnailSpec(320, 240, "scale"), animated=False, max_pixels=LIMIT)
    assert (scaled.width, scaled.height, scaled.content_type) == (320, 160, "image/png")
    assert opened(scaled.data).size == (320, 160)
    cropped = render(data, ThumbnailSpec(96, 96, "crop"), animated=False, max_pixels=LIMIT)
    assert opened(cropped.data).size == (96, 96)


def test_small_images_are_not_blown_up_and_jpeg_stays_jpeg() -> None:
    small = render(image_bytes(20, 10, "JPEG"), ThumbnailSpec(800, 600, "scale"), animated=False, max_pixels=LIMIT)
    assert (small.width, small.height, small.content_type) == (20, 10, "image/jpeg")


def test_decompression_bomb_is_refused_from_its_header() -> None:
    bomb = image_bytes(10_000, 10_000, mode="1")  # 100 megapixels in a few kilobytes
    assert len(bomb) < 100_000
    with pytest.raises(TooManyPixels):
        probe(bomb, LIMIT)
    with pytest.raises(TooManyPixels):
        render(bomb, ThumbnailSpec(32, 32, "crop"), animated=False, max_pixels=LIMIT)


@pytest.mark.parametrize("data", [b"", b"not an image", b"%PDF-1.4 ...", image_bytes(100, 100)[:60],
                                  b"<svg xmlns='http://www.w3.org/2000/svg'/>"])
def test_non_images_and_truncated_images_are_refused(data: bytes) -> None:
    with pytest.raises(ThumbnailError):
        render(data, ThumbnailSpec(32, 32, "crop"), animated=False, max_pixels=LIMIT)


def test_animated_gif_keeps_its_frames_only_when_asked() -> None:
    frames = [Image.new("RGB", (64, 64), (i * 40, 0, 0)) for i in range(4)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    data = buffer.getvalue()
    animated = render(data, ThumbnailSpec(32, 32, "crop"), animated=True, max_pixels=LIMIT)
    assert animated.animated and animated.content_type == "image/gif"
    assert getattr(opened(animated.data), "n_frames", 1) == 4
    still = render(data, ThumbnailSpec(32, 32, "crop"), animated=False, max_pixels=LIMIT)
    assert not still.animated and still.content_type == "image/png"
