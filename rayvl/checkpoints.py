"""The checkpoint format, in one place for training, evaluation and export.

A checkpoint is one folder (Ray Train's ``checkpoint_*``, every rank's files merged into it):

    deepspeed/        every rank's DeepSpeed files: model, optimizer and ZeRO partitions, LR scheduler
    train_state.pt    the train state beside DeepSpeed's (rayvl.train.state.TrainState: step, metric history,
                      TOnICS curriculum, memory bank) — one state_dict per component
    rayvl.json        {"step", "config", "final"}: what run wrote it and how far it got
    metrics.jsonl     the metric history, readable (an export of the train state, never read back)
    model.pt          consolidated fp32 weights (final checkpoints only)

Weights load from ``model.pt`` when present, otherwise from the DeepSpeed files of any ZeRO stage.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rayvl.config import from_dict
from rayvl.models.dual_encoder import DualEncoder

TAG = "deepspeed"
MODEL_FILE = "model.pt"
META_FILE = "rayvl.json"
STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.jsonl"


def read_meta(checkpoint: str | os.PathLike) -> dict:
    return json.loads((Path(checkpoint) / META_FILE).read_text())


def read_train_state(checkpoint: str | os.PathLike) -> dict:
    """The train state's components by name (rayvl.train.state), e.g. ``["memory_bank"]["ptr"]``."""
    return torch.load(Path(checkpoint) / STATE_FILE, map_location="cpu", weights_only=False)


def latest_checkpoint_dir(run_dir: str | os.PathLike) -> Path | None:
    """The newest ``checkpoint_*`` folder of a local run directory (the one holding the highest step)."""
    best, best_step = None, -1
    for d in Path(run_dir).glob("checkpoint_*"):
        if (d / META_FILE).exists():
            step = read_meta(d)["step"]
            if step > best_step:
                best, best_step = d, step
    return best


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    path = Path(path).expanduser()
    if (path / META_FILE).exists():
        return path
    latest = latest_checkpoint_dir(path)
    if latest is None:
        raise FileNotFoundError(f"{path}: neither a rayvl checkpoint nor a run directory with one")
    return latest


def load_weights(checkpoint: str | os.PathLike, zero_stage: int) -> dict:
    """Full fp32 weights: the consolidated ``model.pt`` of a final checkpoint, else rebuilt from the DeepSpeed
    files (stage 0: rank 0's module state; ZeRO 1-3: DeepSpeed's own zero_to_fp32)."""
    ckpt = Path(checkpoint)
    if (ckpt / MODEL_FILE).exists():
        return torch.load(ckpt / MODEL_FILE, map_location="cpu")
    if zero_stage == 0:
        return torch.load(ckpt / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=TAG)


def load_model(checkpoint: str | os.PathLike) -> tuple[DualEncoder, dict]:
    """The model of a checkpoint (or of a run directory's newest one) in eval mode, with its config as a dict."""
    ckpt = resolve_checkpoint(checkpoint)
    config = read_meta(ckpt)["config"]
    cfg = from_dict(config)
    model = DualEncoder(cfg.model)
    model.load_state_dict(load_weights(ckpt, cfg.train.zero_stage), strict=True)
    return model.eval(), config
