"""Decode where it is cheapest: the JPEGs a read task kept encoded (rayvl.data.encoded_jpegs) decoded by the GPU
that embeds or trains on them.

A batch's JPEGs go in one ``torchvision.io.decode_jpeg`` call on the GPU (nvJPEG); each crop box is cut and resized
bicubic with antialias (torch's antialiased kernel is PIL's, a = -0.5), the crops of one shape in one call. A JPEG
nvJPEG refuses is decoded by Pillow on the host; one neither decodes is left out and counted by the caller. Without
CUDA the JPEGs are decoded by Pillow and cut by the same tensor code: what the tests compare with the CPU path.
"""
from __future__ import annotations

import warnings
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

from rayvl.data.encoded_jpegs import PIXELS
from rayvl.data.images import chw, decode


def decoded(data, boxes: np.ndarray, size: int, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """(uint8 (k, 3, size, size) on ``device``: the crops of the rows that decode, in order; a bool mask of those k
    among the n rows) of ``prepare``'s bytes and boxes."""
    boxes = np.asarray(boxes, np.int64).reshape(-1, 4)
    n = len(boxes)
    out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=device)
    ok = np.ones(n, bool)
    pixels = np.flatnonzero(boxes[:, 0] == PIXELS)
    if len(pixels):
        cut = np.stack([np.frombuffer(data[i], np.uint8) for i in pixels]).reshape(-1, 3, size, size)
        out[_index(pixels, device)] = _to_device(torch.from_numpy(cut), device)
    jpegs = np.flatnonzero(boxes[:, 0] != PIXELS)
    shapes: dict[tuple[int, int], list] = defaultdict(list)
    for i, frame in zip(jpegs, frames([data[i] for i in jpegs], device)):
        x0, y0, x1, y1 = (int(v) for v in boxes[i])
        if frame is None or x1 > frame.shape[2] or y1 > frame.shape[1]:
            ok[i] = False
            continue
        shapes[(y1 - y0, x1 - x0)].append((i, frame[:, y0:y1, x0:x1]))
    for shape, crops in shapes.items():
        out[_index([i for i, _ in crops], device)] = resized(torch.stack([c for _, c in crops]), size)
    return (out if ok.all() else out[_index(np.flatnonzero(ok), device)]), ok


def resized(crops: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (k, 3, h, w) crops of one shape → uint8 (k, 3, size, size), bicubic with antialias (PIL's filter, as
    ``images.resized`` resizes on the CPU); a crop of the size already is kept as it is."""
    if crops.shape[-2:] == (size, size):
        return crops
    out = F.interpolate(crops.float(), size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def frames(data: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """Each JPEG's uint8 (3, H, W) frame on ``device`` (None: undecodable): on a GPU all in one nvJPEG call
    (each apart, then Pillow, for a batch it refuses), on a CPU by Pillow."""
    decode_jpeg = gpu_decoder() if device.type == "cuda" else None
    if decode_jpeg is None:
        return [_pillow(d, device) for d in data]
    return decoded_by(decode_jpeg, data, device)


def decoded_by(decode_jpeg, data: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """``frames`` by torchvision's ``decode_jpeg``: the whole list in one call; for a list it refuses (one bad JPEG
    fails the call), each apart, and Pillow for those it refuses alone."""
    from torchvision.io import ImageReadMode

    encoded = [_bytes_tensor(d) for d in data]
    try:
        return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        out = []
        for tensor, d in zip(encoded, data):
            try:
                out.append(decode_jpeg(tensor, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                out.append(_pillow(d, device))
        return out


_decoder: list = []


def gpu_decoder():
    """torchvision.io.decode_jpeg where it can decode on this process's GPU, else None (a torchvision without its
    image extension, or none: the JPEGs are then decoded by Pillow on the host, which ``device_decoding`` says)."""
    if not _decoder:
        try:
            from rayvl.compat import ensure_torchvision_importable

            ensure_torchvision_importable()
            from torchvision.io import decode_jpeg

            torch.ops.image.decode_jpegs_cuda  # noqa: B018 - raises where the extension has no CUDA decoder
            _decoder.append(decode_jpeg)
        except (ImportError, AttributeError, RuntimeError, OSError):
            _decoder.append(None)
    return _decoder[0]


def device_decoding(device: torch.device) -> str:
    """What decodes a device-decoded row's JPEG on ``device``, said in the run's and the evaluation's log."""
    if device.type != "cuda":
        return "Pillow on the CPU (no GPU here), cut by the device path's code"
    if gpu_decoder() is None:
        return "Pillow on the host: this torchvision has no CUDA JPEG decoder (install torchvision's CUDA build)"
    return "nvJPEG on the GPU (torchvision.io.decode_jpeg)"


def _pillow(data: bytes, device: torch.device) -> torch.Tensor | None:
    img = decode(data)
    return None if img is None else _to_device(torch.from_numpy(chw(img).copy()), device)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():  # read only: the decoder never writes into its input
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8)


def _index(rows, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(rows, np.int64), device=device)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
