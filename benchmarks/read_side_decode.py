"""What a read task spends on an image, and what it sends on, with the decode on the CPU (``data.decode: cpu``) or left
to the device (``device``: it reads the JPEG's header, draws the crop box and keeps the bytes,
rayvl/data/encoded_jpegs.py) — the CPU time per image a GPU node's read tasks save, which is what bounds them when
their CPUs cannot feed the GPU (issue 55 item 3), measured without a GPU.

    .venv/bin/python benchmarks/read_side_decode.py [--rounds 5] [--size 224]

Each row: the demo's held-out JPEGs (112 px) as they are, and re-encoded at quality 90 at larger sides, through the
read tasks' own ``pipeline.preprocess`` (validation, the crop or the box, the tokenizer) as a training read task runs
it (random resized crops), interleaved rounds in one process, the median milliseconds an image; and the bytes an
image's row holds in the object store.
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's rayvl, installed or not

from rayvl import assets  # noqa: E402
from rayvl.config import DataConfig  # noqa: E402
from rayvl.data.demo import ensure_demo  # noqa: E402
from rayvl.data.pipeline import Rows, preprocess  # noqa: E402

SIDES = (0, 256, 512, 1024)  # 0: the demo's JPEGs as they are


def jpegs(demo: Path, n: int) -> list[bytes]:
    with tarfile.open(sorted((demo / "eval").glob("*.tar"))[0]) as tar:
        return [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")][:n]


def reencoded(images: list[bytes], side: int) -> list[bytes]:
    if not side:
        return images
    out = []
    for data in images:
        buffer = io.BytesIO()
        Image.open(io.BytesIO(data)).convert("RGB").resize((side, side * 3 // 4), Image.BICUBIC).save(
            buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def batch_of(images: list[bytes]) -> dict:
    n = len(images)
    return {"key": np.array([f"{i:09d}" for i in range(n)], dtype=object), "img": images,
            "txt": ["a photo of a red square on a blue field"] * n, "json": [b"{}"] * n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=224, help="data.image_size")
    parser.add_argument("--images", type=int, default=200)
    args = parser.parse_args()
    d = DataConfig()
    demo = ensure_demo(Path(d.demo_dir).expanduser(), d.demo_samples, d.demo_eval_samples)
    tokenizer = str(assets.text_model_path("minilm-l6"))
    base = jpegs(demo, args.images)
    print(f"read side of one image, data.image_size={args.size}, random resized crops, {len(base)} images, median of "
          f"{args.rounds} interleaved rounds")
    print("| JPEG | decode=cpu ms | decode=device ms | cpu / device | row bytes cpu | row bytes device |")
    print("|---|---|---|---|---|---|")
    for side in SIDES:
        images = reencoded(base, side)
        batch = batch_of(images)
        rows = {d: Rows(args.size, 0.6, True, tokenizer, 32, decode=d) for d in ("cpu", "device")}
        times: dict[str, list[float]] = {d: [] for d in rows}
        out = {}
        for _ in range(args.rounds):
            for decode, r in rows.items():
                started = time.perf_counter()
                out[decode] = preprocess(batch, Counter(), r)
                times[decode].append((time.perf_counter() - started) / len(images) * 1e3)
        cpu, device = (statistics.median(times[d]) for d in ("cpu", "device"))
        row_cpu = out["cpu"]["image"][0].nbytes
        row_device = np.mean([len(b) for b in out["device"]["image_bytes"]]) + 4 * 8
        w, h = Image.open(io.BytesIO(images[0])).size
        print(f"| {w}×{h} | {cpu:.3f} | {device:.3f} | {cpu / device:.1f}× | {row_cpu:,} | {row_device:,.0f} |")


if __name__ == "__main__":
    main()
