"""Encoded image (JPEG, PNG, WebP: whatever Pillow recognises in the bytes, the member's extension aside) → uint8
CHW crop. Normalisation happens on the device (models/dual_encoder.py), so batches stay uint8
on the wire (4× smaller than float32)."""
from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, JpegImagePlugin, UnidentifiedImageError

Image.MAX_IMAGE_PIXELS = 200_000_000  # LAION has a few huge images; beyond this a "decompression bomb" is corrupt


def random_resized_crop_box(width: int, height: int, scale_min: float, rng: np.random.Generator):
    """Inception-style crop: area fraction in [scale_min, 1], aspect ratio in [3/4, 4/3] (log-uniform)."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(scale_min, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            x = int(rng.integers(0, width - w + 1))
            y = int(rng.integers(0, height - h + 1))
            return x, y, x + w, y + h
    side = min(width, height)  # fall back to the central square
    x, y = (width - side) // 2, (height - side) // 2
    return x, y, x + side, y + side


def random_resized_crop_boxes(width: int, height: int, scale_min: float, rng: np.random.Generator,
                              n: int) -> np.ndarray:
    """``n`` boxes (int64 (n, 4): x0, y0, x1, y1), each drawn as ``random_resized_crop_box`` draws one — the first of
    10 tries whose area fraction (in [scale_min, 1]) and aspect ratio (in [3/4, 4/3], log-uniform) fit the image, at
    a uniform position, else the central square — from one generator call for all of them (a call costs more than
    a box's arithmetic): what a pseudo-labeller draws for an image's c crops, on the thread it shares with every
    other image."""
    tries, per_box = 10, 22  # an area and a ratio a try, then the position
    draws = rng.random(n * per_box).tolist()
    area, low, span = width * height, math.log(3 / 4), math.log(4 / 3) - math.log(3 / 4)
    side = min(width, height)
    boxes = []
    for first in range(0, n * per_box, per_box):
        box = (width - side) // 2, (height - side) // 2, side, side  # the central square, unless a try fits
        for t in range(first, first + 2 * tries, 2):
            target = area * (scale_min + (1.0 - scale_min) * draws[t])
            ratio = math.exp(low + span * draws[t + 1])
            w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                box = int(draws[first + 20] * (width - w + 1)), int(draws[first + 21] * (height - h + 1)), w, h
                break
        x, y, w, h = box
        boxes.append((x, y, x + w, y + h))
    return np.array(boxes, np.int64).reshape(n, 4)


def center_crop_box(width: int, height: int):
    side = min(width, height)
    x, y = (width - side) // 2, (height - side) // 2
    return x, y, x + side, y + side


def decode_and_crop(data: bytes, size: int, scale_min: float | None,
                    rng: np.random.Generator | None = None) -> np.ndarray | None:
    """uint8 array (3, size, size), or None when the bytes are not a decodable image.

    ``scale_min`` None → centre crop (evaluation); otherwise a random resized crop (training) drawn from ``rng``.
    """
    img = decode(data)
    return None if img is None else crop(img, size, scale_min, rng)


def decode(data: bytes, draft=None) -> Image.Image | None:
    """The RGB image of encoded bytes, or None when they are not a decodable image (or one under 2 px a side). A
    palette or alpha image (PNG, WebP) is converted to RGB, its transparency dropped. ``draft``: a function of the
    image's full (width, height) giving the smallest size wanted, or None: a JPEG is then decoded at the smallest
    DCT scale at least that large (Pillow's ``Image.draft``); other formats decode whole."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            wanted = draft(img.size) if draft else None
            if wanted and isinstance(img, JpegImagePlugin.JpegImageFile):  # MPO (phones' JPEGs) too
                img.draft("RGB", wanted)
            if img.mode == "P" and "transparency" in img.info:  # through RGBA: Pillow warns on each such image else
                img = img.convert("RGBA")
            img = img.convert("RGB")
            img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        return None
    return img if min(img.size) >= 2 else None


def crop(img: Image.Image, size: int, scale_min: float | None, rng: np.random.Generator | None = None) -> np.ndarray:
    """An RGB PIL image → uint8 (3, size, size): centre crop (``scale_min`` None) or random resized crop drawn from
    ``rng``."""
    return resized(img, crop_box(*img.size, scale_min, rng), size).copy()


def crop_box(width: int, height: int, scale_min: float | None, rng: np.random.Generator | None = None):
    """The crop box of an image of that size: its centre square (``scale_min`` None) or a random resized crop drawn
    from ``rng`` — where a crop is cut on the CPU (``crop``) and where its JPEG travels to the device
    (data/encoded_jpegs.py), the same box."""
    if scale_min is None:
        return center_crop_box(width, height)
    if rng is None:  # an unseeded default here made runs of one train.seed differ (data/seeding.py)
        raise ValueError("a random resized crop needs a generator (data/seeding.row_rng)")
    return random_resized_crop_box(width, height, scale_min, rng)


def resized(img: Image.Image, box, size: int) -> np.ndarray:
    """The ``box`` (x0, y0, x1, y1, pixel corners) of an RGB image resized bicubic to ``size`` × ``size``, as a uint8
    (3, size, size) view."""
    return chw(img.resize((size, size), Image.BICUBIC, box=box))


def chw(img: Image.Image) -> np.ndarray:
    """An RGB image's pixels as a uint8 (3, H, W) view."""
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)
