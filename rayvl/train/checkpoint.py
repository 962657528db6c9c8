"""Saving and restoring a training run in the format of ``rayvl.checkpoints``: every rank's DeepSpeed files, the
train state, and (final checkpoints) consolidated weights, reported through ``ray.train.report``.

Every rank saves into its own local directory and reports it; Ray Train merges the ranks' files into one
checkpoint directory in the run's storage (the DeepSpeed file names carry the rank), so no shared filesystem is
needed between nodes.
"""
from __future__ import annotations

import io
import json
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import ray.train
import torch

from rayvl.checkpoints import META_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE, TAG, read_train_state, \
    weights_only_loads
from rayvl.train.faults import fail_here
from rayvl.train.state import TrainState


def consolidated_state_dict(engine) -> dict | None:
    """Full fp32 model weights on rank 0 (gathered from ZeRO-3 partitions when needed), None elsewhere. Under bf16
    the trained parameters are the optimizer's fp32 master copies, not their bf16 rounding."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    rank = torch.distributed.get_rank()
    gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None) \
        if engine.zero_optimization_stage() == 3 else nullcontext()
    with gathered:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else None
    masters = {}
    if engine.bfloat16_enabled():  # a collective: every rank asks for every parameter, in the same order
        masters = {name: safe_get_full_fp32_param(p) for name, p in module.named_parameters()}
    if state is None:
        return None
    return {k: (masters[k] if masters.get(k) is not None else v).float().cpu() if v.is_floating_point() else v
            for k, v in state.items()}


@contextmanager
def saved(engine, state: TrainState, config: dict, final: bool):
    """Write this rank's part of the checkpoint into a temporary directory and yield it as a Checkpoint; ``final``
    (the last step of this invocation) adds the consolidated weights, and the run is finished (``rayvl.json``)
    when that step is ``train.max_steps``."""
    with tempfile.TemporaryDirectory(prefix="rayvl-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=TAG)
        fail_here("checkpoint_write", state.progress)
        weights = consolidated_state_dict(engine) if final else None  # every rank joins the ZeRO-3 gather
        if torch.distributed.get_rank() == 0:
            torch.save(state.state_dict(), Path(tmp) / STATE_FILE)
            meta = {"step": state.progress.step, "config": config,
                    "final": state.progress.step == config["train"]["max_steps"]}
            (Path(tmp) / META_FILE).write_text(json.dumps(meta))
            with open(Path(tmp) / METRICS_FILE, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in state.progress.history)
            if weights is not None:
                torch.save(weights, Path(tmp) / MODEL_FILE)
        yield ray.train.Checkpoint.from_directory(tmp)


def restored_state(checkpoint: ray.train.Checkpoint) -> dict:
    """The train state of a checkpoint, read alone (not its DeepSpeed files) from wherever it is stored."""
    with checkpoint.filesystem.open_input_file(f"{checkpoint.path}/{STATE_FILE}") as f:
        data = f.read()
    with weights_only_loads(checkpoint.path):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def restore(engine, state: TrainState, train_state: dict | None = None) -> bool:
    """Load Ray Train's latest checkpoint (if any) into the engine and the train state (``train_state``: that
    checkpoint's, when the caller has read it already); True if one was loaded."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return False
    with checkpoint.as_directory() as d, weights_only_loads(checkpoint.path):
        engine.load_checkpoint(d, tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        state.load_state_dict(train_state if train_state is not None else read_train_state(d))
    return True
