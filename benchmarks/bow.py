"""Cost of the Bag-of-Words deformation ([BoW] §2.2): captions/s on one core, and its share of the full
per-sample pipeline time (tar parse → validate → deform → decode + crop → tokenize), measured in this one run on
the same samples. Goal: < 2 % of the pipeline. Prints a table.

    .venv/bin/python benchmarks/bow.py [--data SHARDS] [--samples 4000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
from collections import Counter
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from rayvl import assets  # noqa: E402
from rayvl.methods.bow.config import DEFAULT_BOW_OPS  # noqa: E402
from rayvl.data.pipeline import Rows, preprocess  # noqa: E402
from rayvl.methods.bow import deformation as bow  # noqa: E402
from rayvl.methods.bow.check import parse_ops as parse_bow_ops  # noqa: E402
from rayvl.methods.bow.rows import Deform  # noqa: E402
from rayvl.data.specs import resolve_shards  # noqa: E402
from rayvl.data.tar import COLUMNS, iter_tar_samples  # noqa: E402
from rayvl.data.demo import write_demo  # noqa: E402
from rayvl.data.text import validate_caption  # noqa: E402

BATCH = 64


def _read(path: str):
    with open(path, "rb") as f:
        yield from iter_tar_samples(f)


def _pipeline(paths, rows: Rows) -> None:
    """What one Ray Data read task does per sample, without Ray's scheduling overhead (which would only make the
    deformation's share smaller)."""
    batch: list[dict] = []
    for path in paths:
        for sample in _read(path):
            batch.append(sample)
            if len(batch) == BATCH:
                preprocess({c: [s.get(c) for s in batch] for c in COLUMNS}, Counter(), rows)
                batch = []
    if batch:
        preprocess({c: [s.get(c) for s in batch] for c in COLUMNS}, Counter(), rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="")
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=4, help="t of RmTopFreq (the demo's base vocabulary has 41 words)")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    spec = args.data or str(write_demo(Path(tempfile.mkdtemp()) / "demo", args.samples, 10) / "train")
    paths = resolve_shards(spec)

    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    t = time.perf_counter()
    stats = bow.compute_stats(spec, seed=0, fraction=0.1)
    stats_s = time.perf_counter() - t
    ray.shutdown()
    ops = [{"rm_top_freq": args.top} if isinstance(o, dict) and "rm_top_freq" in o else o for o in DEFAULT_BOW_OPS]
    deform = bow.Deformer(parse_bow_ops(ops), 0, 0.1, stats)

    samples = [s for path in paths for s in _read(path)]
    captions = [(s["key"], validate_caption(s.get("txt"))[0]) for s in samples]
    rows = Rows(image_size=64, crop_scale_min=0.6, train=True,
                tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=24, transforms=(Deform(deform),))
    _pipeline(paths[:1], rows)  # warm-up: page cache, tokenizer and stopword list load once

    deform_s, pipeline_s = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for key, text in captions:
            deform(key, text)
        deform_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        _pipeline(paths, rows)
        pipeline_s.append(time.perf_counter() - t)
    n = len(captions)
    d, full = min(deform_s), min(pipeline_s)
    print(f"\n{len(paths)} shards, {n} samples, cascade {' + '.join(map(str, ops))}; one core "
          f"(OMP_NUM_THREADS=1), best of {args.repeats}")
    print(f"{'measure':<46} {'value':>12}")
    print(f"{'statistics pass (Ray Data, whole data)':<46} {stats_s:>10.1f} s")
    print(f"{'deformation alone, captions/s':<46} {n / d:>12.0f}")
    print(f"{'deformation, µs per caption':<46} {1e6 * d / n:>12.1f}")
    print(f"{'full per-sample pipeline with BoW, µs/sample':<46} {1e6 * full / n:>12.1f}")
    print(f"{'deformation share of the pipeline':<46} {100 * d / full:>10.2f} %")


if __name__ == "__main__":
    main()
