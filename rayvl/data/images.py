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


def centre_geometry(width: int, height: int, size: int) -> tuple[int, int, int, int]:
    """(new width, new height, left, top) of the evaluation's crop, open_clip's (its ``resize_mode`` "shortest", and
    CLIP_benchmark's through it): torchvision's ``Resize(size)`` — the shorter side to ``size``, the longer to
    ``int(size × long / short)`` — then ``CenterCrop(size)``, whose offsets ``round()`` (half to even)."""
    if width <= height:
        new_w, new_h = size, int(size * height / width)
    else:
        new_w, new_h = int(size * width / height), size
    return new_w, new_h, int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))


def centre_crop(img: Image.Image, size: int) -> np.ndarray:
    """An RGB image's evaluation crop as open_clip's transform cuts it (torchvision resizes a PIL image with
    Pillow's own bicubic resize, then crops), as a uint8 (3, size, size) view. The whole image is resized, then
    cropped: Pillow's resize with a crop box takes its two passes in the other order when the box cuts rows, and
    the 8-bit image between them rounds otherwise (up to 5 levels a pixel apart on a 427 × 640 photo of noise)."""
    new_w, new_h, left, top = centre_geometry(*img.size, size)
    return chw(img.resize((new_w, new_h), Image.BICUBIC).crop((left, top, left + size, top + size)))


def decode_and_crop(data: bytes, size: int, scale_min: float | None,
                    rng: np.random.Generator | None = None) -> np.ndarray | None:
    """uint8 array (3, size, size), or None when the bytes are not a decodable image.

    ``scale_min`` None → open_clip's evaluation crop (``centre_crop``); otherwise a random resized crop (training)
    drawn from ``rng``.
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
    """An RGB PIL image → uint8 (3, size, size): open_clip's evaluation crop (``scale_min`` None) or a random
    resized crop drawn from ``rng``."""
    if scale_min is None:
        return centre_crop(img, size).copy()
    return resized(img, crop_box(*img.size, scale_min, rng), size).copy()


def crop_box(width: int, height: int, scale_min: float, rng: np.random.Generator | None):
    """The random resized crop box of an image of that size drawn from ``rng`` — where a crop is cut on the CPU
    (``crop``) and where its JPEG travels to the device (data/encoded_jpegs.py), the same box. (The evaluation's
    crop has no box: ``centre_geometry`` gives it from the image's size.)"""
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
