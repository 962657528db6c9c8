"""Decode where it is cheapest: the JPEGs a read task kept encoded (rayvl.data.encoded_jpegs) decoded by the GPU
that embeds or trains on them.

A batch's JPEGs go in one ``torchvision.io.decode_jpeg`` call on the GPU (nvJPEG), on a CUDA stream of this
thread's own; each crop box is cut and resized bicubic with antialias (torch's antialiased kernel is PIL's, a =
-0.5), the crops of one shape in one call, rounded to uint8 together, and put in row order with one gather: no host
synchronisation of rayvl's (torchvision's decoder waits for its own stream). A batch is decoded ``DECODE_CHUNK``
JPEGs at a time, so its full-size frames never all lie on the device at once.
A JPEG nvJPEG refuses is decoded by Pillow on the host; one neither decodes is left out and counted by the caller.
Without CUDA the JPEGs are decoded by Pillow and cut by the same tensor code: what the tests compare with the CPU
path.
"""
from __future__ import annotations

import io
import logging
import threading
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

from rayvl.data.encoded_jpegs import CENTRE, PIXELS
from rayvl.data.images import centre_geometry, chw, decode

DECODE_CHUNK = 64  # JPEGs a decoder call: their frames (full size) are freed before the next chunk's
RESIZE_BYTES = 512 << 20  # float32 input of one resize call at most: a batch of one crop shape is split past it
log = logging.getLogger("rayvl")


def decoded(data, boxes: np.ndarray, size: int, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """(uint8 (k, 3, size, size) on ``device``: the crops of the rows that decode, in order; a bool mask of those k
    among the n rows) of ``prepare``'s bytes and boxes."""
    boxes = np.asarray(boxes, np.int64).reshape(-1, 4)
    ok = np.ones(len(boxes), bool)
    parts: list[tuple[list[int], torch.Tensor]] = []  # (rows, their crops on the device)
    pixels = np.flatnonzero(boxes[:, 0] == PIXELS)
    if len(pixels):
        cut = np.stack([np.frombuffer(data[i], np.uint8) for i in pixels]).reshape(-1, 3, size, size)
        parts.append((pixels.tolist(), to_device(torch.from_numpy(cut), device)))
    jpegs = np.flatnonzero(boxes[:, 0] != PIXELS)
    for at in range(0, len(jpegs), DECODE_CHUNK):
        chunk = jpegs[at:at + DECODE_CHUNK]
        shapes: dict[tuple[int, int], list] = defaultdict(list)
        for i, frame in zip(chunk, frames([data[i] for i in chunk], device)):
            if frame is not None and boxes[i, 0] == CENTRE:  # the evaluation's: the whole frame resized, then cut
                shapes[(CENTRE, *frame.shape[1:])].append((int(i), frame))
                continue
            x0, y0, x1, y1 = (int(v) for v in boxes[i])
            if frame is None or x1 > frame.shape[2] or y1 > frame.shape[1]:
                ok[i] = False
                continue
            shapes[(y1 - y0, x1 - x0)].append((int(i), frame[:, y0:y1, x0:x1]))
        parts += resized(shapes, size)
    if not parts:
        return torch.empty((0, 3, size, size), dtype=torch.uint8, device=device), ok
    rows = np.concatenate([np.asarray(r, np.int64) for r, _ in parts])
    crops = torch.cat([c for _, c in parts]) if len(parts) > 1 else parts[0][1]
    order = np.argsort(rows, kind="stable")  # the kept rows in their order
    if (order == np.arange(len(order))).all():
        return crops, ok
    return crops[to_device(torch.from_numpy(order), device)], ok


def resized(shapes: dict[tuple[int, int], list[tuple[int, torch.Tensor]]], size: int
            ) -> list[tuple[list[int], torch.Tensor]]:
    """One chunk's crops, {(h, w): [(row, uint8 (3, h, w) crop)]} → [(rows, uint8 (k, 3, size, size))], bicubic with
    antialias (PIL's filter, as ``images.resized`` resizes on the CPU); a crop of the size already is kept as it is.
    The evaluation's frames, {(CENTRE, h, w): [(row, uint8 (3, h, w) frame)]}, are resized whole to
    ``images.centre_geometry``'s size and cut there, as open_clip's transform (``images.centre_crop``) cuts them.
    The crops of one shape go in one call; the float outputs of every shape are rounded to uint8 together. A random
    crop's shape is nearly always its own, so a row costs two kernels (its float copy, its resize) and the chunk
    four more: a batch's launches, which its copy thread makes beside the training step's, stay near one for each
    row's crop, not one for each elementwise op of it."""
    done, rows, floats = [], [], []
    for shape, crops in shapes.items():
        h, w = shape[-2:]
        new_w, new_h, left, top = centre_geometry(w, h, size) if shape[0] == CENTRE else (size, size, 0, 0)
        if (h, w) == (new_h, new_w):
            done.append(([i for i, _ in crops], torch.stack([c[:, top:top + size, left:left + size]
                                                             for _, c in crops])))
            continue
        per_call = max(1, RESIZE_BYTES // (3 * h * w * 4))
        for first in range(0, len(crops), per_call):
            some = crops[first:first + per_call]
            rows += [i for i, _ in some]
            # the float input a temporary of the call: one call's RESIZE_BYTES on the device at a time
            out = F.interpolate(some[0][1][None].float() if len(some) == 1 else
                                torch.stack([c for _, c in some]).float(),
                                size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False)
            floats.append(out if (new_h, new_w) == (size, size) else out[:, :, top:top + size, left:left + size])
    if floats:
        out = torch.cat(floats) if len(floats) > 1 else floats[0]
        done.append((rows, out.round_().clamp_(0, 255).to(torch.uint8)))
    return done


def frames(data: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """Each JPEG's uint8 (3, H, W) frame on ``device`` (None: undecodable): on a GPU all in one nvJPEG call
    (``decoded_by``), on a CPU by Pillow."""
    decode_jpeg = gpu_decoder(device) if device.type == "cuda" else None
    if decode_jpeg is None:
        return [_pillow(d, device) for d in data]
    return decoded_by(decode_jpeg, data, device)


_threads = threading.local()  # each thread's own decoding stream, by device


def decoded_by(decode_jpeg, data: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """``frames`` by torchvision's ``decode_jpeg``: the whole list in one call; a list it refuses (one bad JPEG
    fails the call) halved until the JPEGs it refuses are alone, those decoded by Pillow. On a GPU the decoder
    runs on a stream of this thread's own, and the caller's stream waits for it: torchvision's CUDA decoder
    allocates its frames on the current stream and writes them from a stream of its own that does not wait for it,
    so on the caller's stream it could be handed memory a kernel queued there still reads (pytorch/vision#9606)."""
    if not data:
        return []
    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]  # a copy: bytes are read-only
    if device.type != "cuda":
        return _halved(decode_jpeg, encoded, data, device)
    side, caller = side_stream(device), torch.cuda.current_stream(device)
    with torch.cuda.stream(side):
        out = _halved(decode_jpeg, encoded, data, device)
    caller.wait_stream(side)
    for frame in out:
        if frame is not None:
            frame.record_stream(caller)  # freed, their memory waits for the caller's kernels, not the side stream's
    return out


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's decoding stream on ``device``, made once — never its current stream (torch hands streams out
    from a pool of 32 in turn, so a new one can be one in use)."""
    streams = getattr(_threads, "streams", None)
    if streams is None:
        streams = _threads.streams = {}
    if device not in streams:
        side = torch.cuda.Stream(device)
        while side == torch.cuda.current_stream(device):
            side = torch.cuda.Stream(device)
        streams[device] = side
    return streams[device]


_fallbacks = [0]  # JPEGs the device's decoder refused and Pillow decoded on the host, in this process


def _halved(decode_jpeg, encoded: list[torch.Tensor], data: list[bytes], device) -> list[torch.Tensor | None]:
    from torchvision.io import ImageReadMode

    try:
        return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        if device.type == "cuda":  # a failed call may have left writes queued on its stream: none into what follows
            torch.cuda.synchronize(device)
        if len(encoded) == 1:
            _fallbacks[0] += 1
            if str(_fallbacks[0]).strip("0") == "1":  # 1, 10, 100, ...: said, not at every image
                log.warning(f"data decode: {_fallbacks[0]} JPEG(s) so far the device's decoder refused, handed to "
                            f"Pillow on the host")
            return [_pillow(data[0], device)]
        half = len(encoded) // 2
        return (_halved(decode_jpeg, encoded[:half], data[:half], device)
                + _halved(decode_jpeg, encoded[half:], data[half:], device))


_decoder: dict = {}


def gpu_decoder(device: torch.device):
    """torchvision.io.decode_jpeg where it decodes on this process's GPU, else None — no torchvision, one without
    its image extension, or one built without nvJPEG (its CUDA op is there and raises when called): the JPEGs are
    then decoded by Pillow on the host, which ``device_decoding`` says. Tried once on a tiny JPEG."""
    if "decode_jpeg" not in _decoder:
        try:
            from rayvl.compat import ensure_torchvision_importable

            ensure_torchvision_importable()
            from torchvision.io import ImageReadMode, decode_jpeg

            with torch.cuda.stream(side_stream(device)):  # as every decode runs (decoded_by)
                decode_jpeg(torch.frombuffer(bytearray(tiny_jpeg()), dtype=torch.uint8), mode=ImageReadMode.RGB,
                            device=device)
            _decoder["decode_jpeg"] = decode_jpeg
        except (ImportError, AttributeError, OSError):
            _decoder["decode_jpeg"] = None
        except RuntimeError as e:  # a build without the decoder says so; anything else may pass: tried again later
            if "compiled" in str(e) or "nvjpeg" in str(e).lower() or "extension" in str(e):
                _decoder["decode_jpeg"] = None
            else:
                log.warning(f"data decode: the GPU's JPEG decoder failed its trial ({e}); Pillow for now")
                return None
    return _decoder["decode_jpeg"]


def tiny_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 150)).save(out, "JPEG")
    return out.getvalue()


def device_decoding(device: torch.device) -> str:
    """What decodes a device-decoded row's JPEG on ``device``, said in the run's and the evaluation's log."""
    if device.type != "cuda":
        return "Pillow on the CPU (no GPU here), cut by the device path's code"
    if gpu_decoder(device) is None:
        return "Pillow on the host: this torchvision has no CUDA JPEG decoder (install torchvision's CUDA build)"
    return "nvJPEG on the GPU (torchvision.io.decode_jpeg)"


def _pillow(data: bytes, device: torch.device) -> torch.Tensor | None:
    img = decode(data)
    return None if img is None else to_device(torch.from_numpy(chw(img).copy()), device)


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A CPU ``tensor`` on ``device``: to a GPU from pinned memory, without blocking — a copy from pageable memory
    waits for the GPU's stream, which would make the labeller wait on the GPU once a chunk (and an embedding loop
    once a batch, a decoder once a batch): the pseudo-labeller's crops (rayvl.methods.bow.roi_crops), the embedding
    loops' batches (rayvl.eval.embed) and the decoded crops here."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
