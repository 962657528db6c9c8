"""The checkpoint format, in one place for training, evaluation and export.

A checkpoint is one folder (Ray Train's ``checkpoint_*``, every rank's files merged into it):

    deepspeed/        every rank's DeepSpeed files: model, optimizer and ZeRO partitions, LR scheduler
    train_state.pt    the train state beside DeepSpeed's (rayvl.train.state.TrainState: step, metric history,
                      TOnICS curriculum, memory bank, data position) — one state_dict per component
    rayvl.json        {"step", "config", "final"}: what run wrote it and how far it got
    metrics.jsonl     the metric history, readable (an export of the train state, never read back)
    model.pt          consolidated fp32 weights (final checkpoints only)

Weights load from ``model.pt`` when present, otherwise from the DeepSpeed files of any ZeRO stage.
"""
from __future__ import annotations

import io
import json
import os
import pickle
from contextlib import contextmanager
from pathlib import Path

import torch

from rayvl import storage
from rayvl.config import from_dict, load_config, with_overrides
from rayvl.models.dual_encoder import DualEncoder, build_model

TAG = "deepspeed"
MODEL_FILE = "model.pt"
META_FILE = "rayvl.json"
# in META_FILE: which parameters the checkpoint's optimizer decays (dual_encoder.param_groups; 1, before the rule was
# recorded: a ViT's class token decayed, a locked whole CLIP's projections trained) — a resume's optimizer must have
# its groups to load its state
DECAY_RULE = "weight_decay_rule"
CURRENT_DECAY_RULE = 2
STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.jsonl"
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of the run's committed checkpoints


def read_meta(checkpoint: str | os.PathLike) -> dict:
    """A checkpoint's ``rayvl.json``; the checkpoint may be a local folder or a URL — or a whole CLIP (an OpenAI or
    open_clip file, a Hugging Face CLIP folder: rayvl.models.whole_clip), read as the step 0 of a run starting
    from it."""
    from rayvl.models import whole_clip

    if whole_clip.is_source(checkpoint):  # rayvl's defaults, the CLIP's settings, its text tower frozen as it is
        config = load_config(None, [f"model.init_from_clip={json.dumps(str(Path(checkpoint).expanduser().resolve()))}",
                                    "model.text_strategy=frozen", "model.alignment_layers=0"])
        # CLIP's own tokens: every position its text transformer has (77), as open_clip and CLIP_benchmark score
        config = with_overrides(config, [f"data.max_text_tokens={config.model.clip.context_length}"])
        return {"config": config.to_dict(), "step": 0, "final": True, "whole_clip": str(checkpoint)}
    return json.loads(storage.read_text(storage.join(str(checkpoint), META_FILE)))


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file pickles something other than tensors, plain containers and DeepSpeed's own records."""


def _deepspeed_records() -> list:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and containers — the whole list
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` finds over ZeRO 0-3 checkpoints in fp32 and bf16."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_loads(checkpoint: str | os.PathLike, deepspeed_files: bool = True):
    """Every ``torch.load`` inside — DeepSpeed's own too, which ask for ``weights_only=False`` — unpickles only
    tensors, plain containers and, where it loads ``deepspeed_files``, DeepSpeed's records
    (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``): a file from the storage bucket holding any other pickled object is refused
    instead of run. rayvl's own files need no record, nor DeepSpeed imported (an evaluation actor never uses it)."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_records() if deepspeed_files else []):
            yield
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{checkpoint}: refused to load a checkpoint file that pickles more than tensors and plain containers "
            f"(torch.load weights_only=True): {str(e).splitlines()[0]}") from None
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def load_file(checkpoint: str | os.PathLike, name: str):
    """One file of a checkpoint (a local folder or a URL: only that file is fetched), loaded weights-only."""
    source = storage.join(str(checkpoint), name)
    source = io.BytesIO(storage.read_bytes(source)) if storage.is_url(source) else source
    with weights_only_loads(checkpoint, deepspeed_files=name.startswith(f"{TAG}/")):
        return torch.load(source, map_location="cpu", weights_only=True)


def read_train_state(checkpoint: str | os.PathLike) -> dict:
    """The train state's components by name (rayvl.train.state), e.g. ``["memory_bank"]["ptr"]``."""
    return load_file(checkpoint, STATE_FILE)


def latest_checkpoint_dir(run_dir: str | os.PathLike) -> str | None:
    """The newest checkpoint of a run directory (local or a URL): of the checkpoints Ray Train has committed (its
    ``checkpoint_manager_snapshot.json``), the one holding the highest step. A folder that a failure interrupted
    (some ranks' files uploaded, never reported to the controller) is not one of them, and neither is Ray Train
    going to resume from it. Without that record (folders copied by hand), every folder with its ``rayvl.json``."""
    run_dir = str(run_dir)
    snapshot = storage.join(run_dir, RAY_TRAIN_SNAPSHOT)
    if storage.is_file(snapshot):
        names = [c["checkpoint_dir_name"] for c in json.loads(storage.read_text(snapshot))["checkpoint_results"]]
        folders = [storage.join(run_dir, n) for n in names]
    else:  # checkpoints copied into a folder by hand (no Ray Train record): every one with its rayvl.json
        folders = storage.subdirs(run_dir, "checkpoint_")
    best, best_step = None, -1
    for d in folders:
        if storage.is_file(storage.join(d, META_FILE)):
            step = read_meta(d)["step"]
            if step > best_step:
                best, best_step = d, step
    return best


def checkpoint_uri(path: str | os.PathLike) -> str:
    """The checkpoint a path names: a checkpoint, or a run directory (its newest checkpoint); local or a URL."""
    path = storage.normalize(path)
    from rayvl.models import whole_clip

    if storage.is_file(storage.join(path, META_FILE)) or whole_clip.is_source(path):
        return path
    latest = latest_checkpoint_dir(path)
    if latest is None:
        raise FileNotFoundError(f"{path}: neither a rayvl checkpoint nor a run directory with one")
    return latest


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A local checkpoint folder for ``checkpoint_uri(path)``; a remote checkpoint is downloaded (once) to the
    local cache."""
    return storage.download(checkpoint_uri(path))


def load_weights(checkpoint: str | os.PathLike, zero_stage: int) -> dict:
    """Full fp32 weights: the consolidated ``model.pt`` of a final checkpoint, else rebuilt from the DeepSpeed
    files (stage 0: rank 0's module state; ZeRO 1-3: DeepSpeed's own zero_to_fp32)."""
    ckpt = Path(checkpoint)
    if (ckpt / MODEL_FILE).exists():
        return load_file(ckpt, MODEL_FILE)
    if zero_stage == 0:
        return load_file(ckpt, f"{TAG}/mp_rank_00_model_states.pt")["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with weights_only_loads(ckpt):
        rebuilt = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=TAG)
    if zero_stage == 1:  # ZeRO-1 saves no frozen parameters beside the optimizer's: rank 0's module state holds them
        module = load_file(ckpt, f"{TAG}/mp_rank_00_model_states.pt")["module"]
        rebuilt = {**{k: v.float() if v.is_floating_point() else v for k, v in module.items()}, **rebuilt}
    return rebuilt


def load_model(checkpoint: str | os.PathLike) -> tuple[DualEncoder, dict]:
    """The model of a checkpoint (or of a run directory's newest one) in eval mode, with its config as a dict."""
    ckpt = resolve_checkpoint(checkpoint)
    config = read_meta(ckpt)["config"]
    cfg = from_dict(config)
    from rayvl.models import whole_clip

    if whole_clip.is_source(ckpt):  # a whole CLIP as it is: its weights read by the build
        return build_model(cfg.model).eval(), config
    model = build_model(cfg.model, state=load_weights(ckpt, cfg.train.zero_stage))  # every weight from it
    return model.eval(), config
