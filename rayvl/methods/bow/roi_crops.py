"""Many random resized crops of many images, cut in one op: the pseudo-labeller's queries ([BoW] §2.3: c crops an
image, each a query).

Cutting c crops with Pillow resamples the full image c times on one core; here the work is split where it is
cheapest. On a CPU, per image (``prepare``): decode at a reduced JPEG scale where the crops allow it (libjpeg's
DCT scaling), draw the c crop boxes from the image's seeded generator on the image's own pixel grid (all c at once,
``images.random_resized_crop_boxes``: Pillow's path cuts the same boxes from the full image), and downscale the
image once so that its shorter side is just large enough that no crop is upsampled relative to the crop size. On
the model's device, per batch of images (``cut``): a ``grid_sample`` over the padded batch cuts every crop of every
image (s × s bilinear samples averaged into each crop pixel: an area filter where a crop is reduced) — on a GPU the
10 crops of 100 images are a few kernels.
(torchvision's ``roi_align`` does the same; core torch's ``grid_sample`` also runs where torchvision's compiled ops
cannot load, as on CPU machines whose registry has only a CUDA torchvision.)

The crops differ from Pillow's bicubic ``resize(box=…)`` by resampling filter only (same boxes, same size);
tests/test_roi_crops.py holds the two within a stated tolerance, pixels and labels.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from rayvl.data.images import chw, decode, random_resized_crop_boxes, resized
from rayvl.device_decode import to_device


@dataclass
class CropSource:
    """One image ready to be cut: the image downscaled and the boxes of its crops on it."""

    image: Image.Image  # RGB
    boxes: np.ndarray  # float32 (c, 4): x0, y0, x1, y1 in pixels of ``image`` (corners, as Pillow's box)

    @property
    def pixels(self) -> np.ndarray:
        return chw(self.image)


def source_side(size: int, scale_min: float) -> int:
    """The shorter side an image is downscaled to: a crop keeps ≥ scale_min of the area at an aspect ratio within
    [3/4, 4/3], so its shorter side is ≥ √(¾·scale_min) of the image's; at this side every crop is at least
    ``size`` pixels a side (reduced to the crop size, never enlarged beyond what Pillow's path does)."""
    return math.ceil(size / math.sqrt(0.75 * scale_min))


def rng_of(key: str, seed: int) -> np.random.Generator:
    """The image's crop generator: seeded by (seed, image key), so labels do not depend on batching or order."""
    return np.random.default_rng([seed, zlib.crc32(str(key).encode())])


def decode_reduced(data: bytes, side: int) -> tuple[Image.Image, tuple[int, int]] | None:
    """(the RGB image, its full size), or None where ``rayvl.data.images.decode`` finds no image: a JPEG is
    decoded at the smallest DCT scale (1/2, 1/4, 1/8) whose shorter side is still ≥ ``side`` — a 2,000-pixel photo
    costs a quarter of its pixels. The boxes are drawn on the full-size grid (``prepare``), so the scale changes
    resampling only, never which part of the image a crop covers."""
    full: list = []
    img = decode(data, draft=lambda size: full.append(size) or _draft_size(size, side))
    return None if img is None else (img, full[0] if full else img.size)


def _draft_size(full: tuple[int, int], side: int) -> tuple[int, int] | None:
    w, h = full
    short = min(w, h)
    if short <= 2 * side:  # no DCT scale of 1/2 or less keeps the side
        return None
    return max(1, round(w * side / short)), max(1, round(h * side / short))


def prepare(data: bytes, key: str, crops: int, size: int, scale_min: float, seed: int) -> CropSource | None:
    """An encoded image → its ``CropSource`` (None when not a decodable image): boxes drawn on its full-size grid
    from ``rng_of(key, seed)``, pixels decoded and downscaled to ``source_side``."""
    side = source_side(size, scale_min)
    decoded = decode_reduced(data, side)
    if decoded is None:
        return None
    img, (width, height) = decoded
    boxes = random_resized_crop_boxes(width, height, scale_min, rng_of(key, seed), crops).astype(np.float32)
    return from_image(img, boxes, (width, height), side)


def from_image(img: Image.Image, boxes: np.ndarray, full: tuple[int, int], side: int) -> CropSource:
    """``img`` (decoded at any scale of a ``full``-size image) downscaled so its shorter side is ``side`` (never
    enlarged), and ``boxes`` (on the full-size grid) mapped onto its pixels."""
    scale = min(1.0, side / min(img.size))
    if scale < 1.0:
        target = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        img = img.resize(target, Image.BICUBIC, reducing_gap=3.0)
    sx, sy = img.width / full[0], img.height / full[1]
    mapped = boxes * np.array([sx, sy, sx, sy], np.float32)
    # float rounding may put a box's far edge a hair past the image, which Pillow refuses
    return CropSource(img, np.minimum(mapped, np.array([img.width, img.height] * 2, np.float32)))


def cut_on_cpu(sources: list[CropSource], size: int) -> np.ndarray:
    """``cut`` done by Pillow on this core, uint8 (Σ c, 3, size, size): a bicubic resize of each box of the
    downscaled image — faster on a CPU than ``grid_sample``, and what a CPU labeller runs on its threads."""
    return np.stack([resized(s.image, tuple(map(float, b)), size) for s in sources for b in s.boxes])


MAX_SAMPLES = 4  # bilinear samples a side averaged into a crop pixel, at most: area-filtered up to a 4× reduction


def cut(sources: list[CropSource], size: int, device="cpu"):
    """Every crop of every source, in order, uint8 (Σ c, 3, size, size) on ``device``, each crop pixel the mean of
    s × s bilinear samples spread over its area (s = ⌈the image's largest box side / size⌉, 1 to MAX_SAMPLES: an
    area filter where a crop is reduced, one sample where it is enlarged). Images of one s are cut together: padded
    into one canvas (each image's last row and column repeated into the padding, so a box at an image's edge samples
    that image alone), all their crops by one ``grid_sample`` per sample offset — each image's c crops stacked as one
    tall output grid, so the images are not copied once per crop. What an image's crops are depends on that image
    alone, not on the images cut beside it (up to the float rounding of a coordinate normalised to the canvas: one
    level of 255, at a few pixels in 100,000)."""
    import torch

    crops = len(sources[0].boxes)
    if any(len(s.boxes) != crops for s in sources):
        raise ValueError("every source of a cut must have the same number of crops")
    order, pieces = [], []
    for group in _groups(sources, size):
        pieces.append(_cut_group([sources[i] for i in group], size, _samples(sources[group[0]], size), device))
        order += group
    out = torch.cat(pieces)  # (N, c, 3, size, size), in group order
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))
    return out[to_device(back, out.device)].reshape(-1, 3, size, size)


def _samples(source: CropSource, size: int) -> int:
    extent = float(np.max(np.maximum(source.boxes[:, 2] - source.boxes[:, 0], source.boxes[:, 3] - source.boxes[:, 1])))
    return int(min(MAX_SAMPLES, max(1, math.ceil(extent / size - 1e-6))))


def _groups(sources: list[CropSource], size: int):
    """Indices of the sources cut together: one s each, and a canvas at most twice the pixels of its images (an
    image that would make it more — a banner beside portraits — starts the next group)."""
    by_samples: dict[int, list[int]] = {}
    for i, s in enumerate(sources):
        by_samples.setdefault(_samples(s, size), []).append(i)
    for indices in by_samples.values():
        group: list[int] = []
        for i in indices:
            if group and not _compact([sources[j].image.size for j in group + [i]]):
                yield group
                group = []
            group.append(i)
        yield group


def _compact(sizes: list[tuple[int, int]]) -> bool:
    canvas = len(sizes) * max(w for w, _ in sizes) * max(h for _, h in sizes)
    return canvas <= 2 * sum(w * h for w, h in sizes)


def _cut_group(sources: list[CropSource], size: int, samples: int, device):
    """(N, c, 3, size, size) uint8: the crops of sources that share a canvas and a sample count."""
    import torch
    import torch.nn.functional as F

    h = max(s.image.height for s in sources)
    w = max(s.image.width for s in sources)
    canvas = np.stack([np.pad(s.pixels, ((0, 0), (0, h - s.image.height), (0, w - s.image.width)), mode="edge")
                       for s in sources])
    images = to_device(torch.from_numpy(canvas), device).float()
    boxes = to_device(torch.from_numpy(np.stack([s.boxes for s in sources])), device)  # (N, c, 4)
    out = None
    for a in range(samples):
        for b in range(samples):
            grid = _grid(boxes, h, w, size, ((b + 0.5) / samples, (a + 0.5) / samples))
            part = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
            out = part if out is None else out + part  # (N, 3, c·size, size)
    out = out / samples ** 2
    n, crops = len(sources), len(sources[0].boxes)
    out = out.view(n, 3, crops, size, size).transpose(1, 2)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _grid(boxes, h: int, w: int, size: int, offset: tuple[float, float]):
    """(N, c·size, size, 2) sampling points: crop k of image n fills rows k·size … (k+1)·size − 1, output pixel
    j's sample at j + ``offset`` (in pixels of the crop, (0.5, 0.5) its centre) spread over its box. grid_sample's
    coordinates (align_corners=False) put −1 and +1 at the outer edges of the first and last pixels — the corner
    convention of the boxes."""
    import torch

    steps = torch.arange(size, device=boxes.device, dtype=torch.float32)
    tx, ty = (steps + offset[0]) / size, (steps + offset[1]) / size  # along a box, in (0, 1)
    x0, y0, x1, y1 = boxes.unbind(-1)  # (N, c) each
    xs = (x0[..., None] + tx * (x1 - x0)[..., None]) * (2 / w) - 1  # (N, c, size)
    ys = (y0[..., None] + ty * (y1 - y0)[..., None]) * (2 / h) - 1
    grid = torch.stack(torch.broadcast_tensors(xs[:, :, None, :], ys[:, :, :, None]), -1)  # (N, c, size, size, 2)
    return grid.flatten(1, 2)
