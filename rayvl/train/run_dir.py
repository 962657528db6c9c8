"""A run's directory: ``<train.storage_path>/<run name>`` — where Ray Train keeps the checkpoints, and where a
finished run leaves what a user looks for (metrics.jsonl, eval.json, data_report.json). The storage path is a
local folder or a URL (``rayvl.storage``); every file here is read and written through it."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from rayvl import storage
from rayvl.checkpoints import METRICS_FILE, latest_checkpoint_dir, read_meta
from rayvl.config import ConfigError, RayvlConfig, from_dict
from rayvl.eval.tasks import METRIC_PREFIXES


@dataclass
class RunResult:
    uri: str  # the run directory as a local path or a URL
    checkpoint_dir: str  # the final checkpoint, in the same storage
    metrics: dict
    data_report: dict

    @property
    def run_dir(self) -> Path | None:
        """The run directory on this machine (a local or ``file://`` storage path); None on object storage."""
        return storage.local_path(self.uri)


def run_paths(cfg: RayvlConfig) -> tuple[str, str]:
    """(storage path, run name). A run with checkpoints is continued only with train.resume."""
    store = storage.normalize(cfg.train.storage_path)
    name = cfg.train.run_name or f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = storage.join(store, name)
    latest = latest_checkpoint_dir(run_dir)
    if latest is not None and not cfg.train.resume:
        raise ConfigError(f"train.run_name: run {run_dir!r} already has checkpoints; "
                          f"set train.resume=true (--resume) to continue it, or choose another name")
    if cfg.train.resume and latest is None:
        raise ConfigError(f"train.resume: run {run_dir!r} has no checkpoint to resume from")
    if latest is not None:
        check_resumable(cfg, read_meta(latest))
    return store, name


# The optimizer and its schedule as the run started them: DeepSpeed restores AdamW's hyperparameters and the
# LR scheduler's position from the checkpoint, and the warm-up + cosine curve is drawn over max_steps — a changed
# value would be ignored (AdamW's) or bend the curve mid-run (an LR jump), so a resume keeps them all.
SCHEDULE_KEYS = ("lr", "warmup_steps", "max_steps", "weight_decay", "betas", "eps")


def check_resumable(cfg: RayvlConfig, meta: dict) -> None:
    """A resume continues the run's own schedule: any schedule key changed since it started is refused, naming
    the key; so is a ``stop_at_step`` the run has already passed."""
    started = from_dict(meta["config"]).train  # typed as the config is (JSON has lists where it has tuples)
    for key in SCHEDULE_KEYS:
        now, then = getattr(cfg.train, key), getattr(started, key)
        if now != then:
            raise ConfigError(
                f"train.{key}: {now} differs from {then}, the value the run started with (checkpoint at step "
                f"{meta['step']}); a resume continues the run's optimizer and learning-rate schedule — resume with "
                f"train.{key}={then}, or start a new run")
    if 0 < cfg.train.stop_at_step <= meta["step"]:
        raise ConfigError(f"train.stop_at_step: {cfg.train.stop_at_step} is not after the checkpoint's step "
                          f"{meta['step']}")


def finish(run_dir: str, result, data_report: dict) -> RunResult:
    """Copy what a user looks for into the run directory: metrics.jsonl, eval.json, data_report.json."""
    run_dir = storage.normalize(run_dir)
    checkpoint_dir = storage.join(run_dir, Path(result.checkpoint.path).name) if result.checkpoint else ""
    metrics = dict(result.metrics or {})
    if checkpoint_dir and storage.is_file(storage.join(checkpoint_dir, METRICS_FILE)):
        storage.write_text(storage.join(run_dir, METRICS_FILE),
                           storage.read_text(storage.join(checkpoint_dir, METRICS_FILE)))
    evals = {k: v for k, v in metrics.items() if k.startswith(METRIC_PREFIXES)}
    storage.write_text(storage.join(run_dir, "eval.json"), json.dumps(evals, indent=2))
    storage.write_text(storage.join(run_dir, "data_report.json"), json.dumps(data_report, indent=2))
    return RunResult(run_dir, checkpoint_dir, metrics, data_report)
