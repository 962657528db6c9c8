"""Samples decoded per sample trained: how far Ray Data reads ahead of a short run, by what the run knows of the size
of a pass and what its read-ahead budget is — measured side by side in this one run, on the same shards.

    .venv/bin/python benchmarks/read_ahead.py [--shards 2] [--samples 5000] [--steps 6]

Four ways the same shards come: with img2dataset's parquet and stats files, the training stream's object-store budget
the bytes of the rows the run trains on (rayvl.train.datasets.read_ahead_bytes); the same with Ray Data's default
budget, as before that bound; without the files, the size of a pass estimated from the first shard's members
(rayvl.data.shards.samples_per_pass); without them and with no size (the driver's pass size forced to unknown, as
for `pipe:` shards: ≈2,000 read tasks' worth of passes listed), the budget bounding it all the same. Each is a short
run of two CPU workers; "decoded" is the training report's samples seen (every sample a read task parsed and decoded,
sent to the report before each block it emits), "trained" the rows the run's data position says it trained on.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def shards(out: Path, n: int, samples: int, metadata: bool) -> str:
    """``n`` demo shards of ``samples`` samples, with img2dataset's files or the tars alone."""
    from rayvl.data.demo import write_demo

    demo = write_demo(out / "demo", samples=n * samples, eval_samples=64, seed=0, shard_size=samples)
    if metadata:
        return str(demo / "train")
    bare = out / "bare"
    bare.mkdir()
    for tar in sorted((demo / "train").glob("*.tar")):
        shutil.copy(tar, bare / tar.name)
    return str(bare)


SLUGS = {"img2dataset files": "files", "files, Ray's budget (before)": "ray-budget", "no files: estimated": "estimated",
         "no files, no size": "no-size"}


def run(way: str, data: str, evalset: str, steps: int, storage: Path) -> dict:
    from rayvl.config import load_config
    from rayvl.data import shards as shard_sizes
    from rayvl.train.trainer import train

    cfg = load_config(REPO / "configs" / "laion_adapt.yaml", [
        f"data.train={data}", f"data.eval={evalset}", "eval.tasks=[]", "data.image_size=32", "train.micro_batch_size=8",
        f"train.max_steps={steps}", "train.warmup_steps=1", f"train.checkpoint_every={steps}", f"train.log_every={steps}",
        f"train.storage_path={storage}", f"train.run_name={SLUGS[way]}", "model.alignment_layers=1", "model.embed_dim=64",
        "train.report_to=[]"])
    from rayvl.train import datasets

    estimate, budget = shard_sizes.samples_per_pass, datasets.read_ahead_bytes
    if way == "no files, no size":  # the driver's pass size as it was without the estimate
        shard_sizes.samples_per_pass = lambda given, paths: shard_sizes.pass_size(paths)
    if way == "files, Ray's budget (before)":  # no read-ahead bound of the run's own
        datasets.read_ahead_bytes = lambda plan: None
    try:
        start = time.time()
        result = train(cfg, verbose=False)
    finally:
        shard_sizes.samples_per_pass, datasets.read_ahead_bytes = estimate, budget
    trained = sum(result.data_report["position"]["rows_per_pass"].values())
    seen = result.data_report["counts"]["samples_seen"]
    return {"way": way, "pass size": result.data_report["img2dataset_successes_per_pass"], "decoded": seen,
            "trained": trained, "per trained": seen / trained, "wall s": time.time() - start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--samples", type=int, default=5000, help="samples a shard")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rayvl-read-ahead-") as tmp:
        tmp = Path(tmp)
        with_files = shards(tmp / "a", args.shards, args.samples, metadata=True)
        without = shards(tmp / "b", args.shards, args.samples, metadata=False)
        evalset = str(tmp / "a" / "demo" / "eval")
        for way, data in (("img2dataset files", with_files), ("files, Ray's budget (before)", with_files),
                          ("no files: estimated", without), ("no files, no size", without)):
            rows.append(run(way, data, evalset, args.steps, tmp / "runs"))
    ray.shutdown()
    header = ("way", "pass size", "decoded", "trained", "per trained", "wall s")
    cells = [header] + [(r["way"], str(r["pass size"]), f"{r['decoded']:,}", f"{r['trained']:,}",
                         f"{r['per trained']:.1f}", f"{r['wall s']:.0f}") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    print(f"read-ahead: {args.shards} shards × {args.samples} samples, {args.steps} steps of 2 workers × 8 rows")
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
