"""Fault injection for drills and tests: ``RAYVL_FAIL_AT=<point>:<step>:<rank>`` in the workers' environment
kills that rank's process (SIGKILL, as the OOM killer or a lost spot instance would) when it reaches ``point`` at
``step`` — once: a worker group that has resumed from a checkpoint runs on.

Points: ``step`` — after the optimizer step ``step`` (a worker lost mid-epoch); ``checkpoint_write`` — after the rank's DeepSpeed files are written, before its part of the checkpoint is
reported (the other ranks' parts may already be in storage: a checkpoint folder Ray Train never commits).
"""
from __future__ import annotations

import os
import signal

import ray.train


def fail_here(point: str, progress) -> None:
    spec = os.environ.get("RAYVL_FAIL_AT", "")
    if not spec or progress.resumed_at:
        return
    name, step, rank = spec.split(":")
    if name == point and int(step) == progress.step and int(rank) == ray.train.get_context().get_world_rank():
        print(f"rayvl: RAYVL_FAIL_AT={spec}: killing rank {rank} at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
