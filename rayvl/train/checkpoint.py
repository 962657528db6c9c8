"""Checkpoints that restore everything: every rank's DeepSpeed shards (model, optimizer, ZeRO partitions),
the LR scheduler, the step and the metric history, reported through ``ray.train.report``.

Every rank saves into its own local directory and reports it; Ray Train merges the ranks' files into one
checkpoint directory in the run's storage (the DeepSpeed file names carry the rank), so no shared filesystem is
needed between nodes.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import ray.train
import torch

TAG = "deepspeed"
MODEL_FILE = "model.pt"  # consolidated fp32 weights, written with the final checkpoint for evaluation/export
META_FILE = "rayvl.json"


def consolidated_state_dict(engine) -> dict | None:
    """Full model weights on rank 0 (gathered from ZeRO-3 partitions when needed), None elsewhere."""
    import deepspeed

    module = engine.module
    rank = torch.distributed.get_rank()
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else None
        return state
    return {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else None


@contextmanager
def saved(engine, step: int, history: list, config: dict, final: bool, extra: dict | None = None,
          rank0_files: dict | None = None):
    """Write this rank's part of the checkpoint into a temporary directory and yield it as a Checkpoint.
    ``extra`` (e.g. the TOnICS curriculum) rides in DeepSpeed's client state of every rank; ``rank0_files``
    ({name: object}, e.g. the memory bank, identical on every rank) are written once, by rank 0, with torch.save."""
    with tempfile.TemporaryDirectory(prefix="rayvl-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=TAG, client_state={"step": step, **(extra or {})})
        state = consolidated_state_dict(engine) if final else None
        if torch.distributed.get_rank() == 0:
            (Path(tmp) / META_FILE).write_text(json.dumps({"step": step, "config": config, "final": final}))
            with open(Path(tmp) / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in history)
            if state is not None:
                torch.save(state, Path(tmp) / MODEL_FILE)
            for name, obj in (rank0_files or {}).items():
                torch.save(obj, Path(tmp) / f"{name}.pt")
        yield ray.train.Checkpoint.from_directory(tmp)


def restore(engine) -> tuple[int, list, dict]:
    """(step to continue from, metric history, client state) from Ray Train's checkpoint; (0, [], {}) when fresh."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, [], {}
    with checkpoint.as_directory() as d:
        _, client_state = engine.load_checkpoint(d, tag=TAG, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
        history_file = Path(d) / "metrics.jsonl"
        history = [json.loads(x) for x in history_file.read_text().splitlines()] if history_file.exists() else []
        for f in Path(d).glob("*.pt"):  # rank-0 files (memory bank); model.pt is the export, not state
            if f.name != MODEL_FILE:
                client_state[f.stem] = torch.load(f, map_location="cpu", weights_only=False)
    return int(client_state["step"]), history, client_state


def latest_checkpoint_dir(run_dir: str | os.PathLike) -> Path | None:
    """The newest ``checkpoint_*`` folder of a local run directory (the one holding the highest step)."""
    best, best_step = None, -1
    for d in Path(run_dir).glob("checkpoint_*"):
        meta = d / META_FILE
        if meta.exists():
            step = json.loads(meta.read_text())["step"]
            if step > best_step:
                best, best_step = d, step
    return best
