"""Samples/s of the Ray Data pipeline alone (read → decode → crop → tokenize) next to a plain single-process
reader of the same shards doing the same per-sample work. Both are measured in this one run; prints a table.

    .venv/bin/python benchmarks/data_pipeline.py [--data SHARDS] [--samples 4000] [--epochs 2]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from rayvl import assets  # noqa: E402
from rayvl.data import shards  # noqa: E402
from rayvl.data.pipeline import preprocess  # noqa: E402
from rayvl.data.tar import COLUMNS, iter_tar_samples, resolve_shards  # noqa: E402
from rayvl.data.demo import write_demo  # noqa: E402


def plain_reader(paths, kw) -> int:
    """The same tar parse and preprocess function, one process, one batch at a time."""
    n = 0
    batch: list[dict] = []
    for path in paths:
        with open(path, "rb") as f:
            for sample in iter_tar_samples(f):
                batch.append(sample)
                if len(batch) == kw_batch:
                    n += _preprocess(batch, kw)
                    batch = []
    return n + (_preprocess(batch, kw) if batch else 0)


def _preprocess(samples: list[dict], kw) -> int:
    batch = {c: [s.get(c) for s in samples] for c in COLUMNS}
    return len(preprocess(batch, **kw)["key"])


kw_batch = 64


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="")
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--read-cpus", type=float, default=0.5)
    args = p.parse_args()
    spec = args.data or str(write_demo(Path(tempfile.mkdtemp()) / "demo", args.samples, 10) / "train")
    paths = resolve_shards(spec)
    tok = str(assets.text_model_path("minilm-l6"))
    kw = dict(image_size=args.image_size, crop_scale_min=0.6, train=True, tokenizer_path=tok, max_tokens=24,
              report_name=None)

    rows = []
    # plain reader first, so no idle Ray process competes with it; pass 0 of each reader is a warm-up (page cache,
    # tokenizer load, Ray worker start-up) and is not reported
    for epoch in range(args.epochs + 1):
        t = time.perf_counter()
        n = plain_reader(paths, kw)
        if epoch:
            rows.append(("plain single process", epoch, n, n / (time.perf_counter() - t)))
    ray.init(address="local", include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = shards.read_shards(spec, read_cpus=args.read_cpus, transform_batch_size=kw_batch, shuffle_files=True,
                            **kw)
    for epoch in range(args.epochs + 1):
        t = time.perf_counter()
        n = sum(len(b["image"]) for b in ds.iter_batches(batch_size=64, batch_format="numpy"))
        if epoch:
            rows.append((f"ray data (read_cpus={args.read_cpus:g}, {ray.cluster_resources()['CPU']:g} CPUs)",
                         epoch, n, n / (time.perf_counter() - t)))
    ray.shutdown()
    print(f"\n{len(paths)} shards, image {args.image_size}px, 24 tokens, batch {kw_batch}")
    print(f"{'reader':<34} {'epoch':>5} {'samples':>8} {'samples/s':>10}")
    for name, epoch, n, rate in rows:
        print(f"{name:<34} {epoch:>5} {n:>8} {rate:>10.1f}")


if __name__ == "__main__":
    main()
