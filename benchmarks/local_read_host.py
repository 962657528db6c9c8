"""What a local evaluation's loader costs the process that runs the model: the main process's CPU time a batch
of images at 224 px, handed over by the loader's workers as pickled numpy arrays (rayvl before 2026-11-29) against
tensors in shared memory (``rayvl.eval.local_read.Batches`` now), side by side in one run (issue 55: `rayvl eval`
without Ray evaluated 2,025 images/s on an H200, where the goal is 3,000).

    .venv/bin/python benchmarks/local_read_host.py [--batch 128] [--batches 40] [--rounds 3] [--workers N]

On a GPU that process also launches every kernel of the model's forward, one batch after another: whatever it
spends receiving a batch is time the GPU waits. Here the loader's workers (``--workers``, default CPUs − 1) make
batches of uint8 images as a held-out read does after decoding (a copy of one random batch made once per worker, no
decode: the transport alone), and the main process takes each batch as ``LocalEmbedder`` does on a GPU — the image
column as a tensor, copied into a buffer allocated once (what ``pin_memory`` copies; it reads every byte, so the
first touch of a batch's fresh shared-memory pages is counted) —, no model. Printed: the main thread's CPU ms a
batch (``time.thread_time``) and the wall ms a batch, medians over ``--rounds`` rounds that alternate the two sides.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's rayvl, installed or not


@lru_cache(maxsize=2)
def template(n: int, size: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 3, size, size), dtype=np.uint8)


def made(batch: dict, size: int) -> dict:
    """A batch of images as a loader worker hands it over after decoding (the same random pixels each time)."""
    return {"image": template(len(batch["index"]), size).copy(), "index": batch["index"]}


def side(shared: bool, batch: int, batches: int, workers: int, size: int) -> tuple[float, float]:
    """(main thread CPU ms, wall ms) a batch, the first batch (the workers' start) left out."""
    from functools import partial

    import torch

    from rayvl.eval import local_read

    columns = {"index": np.arange(batch * (batches + 1))}
    # before: a threshold past any batch, every column pickled through the worker's pipe
    loader = local_read.Batches(local_read.ListBatches(columns, batch, partial(made, size=size)), workers,
                                batch * 3 * size * size, shared_bytes=local_read.SHARED_BYTES if shared else 1 << 62)
    arriving = iter(loader)
    buffer = torch.empty((batch, 3, size, size), dtype=torch.uint8)
    buffer.copy_(torch.from_numpy(next(arriving)["image"]))
    cpu, wall = time.thread_time(), time.perf_counter()
    for b in arriving:
        buffer.copy_(torch.from_numpy(b["image"]))
    return 1e3 * (time.thread_time() - cpu) / batches, 1e3 * (time.perf_counter() - wall) / batches


def main() -> None:
    from rayvl.eval.local_read import loader_workers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=0, help="loader workers (default: this machine's CPUs − 1)")
    args = p.parse_args()
    workers = loader_workers(args.workers)
    results = {False: [], True: []}
    for r in range(args.rounds):
        for shared in ((False, True) if r % 2 == 0 else (True, False)):
            results[shared].append(side(shared, args.batch, args.batches, workers, args.size))
    print(f"local_read_host: {args.batches} batches of {args.batch} images at {args.size} px "
          f"({args.batch * 3 * args.size ** 2 / 2 ** 20:.1f} MiB), {workers} loader worker(s), "
          f"medians of {args.rounds} rounds")
    print(f"{'the loader workers hand over':<40} {'main thread CPU ms a batch':>27} {'wall ms a batch':>16}")
    for shared, what in ((False, "pickled numpy arrays (before)"), (True, "tensors in shared memory (now)")):
        cpu = statistics.median(c for c, _ in results[shared])
        wall = statistics.median(w for _, w in results[shared])
        print(f"{what:<40} {cpu:27.1f} {wall:16.1f}")


if __name__ == "__main__":
    main()
