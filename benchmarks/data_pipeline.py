"""Samples/s of the data plane (tar read → JPEG decode → random resized crop → tokenize), three readers of the
same shards on the same cores, measured side by side in this one run:

- rayvl's Ray Data pipeline, exactly as a training run builds it (``rayvl.data.shards.read_shards``);
- webdataset + torch DataLoader with one loader worker per core, doing the same per-sample work (rayvl's
  ``preprocess`` on batches) — the loader an open_clip user has;
- the ceiling: the same work in one plain process, times the cores.

    .venv/bin/python benchmarks/data_pipeline.py --photo [--samples 4000] [--sizes 64,224] [--passes 3]

``--photo`` writes img2dataset-layout shards of photo-like JPEGs at LAION's sizes (160–400 px a side, ≈15–40 KB)
instead of the demo's small drawings. webdataset is a benchmark-only dependency (``pip install -e .[bench]``).
"""
from __future__ import annotations

import argparse
import gc
import io
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from PIL import Image  # noqa: E402

from rayvl import assets  # noqa: E402
from rayvl.data import demo, shards  # noqa: E402
from rayvl.data.pipeline import preprocess  # noqa: E402
from rayvl.data.report import report_actor  # noqa: E402
from rayvl.data.tar import COLUMNS, iter_tar_samples, resolve_shards  # noqa: E402

BATCH = 64
TRAIN_COLUMNS = ["image", "input_ids", "attention_mask", "label"]


def photo_shards(out: Path, samples: int, n_shards: int, seed: int = 0) -> str:
    """img2dataset-layout shards of photo-like JPEGs: a smooth random colour field plus sensor-like noise, sides
    160–400 px, quality 85 — what LAION's resized downloads cost to decode (the drawings of the demo are 112 px)."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    per_shard = -(-samples // n_shards)
    for shard in range(n_shards):
        rows, started = [], time.time()
        for i in range(min(per_shard, samples - shard * per_shard)):
            w, h = (int(v) for v in rng.integers(160, 401, 2))
            low = rng.integers(0, 256, (int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3)).astype(np.uint8)
            pixels = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.float32)
            pixels += rng.normal(0, rng.uniform(5, 10), pixels.shape)
            buf = io.BytesIO()
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=85)
            objects = demo.sample_scene(rng, int(rng.integers(1, 4)))
            rows.append({"key": f"{shard:05d}{i:04d}", "caption": demo.caption(objects, rng), "status": "success",
                         "width": w, "height": h, "jpg": buf.getvalue()})
        demo.write_shard(out, shard, rows, started)
    return str(out)


def _batch_of(samples: list[dict]) -> dict:
    return {c: [s.get(c) for s in samples] for c in COLUMNS}


def plain(paths: list[str], kw: dict) -> int:
    """One process, one batch at a time: the per-core ceiling of the per-sample work."""
    n, batch = 0, []
    for path in paths:
        with open(path, "rb") as f:
            for sample in iter_tar_samples(f):
                batch.append(sample)
                if len(batch) == BATCH:
                    n += len(preprocess(_batch_of(batch), counts=Counter(), **kw)["key"])
                    batch = []
    return n + (len(preprocess(_batch_of(batch), counts=Counter(), **kw)["key"]) if batch else 0)


def webdataset_loader(paths: list[str], kw: dict, workers: int):
    """webdataset + DataLoader as an open_clip user sets it up: shards split over loader workers, raw bytes,
    batches of 64 turned into model inputs in the worker by the same ``preprocess``."""
    import torch
    import webdataset as wds

    def to_inputs(samples):
        out = preprocess(_batch_of([{"key": s["__key__"], **{c: s.get(c) for c in COLUMNS[1:]}}
                                    for s in samples]), counts=Counter(), **kw)
        return {c: torch.from_numpy(out[c]) for c in TRAIN_COLUMNS}

    ds = wds.WebDataset(paths, shardshuffle=False, empty_check=False, handler=wds.warn_and_continue,
                        nodesplitter=None, workersplitter=wds.split_by_worker).batched(BATCH, collation_fn=to_inputs)
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True)


def report_actor_name() -> str:
    """A data report, as in training: the pipeline's counting is part of what is measured."""
    name = f"benchmark-{time.time_ns()}"
    report_actor(name)
    return name


def timed(name: str, size: int, passes: int, run) -> list[tuple]:
    """One warm-up pass (page cache, tokenizer load, worker start-up), then ``passes`` passes timed together — the
    way each reader serves a training run (loader workers kept, one Ray Data execution for all passes)."""
    run(1)
    t = time.perf_counter()
    n = run(passes)
    return [(size, name, n, n / (time.perf_counter() - t))]


def timed_webdataset(paths: list[str], kw: dict, cores: int, size: int, passes: int) -> list[tuple]:
    loader = webdataset_loader(paths, kw, cores)
    return timed(f"webdataset + DataLoader ({cores} workers)", size, passes,
                 lambda k: sum(len(b["image"]) for _ in range(k) for b in loader))


def measure(spec: str, size: int, args, cores: int) -> list[tuple]:
    paths = resolve_shards(spec)
    kw = dict(image_size=size, crop_scale_min=0.6, train=True, max_tokens=24,
              tokenizer_path=str(assets.text_model_path("minilm-l6")))
    rows = timed("plain process (1 core)", size, args.passes, lambda k: sum(plain(paths, kw) for _ in range(k)))
    rows += timed_webdataset(paths, kw, cores, size, args.passes)
    gc.collect()  # the loader's persistent workers exit before Ray starts
    ray.init(address="local", include_dashboard=False, num_cpus=cores)
    ray.data.DataContext.get_current().enable_progress_bars = False
    # one data report for all runs, made before any timing, as a training run makes it once: its actor's process
    # start-up (≈1.2 s of CPU here) is not part of reading
    report = report_actor_name()
    for read_cpus in args.read_cpus:
        def run(k):
            ds = shards.read_shards(spec, read_cpus=read_cpus, transform_batch_size=BATCH, shuffle_files=True,
                                    report_name=report, columns=TRAIN_COLUMNS, passes=k, **kw)
            return sum(len(b["image"]) for b in ds.iter_batches(batch_size=BATCH, batch_format="numpy"))
        rows += timed(f"rayvl Ray Data (read_cpus={read_cpus:g})", size, args.passes, run)
    ray.shutdown()
    return rows


def table(rows: list[tuple], cores: int) -> str:
    lines = [f"{'px':>4}  {'reader':<40} {'samples':>8} {'samples/s':>10} {'× webdataset':>13} {'× ceiling':>10}"]
    for size in sorted({r[0] for r in rows}):
        rate = {r[1]: r[3] for r in rows if r[0] == size}
        wds_rate = next(v for k, v in rate.items() if k.startswith("webdataset"))
        ceiling = next(v for k, v in rate.items() if k.startswith("plain")) * cores
        lines.append(f"{size:>4}  {'ceiling: plain process × ' + str(cores) + ' cores':<40} {'':>8} {ceiling:>10.1f}")
        for r in rows:
            if r[0] == size:
                lines.append(f"{size:>4}  {r[1]:<40} {r[2]:>8} {r[3]:>10.1f} {r[3] / wds_rate:>13.2f} "
                             f"{r[3] / ceiling:>10.2f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="", help="shard spec; default: generated shards")
    p.add_argument("--photo", action="store_true", help="generate photo-like LAION-sized JPEGs")
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--passes", type=int, default=3, help="passes timed per reader (after one warm-up pass)")
    p.add_argument("--sizes", default="64,224")
    p.add_argument("--read-cpus", default="0.5,1", help="data.read_cpus values to measure")
    args = p.parse_args()
    args.read_cpus = [float(v) for v in args.read_cpus.split(",")]
    cores = len(os.sched_getaffinity(0))
    tmp = Path(tempfile.mkdtemp())
    if args.data:
        spec = args.data
    elif args.photo:
        spec = photo_shards(tmp / "photo", args.samples, args.shards)
    else:
        spec = str(demo.write_demo(tmp / "demo", args.samples, 10) / "train")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        rows += measure(spec, size, args, cores)
    kb = np.mean([os.path.getsize(p) for p in resolve_shards(spec)]) / max(1, args.samples / args.shards) / 1024
    print(f"\n{len(resolve_shards(spec))} shards, {args.samples} samples (≈{kb:.0f} KB a sample), {cores} cores, "
          f"24 tokens, batch {BATCH}; {args.passes} passes timed after a warm-up pass")
    print(table(rows, cores))


if __name__ == "__main__":
    main()
