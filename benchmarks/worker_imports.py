"""What a Ray Train worker's start-up spends importing, measured in fresh processes side by side in this one run:
each library a worker imports before its first step, as rayvl imports it (rayvl.compat.import_without: timm without
wandb, DeepSpeed without mlflow) and as a plain ``import`` would. The floor under every run's start: each worker is a
new process, and a run on 2 workers imports all of it twice.

    .venv/bin/python benchmarks/worker_imports.py [--repeats 5]

Prints the median wall time of each import over ``--repeats`` fresh interpreters (torch imported first and not
counted: every line needs it), on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (row, what the process imports first and does not time, what it times)
CASES = [
    ("timm, as rayvl imports it (no wandb)", "from rayvl.compat import import_timm", "import_timm()"),
    ("timm, plain import", "from rayvl.compat import ensure_torchvision_importable as e; e()", "import timm"),
    ("deepspeed, as rayvl imports it (no mlflow)", "from rayvl.compat import import_without",
     "import_without('deepspeed', 'mlflow')"),
    ("deepspeed, plain import", "", "import deepspeed"),
    ("transformers AutoModel", "", "from transformers import AutoModel"),
    ("ray.train.torch + ray.data", "", "import ray.train.torch, ray.data"),
    ("rayvl.train.loop (the training function's module)", "", "import rayvl.train.loop"),
]


def timed(setup: str, statement: str) -> float:
    code = (f"import torch, time\n{setup}\nt = time.perf_counter()\n{statement}\n"
            f"print(time.perf_counter() - t)")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(r.stdout.split()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"| import (fresh process, torch already imported) | median of {args.repeats} (s) | min (s) |")
    print("|---|---|---|")
    for row, setup, statement in CASES:
        times = [timed(setup, statement) for _ in range(args.repeats)]
        print(f"| {row} | {statistics.median(times):.2f} | {min(times):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
