"""Samples/s of the data plane (tar read → JPEG decode → random resized crop → tokenize), three readers of the
same shards on the same cores, measured side by side in this one run:

- rayvl's Ray Data pipeline, exactly as a training run builds it (``rayvl.data.shards.read_shards``);
- webdataset + torch DataLoader with one loader worker per core, doing the same per-sample work (rayvl's
  ``preprocess`` on batches) — the loader an open_clip user has;
- the ceiling: the same work in one plain process, times the cores.

    .venv/bin/python benchmarks/data_pipeline.py --photo [--samples 4000] [--sizes 64,224] [--passes 2] [--rounds 3]
        [--read-cpus 0.5,1] [--transform-rows 64,256]

``--photo`` writes img2dataset-layout shards of photo-like JPEGs at LAION's sizes (160–400 px a side, ≈15–40 KB)
instead of the demo's small drawings. webdataset is a benchmark-only dependency (``pip install -e .[bench]``).

Each round of a reader is timed batch by batch. "steady" is its rate between the moments it had delivered 10% and
90% of the round's samples: what a long training run gets, where one Ray Data execution serves every pass and the
loader's workers live as long as the run. "whole" counts from the first request to the last batch, start-up and
tail included, and "1st batch s" is the start-up latency; a run pays those once.
"""
from __future__ import annotations

import argparse
import gc
import io
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from PIL import Image  # noqa: E402

from rayvl import assets  # noqa: E402
from rayvl.config import DataConfig  # noqa: E402
from rayvl.data import demo, shards  # noqa: E402
from rayvl.data.pipeline import Rows, preprocess  # noqa: E402
from rayvl.data.report import create_report  # noqa: E402
from rayvl.data.specs import resolve_shards  # noqa: E402
from rayvl.data.tar import COLUMNS, iter_tar_samples  # noqa: E402

BATCH = 64
TRAIN_COLUMNS = ["image", "input_ids", "attention_mask", "label"]
STEADY = (0.1, 0.9)  # a round's steady rate is measured between these shares of its samples


class Round(NamedTuple):
    steady: float  # samples/s between STEADY's marks
    whole: float  # samples/s from the first request to the last batch
    first: float  # seconds to the first batch


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


def plain(paths: list[str], kw: Rows) -> Iterator[int]:
    """One process, one batch at a time: the per-core ceiling of the per-sample work. Yields each batch's size."""
    batch = []
    for path in paths:
        with open(path, "rb") as f:
            for sample in iter_tar_samples(f):
                batch.append(sample)
                if len(batch) == BATCH:
                    yield len(preprocess(_batch_of(batch), Counter(), kw)["key"])
                    batch = []
    if batch:
        yield len(preprocess(_batch_of(batch), Counter(), kw)["key"])


def webdataset_loader(paths: list[str], kw: Rows, workers: int):
    """webdataset + DataLoader as an open_clip user sets it up: shards split over loader workers, raw bytes,
    batches of 64 turned into model inputs in the worker by the same ``preprocess``."""
    import torch
    import webdataset as wds

    def to_inputs(samples):
        out = preprocess(_batch_of([{"key": s["__key__"], "img": s.get("jpg"), "img_ext": "jpg", "txt": s.get("txt"),
                                     "json": s.get("json")} for s in samples]), Counter(), kw)
        return {c: torch.from_numpy(out[c]) for c in TRAIN_COLUMNS}

    ds = wds.WebDataset(paths, shardshuffle=False, empty_check=False, handler=wds.warn_and_continue,
                        nodesplitter=None, workersplitter=wds.split_by_worker).batched(BATCH, collation_fn=to_inputs)
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True)


def report_actor_name() -> str:
    """A data report, as in training: the pipeline's counting is part of what is measured."""
    name = f"benchmark-{time.time_ns()}"
    create_report(name)
    return name


def _batches(loader, passes: int) -> Iterator[int]:
    return (len(b["image"]) for _ in range(passes) for b in loader)


def timed(batches: Iterable[int]) -> Round:
    """Samples/s of one round of a reader: steady (between the moments it had delivered 10% and 90% of the round's
    samples — what a long training run sees), whole (first request to last batch) and its first batch's latency."""
    start, n, marks = time.perf_counter(), 0, []
    for size in batches:
        n += size
        marks.append((time.perf_counter() - start, n))
    (t_lo, n_lo), (t_hi, n_hi) = (next(m for m in marks if m[1] >= q * n) for q in STEADY)
    whole = n / marks[-1][0]
    # a round of a few batches has no steady part to measure
    return Round(steady=(n_hi - n_lo) / (t_hi - t_lo) if t_hi > t_lo else whole, whole=whole, first=marks[0][0])


def measure(spec: str, size: int, args, cores: int) -> list[tuple]:
    """Every reader gets one warm-up pass (page cache, tokenizer load, worker start-up), then ``rounds`` rounds in
    which each reader in turn runs ``passes`` passes timed together — the way each serves a training run (loader
    workers kept, one Ray Data execution for all passes). Readers take turns so that a slow spell of the machine
    (a VM's host taking CPU back) falls on all of them; the table gives each reader's median round."""
    paths = resolve_shards(spec)
    kw = Rows(image_size=size, crop_scale_min=0.6, train=True, max_tokens=24,
              tokenizer_path=str(assets.text_model_path("minilm-l6")))
    # the loader's persistent workers are forked (by the warm-up pass) before Ray starts its threads in this process
    loader = webdataset_loader(paths, kw, cores)
    wds_run = partial(_batches, loader)
    sum(wds_run(1))
    ray.init(address="local", include_dashboard=False, num_cpus=cores)
    ray.data.DataContext.get_current().enable_progress_bars = False
    # one data report for all runs, made before any timing, as a training run makes it once: its actor's process
    # start-up is not part of reading
    report = report_actor_name()

    def ray_data(read_cpus: float, rows: int, k: int) -> Iterator[int]:
        reading = shards.Reading(read_cpus=read_cpus, batch_size=rows, threads=DataConfig().read_threads,
                                 shuffle=True, passes=k, report_name=report)
        ds = shards.read_shards(spec, kw, reading, TRAIN_COLUMNS)
        return (len(b["image"]) for b in ds.iter_batches(batch_size=BATCH, batch_format="numpy"))

    readers = {"plain process (1 core)": lambda k: (n for _ in range(k) for n in plain(paths, kw)),
               f"webdataset + DataLoader ({cores} workers)": wds_run,
               **{f"rayvl Ray Data (read_cpus={c:g}, {r} rows)": partial(ray_data, c, r)
                  for r in args.transform_rows for c in args.read_cpus}}
    for run in readers.values():
        if run is not wds_run:  # its warm-up pass ran before Ray started
            sum(run(1))
    rounds: dict[str, list[Round]] = {name: [] for name in readers}
    for _ in range(args.rounds):
        for name, run in readers.items():
            rounds[name].append(timed(run(args.passes)))
    del loader, wds_run, readers
    gc.collect()  # the loader's workers exit
    ray.shutdown()
    return [(size, name, *(statistics.median(getattr(r, f) for r in rs) for f in Round._fields),
             min(r.steady for r in rs), max(r.steady for r in rs)) for name, rs in rounds.items()]


def table(rows: list[tuple], cores: int) -> str:
    lines = [f"{'px':>4}  {'reader':<40} {'steady /s':>9} {'(min–max)':>11} {'× wds':>6} {'× ceiling':>9} "
             f"{'whole /s':>8} {'1st batch s':>11}"]
    for size in sorted({r[0] for r in rows}):
        rate = {r[1]: r[2] for r in rows if r[0] == size}
        wds_rate = next(v for k, v in rate.items() if k.startswith("webdataset"))
        ceiling = next(v for k, v in rate.items() if k.startswith("plain")) * cores
        lines.append(f"{size:>4}  {'ceiling: plain process × ' + str(cores) + ' cores':<40} {ceiling:>9.1f}")
        for px, name, steady, whole, first, low, high in (r for r in rows if r[0] == size):
            lines.append(f"{px:>4}  {name:<40} {steady:>9.1f} {f'({low:.0f}–{high:.0f})':>11} "
                         f"{steady / wds_rate:>6.2f} {steady / ceiling:>9.2f} {whole:>8.1f} {first:>11.2f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="", help="shard spec; default: generated shards")
    p.add_argument("--photo", action="store_true", help="generate photo-like LAION-sized JPEGs")
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--passes", type=int, default=2, help="passes timed together per reader and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all readers in turn; the table has medians")
    p.add_argument("--sizes", default="64,224")
    p.add_argument("--read-cpus", default="0.5,1", help="data.read_cpus values to measure")
    p.add_argument("--transform-rows", default=str(DataConfig().transform_batch_size),
                   help="data.transform_batch_size values to measure (rows per transform call and block)")
    args = p.parse_args()
    args.read_cpus = [float(v) for v in args.read_cpus.split(",")]
    args.transform_rows = [int(v) for v in args.transform_rows.split(",")]
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
          f"24 tokens, consumer batch {BATCH}, data.read_threads={DataConfig().read_threads}; median of {args.rounds} "
          f"rounds of {args.passes} passes per reader, readers in turn, after a warm-up pass each; ratios of "
          "steady rates")
    print(table(rows, cores))


if __name__ == "__main__":
    main()
