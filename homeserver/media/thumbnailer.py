"""Thumbnails with Pillow: bytes in, bytes out, no I/O (the repository runs this in a thread).

An image is opened lazily, so its header is read before any pixel is decoded: one whose
width x height is above the pixel limit is refused unread (a decompression bomb: a few
kilobytes of PNG that expand to gigabytes). Only the formats of ``SOURCE_FORMATS`` are
decoded; anything else, and anything truncated or corrupt, is a ``ThumbnailError``.
"""

# tests: tests/unit/media/test_thumbnailer.py

from __future__ import annotations

import io
import warnings
from typing import Final

import attrs
from PIL import Image, ImageSequence

from homeserver.media.rules import ThumbnailSpec, crop_plan, scaled_size

# Pillow format names we decode (not EPS, PSD, TIFF, ...: fewer decoders, less attack surface).
SOURCE_FORMATS: Final = ("JPEG", "PNG", "GIF", "WEBP", "BMP")
MAX_ANIMATION_FRAMES: Final = 200


class ThumbnailError(Exception):
    """The input cannot be thumbnailed: not an image we decode, truncated, or too large."""


class TooManyPixels(ThumbnailError):
    pass


@attrs.frozen
class ImageInfo:
    width: int
    height: int
    format: str
    frames: int


@attrs.frozen
class Rendered:
    data: bytes
    content_type: str
    width: int
    height: int
    animated: bool


def _open(data: bytes, max_pixels: int) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=SOURCE_FORMATS)
    except Image.DecompressionBombError as e:
        raise TooManyPixels(str(e)) from None
    except Image.DecompressionBombWarning as e:
        raise TooManyPixels(str(e)) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ThumbnailError(f"not an image we can read: {e}") from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise TooManyPixels(f"{width}x{height} is more than {max_pixels} pixels")
    return image


def probe(data: bytes, max_pixels: int) -> ImageInfo:
    """Size, format and frame count from the header alone."""
    image = _open(data, max_pixels)
    return ImageInfo(image.size[0], image.size[1], str(image.format), int(getattr(image, "n_frames", 1)))


def _resize(frame: Image.Image, spec: ThumbnailSpec) -> Image.Image:
    width, height = frame.size
    if spec.method == "scale":
        return frame.resize(scaled_size(width, height, spec.width, spec.height), Image.Resampling.LANCZOS)
    box, out = crop_plan(width, height, spec.width, spec.height)
    return frame.resize(out, Image.Resampling.LANCZOS, box=box)


def render(data: bytes, spec: ThumbnailSpec, *, animated: bool, max_pixels: int) -> Rendered:
    """A thumbnail of ``data`` at ``spec``. ``animated`` keeps the frames of an animated GIF,
    WebP or PNG (as the same format; PNG as APNG); otherwise the first frame, as JPEG for a JPEG
    source and PNG for the rest (transparency kept)."""
    image = _open(data, max_pixels)
    try:
        frames = int(getattr(image, "n_frames", 1))
        fmt = str(image.format)
        if animated and frames > 1 and fmt in ("GIF", "WEBP", "PNG"):
            if frames * image.size[0] * image.size[1] > max_pixels * 4 or frames > MAX_ANIMATION_FRAMES:
                raise TooManyPixels(f"{frames} frames of {image.size[0]}x{image.size[1]} is too much to animate")
            out_frames = [_resize(frame.convert("RGBA"), spec) for frame in ImageSequence.Iterator(image)]
            buffer = io.BytesIO()
            durations = image.info.get("duration", 100)
            out_frames[0].save(buffer, format=fmt, save_all=True, append_images=out_frames[1:],
                               loop=image.info.get("loop", 0), duration=durations, disposal=2)
            width, height = out_frames[0].size
            return Rendered(buffer.getvalue(), f"image/{fmt.lower()}", width, height, True)
        image.seek(0)
        if fmt == "JPEG":
            thumb = _resize(image.convert("RGB"), spec)
            buffer = io.BytesIO()
            thumb.save(buffer, format="JPEG", quality=80)
            return Rendered(buffer.getvalue(), "image/jpeg", thumb.size[0], thumb.size[1], False)
        mode = "RGBA" if image.mode in ("RGBA", "LA", "P", "PA") or "transparency" in image.info else "RGB"
        thumb = _resize(image.convert(mode), spec)
        buffer = io.BytesIO()
        thumb.save(buffer, format="PNG", optimize=False)
        return Rendered(buffer.getvalue(), "image/png", thumb.size[0], thumb.size[1], False)
    except ThumbnailError:
        raise
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt pixel data
        raise ThumbnailError(f"cannot decode the image: {e}") from None
    finally:
        image.close()
