"""Training throughput of a rayvl run (Ray Train + DeepSpeed + the Ray Data pipeline) next to a bare torch loop with
the same model, loss, optimizer, global batch and CPU threads, measured side by side in this one run.

    .venv/bin/python benchmarks/train_step.py [--config configs/laion_adapt.yaml] [--steps 60] [--set k=v ...]

- bare torch loop: one process, ``torch.set_num_threads(cores)``, one in-memory batch of the run's global size
  (random uint8 images, captions tokenized from the demo), CLIP loss, AdamW; the upper bound with no data plane and
  no distribution. Measured before and after rayvl's run (after Ray has shut down); the table uses their mean.
- rayvl: the recipe on the embedded demo for ``--steps`` optimizer steps (no evaluation, one checkpoint at the end).
  Its samples/s are over the whole run — every logged window from the first step to the last, the ones that waited
  for data included; a window holds its report's wait for Ray Train's poll and a checkpoint's writing, not an
  evaluation. Between the first and the
  second-to-last window, the CPU time of every process on the machine is split into groups (training workers,
  Ray Data read tasks, Ray's other processes including this driver, other processes, idle): where the cores went.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from rayvl import assets  # noqa: E402
from rayvl.config import load_config  # noqa: E402
from rayvl.data import demo  # noqa: E402
from rayvl.data.text import tokenize  # noqa: E402
from rayvl.losses import clip_loss  # noqa: E402
from rayvl.models.dual_encoder import build_model, param_groups  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GROUPS = (("training workers", ("RayTrainWorker",)), ("Ray Data read tasks", ("ReadShardStream", "ray::IDLE")),
          ("Ray's other processes", ("ray",)))


class CpuShares(threading.Thread):
    """CPU seconds of every process on the machine, snapshotted each time the run's metrics.jsonl gains a line
    (a logged window ends): where the cores went between two windows, by process group."""

    def __init__(self, storage: str):
        super().__init__(daemon=True)
        self.storage, self.snapshots, self.done = Path(storage), [], threading.Event()

    def run(self):
        lines = 0
        while not self.done.wait(0.2):
            found = sum(len(f.read_text().splitlines()) for f in self.storage.glob("*/metrics.jsonl"))
            if found > lines:
                lines = found
                self.snapshots.append((time.perf_counter(), _cpu_seconds()))

    def shares(self, first: int, last: int) -> dict[str, float]:
        """Each group's share of all cores between the ends of windows ``first`` and ``last`` (0-based)."""
        (t0, a), (t1, b) = self.snapshots[first], self.snapshots[last]
        by_group = Counter()
        for pid, (group, seconds) in b.items():
            by_group[group] += seconds - a.get(pid, (group, 0.0))[1]
        cores = len(os.sched_getaffinity(0)) * (t1 - t0)
        return {**{g: by_group[g] / cores for g, _ in GROUPS}, "other processes": by_group["other"] / cores,
                "idle": 1 - sum(by_group.values()) / cores}


def _cpu_seconds() -> dict[int, tuple[str, float]]:
    import psutil

    out = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        try:
            name, times = " ".join(proc.info["cmdline"] or [proc.info["name"] or ""]), proc.cpu_times()
        except (psutil.Error, OSError):
            continue
        group = next((g for g, marks in GROUPS if any(m in name for m in marks)), "other")
        group = GROUPS[-1][0] if proc.pid == os.getpid() else group  # this process is the run's Ray driver
        out[proc.pid] = (group, times.user + times.system)
    return out


def bare_loop(cfg, steps: int, cores: int) -> tuple[float, int]:
    """(samples/s, global batch) of a plain single-process loop."""
    torch.set_num_threads(cores)
    t, d = cfg.train, cfg.data
    batch = t.num_workers * t.micro_batch_size * t.grad_accumulation
    model = build_model(cfg.model, t.seed)
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, eps=t.eps)
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (batch, 3, d.image_size, d.image_size), dtype=np.uint8))
    captions = [demo.caption(demo.sample_scene(rng, 2), rng) for _ in range(batch)]
    ids, mask = (torch.from_numpy(a) for a in tokenize(captions, str(assets.text_model_path(cfg.model.text)),
                                                       d.max_text_tokens))
    model.train()

    def step():
        image_features, text_features, scale = model(images, ids, mask)
        loss = clip_loss(image_features, text_features, scale)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):  # warm-up: allocator, first-call paths
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - start), batch


def rayvl_run(config: str, overrides: list[str], steps: int, storage: str) -> dict:
    """Whole-run samples/s and data-wait share of the recipe, from its logged windows."""
    from rayvl.train.trainer import train

    cfg = load_config(config, [*overrides, f"train.max_steps={steps}", f"train.checkpoint_every={steps}",
                               "eval.tasks=[]", f"train.storage_path={storage}", "train.warmup_steps=0"])
    cpu = CpuShares(storage)
    cpu.start()
    result = train(cfg)
    cpu.done.set()
    cpu.join()
    windows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    t = cfg.train
    per_step = t.num_workers * t.micro_batch_size * t.grad_accumulation
    samples, seconds, waited, last = 0, 0.0, 0.0, 0
    for w in windows:  # a window's seconds = its samples / its samples/s
        n = (w["step"] - last) * per_step
        samples += n
        seconds += n / w["samples_per_s"]
        waited += n / w["samples_per_s"] * w["data_wait_share"]
        last = w["step"]
    # steady state: from the end of the first window to the end of the last one before the final checkpoint
    return {"samples_per_s": samples / seconds, "wait_share": waited / seconds, "windows": windows,
            "worst_window_wait": max(w["data_wait_share"] for w in windows),
            "cpu": cpu.shares(0, len(windows) - 2) if len(cpu.snapshots) >= 3 else {},
            "cpu_steps": (windows[0]["step"], windows[-2]["step"]) if len(windows) >= 3 else None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "configs" / "laion_adapt.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    cfg = load_config(args.config, args.set)
    # the bare loop runs before and after rayvl's run and counts at their mean: a shared machine's speed drifts within
    # minutes (docs/benchmarks.md, "The machine")
    before, batch = bare_loop(cfg, max(10, args.steps // 3), cores)
    run = rayvl_run(args.config, args.set, args.steps, tempfile.mkdtemp())
    ray.shutdown()  # the second bare loop must not share the cores with Ray's idle processes
    after, _ = bare_loop(cfg, max(10, args.steps // 3), cores)
    bare = (before + after) / 2
    print(f"\n{Path(args.config).stem}: global batch {batch}, {cores} cores, image {cfg.data.image_size}px, "
          f"{cfg.data.max_text_tokens} tokens")
    print(f"{'trainer':<58} {'samples/s':>10} {'step s':>8} {'× bare':>7}")
    print(f"{'bare torch loop (1 process, ' + str(cores) + ' threads, batch in memory)':<58} {bare:>10.1f} "
          f"{batch / bare:>8.3f} {1.0:>7.2f}   (before {before:.1f}, after {after:.1f})")
    print(f"{'rayvl: Ray Train + DeepSpeed + Ray Data, whole run':<58} {run['samples_per_s']:>10.1f} "
          f"{batch / run['samples_per_s']:>8.3f} {run['samples_per_s'] / bare:>7.2f}")
    print(f"rayvl data-wait share: {100 * run['wait_share']:.1f}% over the run, worst window "
          f"{100 * run['worst_window_wait']:.1f}%")
    if run["cpu"]:
        print(f"where the {cores} cores went, steps {run['cpu_steps'][0] + 1}–{run['cpu_steps'][1]} (share of all "
              "cores): " + ", ".join(f"{group} {100 * share:.1f}%" for group, share in run["cpu"].items()))
    print("windows (step: samples/s, data wait %): " + ", ".join(
        f"{w['step']}: {w['samples_per_s']:.1f}, {100 * w['data_wait_share']:.1f}" for w in run["windows"]))


if __name__ == "__main__":
    main()
