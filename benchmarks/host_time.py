"""Host CPU time of one training step per engine layout, against a bare loop: the CPU measure of issue 54.

    .venv/bin/python benchmarks/host_time.py [--stages 0,1,2,3] [--no-methods] [--no-clip] [--precision fp32]
        [--rounds 12] [--steps 4]

On a GPU the host only launches kernels; when the host's time per step exceeds the GPU's, the GPU waits and the
framework, not the model, sets the speed (DeepSpeed ZeRO-2's per-gradient hooks did on an H200: docs/gpu.md). On a
CPU with one intra-op thread, ``time.thread_time()`` of the step counts the host's work and the model's arithmetic
together; on the census's tiny model (rayvl/checks/census.py, `rayvl check census`: the laion_adapt layout at
ViT-B/32, 188 trainable tensors, 32 px) at batch 2 and 8 tokens the arithmetic is small, so what a layout adds
over the bare loop is host work a GPU would wait on. fp32 by default: this CPU emulates bf16's matrix products,
which would bury the host's work (``--precision bf16`` runs DeepSpeed's bf16 path all the same).

Every layout is rayvl's own step (``rayvl.train.engine.build_engine``, ``rayvl.train.step.Step``) in one
process beside the bare loop (fused AdamW, foreach clipping; bf16 autocast at bf16); rounds interleave them in a
rotating order, each round times ``--steps`` steps of each, and the table gives each layout's median per-step thread
time and the median over rounds of its ratio to the bare loop in the same round (a busy machine slows a whole round,
not one layout). The sync-type ops per step (rayvl.checks.census.SYNC_OPS: each a wait for the GPU on CUDA) come
from one counted step. Timings are printed, never asserted; tests/test_step_census.py pins the counts.

The methods' rows (rayvl.checks.census.METHODS, at stage 0, the auto layout on one GPU): a memory bank ([BoW]'s EMA
key encoders and queue) against a hand-written loop with the same bank, whose EMA forward is the method's own
arithmetic; UniCL's label-aware loss (TOnICS's too) against the bare loop. TOnICS's sampler runs in a thread of its
own: benchmarks/tonics_batches.py times what the training thread pays for it. The whole-CLIP rows (the most common
real use: configs/clip_finetune.yaml on a CLIP with ViT-B/32's tensor layout, 350 trainable tensors, 64 wide):
rayvl's stage-0 step against a bare loop of the same CLIP, held to the auto layout's goal.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rayvl.checks.census as sc  # noqa: E402
import torch  # noqa: E402

# issue 54 on a CPU, × the bare loop: the auto layout (stage 0 there) and ZeRO-1
GOALS = {0: 1.10, 1: 1.5}
# the census's model at a small batch: the frozen text tower's arithmetic is most of a step even so
BATCH, TOKENS = 2, 8


def layouts(stages: list[int], precision: str, methods: bool = True, clip: bool = True) -> dict[str, tuple]:
    """name → (step, census counts) for the bare loop, each stage, (``methods``) each method at stage 0 and
    (``clip``) a whole CLIP at stage 0 with its own bare loop."""
    steps = {"bare loop": sc.bare_step(sc.config(0, precision))}
    for stage in stages:
        steps[f"rayvl ZeRO-{stage}" + (" (auto)" if stage == 0 else "")] = sc.rayvl_step(sc.config(stage, precision))[0]
    if methods:
        steps.update(sc.method_steps(precision))
    if clip:
        steps.update(sc.clip_steps(precision))
    return {name: (step, sc.census(step)) for name, step in steps.items()}


def measure(steps: dict[str, object], rounds: int, per_round: int) -> dict[str, list[float]]:
    """Seconds of this thread's CPU time per step, one value per round for each name; the order rotates."""
    names, times = list(steps), {name: [] for name in steps}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            started = time.thread_time()
            for _ in range(per_round):
                steps[name]()
            times[name].append((time.thread_time() - started) / per_round)
    return times


def table(times: dict[str, list[float]], counts: dict, precision: str) -> str:
    head = f"{'step':<34} {'host ms/step':>13} {'× bare':>7} {'goal':>6} {'sync ops':>9} {'aten ops':>9}"
    lines = [f"host CPU time per step, {precision}, one thread, 188 trainable tensors (a whole CLIP's rows 350), batch "
             f"{sc.BATCH}, {len(times['bare loop'])} interleaved rounds (median); × bare: against the bare loop, a "
             f"method's or a whole CLIP's row against its own bare loop", head, "-" * len(head)]
    for name, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, times[sc.baseline(name)]))
        stage = int(name.split("ZeRO-")[1][0]) if "ZeRO-" in name else None
        goal = f"≤{GOALS[stage]:.2f}" if stage in GOALS else ""
        c = counts[name]
        lines.append(f"{name:<34} {1e3 * statistics.median(values):>13.2f} {ratio:>7.2f} {goal:>6} {c.sync_ops:>9} "
                     f"{c.ops:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages, comma-separated")
    p.add_argument("--no-methods", action="store_true", help="leave out the memory bank and label-aware rows")
    p.add_argument("--no-clip", action="store_true", help="leave out the whole-CLIP rows")
    p.add_argument("--precision", default="fp32", choices=["bf16", "fp32"])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=4, help="steps of each layout per round")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)  # thread time then holds all of the step's arithmetic
    sc.BATCH, sc.TOKENS = BATCH, TOKENS
    built = layouts([int(s) for s in args.stages.split(",") if s], args.precision, not args.no_methods,
                    not args.no_clip)
    times = measure({name: step for name, (step, _) in built.items()}, args.rounds, args.steps)
    print(table(times, {name: counts for name, (_, counts) in built.items()}, args.precision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
