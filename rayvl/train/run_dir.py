"""A run's directory: ``<train.storage_path>/<run name>`` — where Ray Train keeps the checkpoints, and where a
finished run leaves what a user looks for (metrics.jsonl, eval.json, data_report.json)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from rayvl.checkpoints import METRICS_FILE, latest_checkpoint_dir
from rayvl.config import ConfigError, RayvlConfig
from rayvl.eval.tasks import METRIC_PREFIXES


@dataclass
class RunResult:
    run_dir: Path
    checkpoint_dir: str
    metrics: dict
    data_report: dict


def run_paths(cfg: RayvlConfig) -> tuple[str, str]:
    """(storage path, run name). A local run with checkpoints is continued only with train.resume."""
    storage = cfg.train.storage_path
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    name = cfg.train.run_name or f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(storage) / name if "://" not in storage else None
    if run_dir is not None:
        exists = run_dir.exists() and latest_checkpoint_dir(run_dir) is not None
        if exists and not cfg.train.resume:
            raise ConfigError(f"train.run_name: run {str(run_dir)!r} already has checkpoints; "
                              f"set train.resume=true (--resume) to continue it, or choose another name")
        if cfg.train.resume and not exists:
            raise ConfigError(f"train.resume: run {str(run_dir)!r} has no checkpoint to resume from")
    return storage, name


def finish(run_dir: Path, result, data_report: dict) -> RunResult:
    """Copy what a user looks for into the run directory: metrics.jsonl, eval.json, data_report.json."""
    checkpoint_dir = result.checkpoint.path if result.checkpoint else ""
    metrics = dict(result.metrics or {})
    run_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint_dir and Path(checkpoint_dir).is_dir():
        history = Path(checkpoint_dir) / METRICS_FILE
        if history.exists():
            (run_dir / METRICS_FILE).write_text(history.read_text())
    evals = {k: v for k, v in metrics.items() if k.startswith(METRIC_PREFIXES)}
    (run_dir / "eval.json").write_text(json.dumps(evals, indent=2))
    (run_dir / "data_report.json").write_text(json.dumps(data_report, indent=2))
    return RunResult(run_dir, checkpoint_dir, metrics, data_report)
