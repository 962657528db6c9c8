"""Which images travel encoded to the device that decodes them (``data.decode`` / ``eval.decode`` "device";
rayvl.device_decode decodes them there), for nodes whose CPUs cannot decode as fast as their GPUs eat.

In a Ray Data read task or a local loader's worker (``prepare``): a JPEG the GPU's decoder takes — baseline, RGB or
greyscale, its bytes ending in the end-of-image marker, at most ``DEVICE_MAX_PIXELS`` — stays encoded, with its crop
box drawn from its header's size by the same call and generator as the CPU path's crop (``images.crop``), so a row's
crop is the same box either way (``images.crop_box``). Any other image (PNG, WebP, CMYK, progressive, a JPEG cut
short or larger, a crop over ``DEVICE_MAX_DOWNSCALE`` times the output side) is decoded and cropped here as on the
CPU path and travels as its pixels; bytes that are no image are dropped and counted here, as before.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from rayvl.data.images import crop_box, decode, decode_and_crop, resized

COLUMNS = ["image_bytes", "image_box"]  # what a row carries for its image in place of ``image``
PIXELS = -1  # a box of these: the row's bytes are its crop's pixels, decoded on the CPU
CENTRE = -2  # a box of these: the evaluation's crop (images.centre_geometry of the decoded frame's size)
DECODES = ("cpu", "device")
DEVICE_MAX_PIXELS = 4096 * 4096  # larger JPEGs decode here: a frame of float32 pixels for the resize takes GBs
# crops at most this many times the output side: further, torch's CUDA antialiased bicubic needs more shared memory
# than a block has and raises (its filter spans 4 source pixels an output pixel a unit of downscale)
DEVICE_MAX_DOWNSCALE = 32
EOI_WITHIN = 64  # bytes from the end holding a whole JPEG's end-of-image marker (some carry trailing bytes)


def prepare(data: bytes, size: int, scale_min: float | None, rng: np.random.Generator | None
            ) -> tuple[bytes, tuple[int, int, int, int]] | None:
    """(bytes, crop box x0, y0, x1, y1) for the device to decode (``decoded``), or None when ``data`` is not a
    decodable image. A JPEG the device takes keeps its bytes, with its random resized crop's box drawn from ``rng``
    or, for the evaluation's crop (``scale_min`` None), the box ``CENTRE``; any other image's crop is cut here, its
    pixels the bytes and its box ``PIXELS``."""
    size_of = jpeg_size(data)
    if size_of is None:
        image = decode_and_crop(data, size, scale_min, rng)
        return None if image is None else (image.tobytes(), (PIXELS,) * 4)
    if scale_min is None:  # the whole frame is resized, its shorter side to ``size``
        if min(size_of) <= DEVICE_MAX_DOWNSCALE * size:
            return data, (CENTRE,) * 4
        image = decode_and_crop(data, size, None)
        return None if image is None else (image.tobytes(), (PIXELS,) * 4)
    box = crop_box(*size_of, scale_min, rng)
    if max(box[2] - box[0], box[3] - box[1]) <= DEVICE_MAX_DOWNSCALE * size:
        return data, box
    img = decode(data)  # the box drawn already: cut here, as the CPU path cuts it
    return None if img is None else (resized(img, box, size).tobytes(), (PIXELS,) * 4)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The (width, height) of a JPEG that nvJPEG decodes whole, read from its header alone; None for anything else."""
    if data[:2] != b"\xff\xd8" or data.rfind(b"\xff\xd9", max(0, len(data) - EOI_WITHIN)) < 0:
        return None
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in ("JPEG", "MPO") or img.mode not in ("RGB", "L") or img.info.get("progressive"):
                return None
            width, height = img.size
            return img.size if min(img.size) >= 2 and width * height <= DEVICE_MAX_PIXELS else None
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        return None
