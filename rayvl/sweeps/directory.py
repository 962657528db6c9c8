"""What a sweep directory holds, beside Tune's own state: the sweep's settings (so `rayvl tune --report DIR` needs
nothing else) and, in each trial's run directory ``runs/trial-<id>``, the trial's final numbers. A local path or a
URL, as train.storage_path."""
from __future__ import annotations

import json
from pathlib import Path

from rayvl import storage
from rayvl.config import RayvlConfig

SWEEP_FILE = "rayvl_sweep.json"
FINAL_METRICS = "final_metrics.json"  # in each trial's run directory: what a comparison summarises


def sweep_name(sweep, name: str = "") -> str:
    """A sweep's name: ``name`` (--name), else the space's own ``name``, else its file's name."""
    return name or sweep.name or Path(sweep.path).stem


def sweep_directory(base: RayvlConfig, name: str) -> str:
    """Where a sweep named ``name`` keeps its state and runs: under tune.storage_path."""
    return storage.join(storage.normalize(base.tune.storage_path), name)


def trial_run(sweep_dir: str, trial_id: str) -> str:
    """A trial's Train run, named after the trial id so that a restored sweep finds its checkpoints."""
    return storage.join(storage.normalize(sweep_dir), "runs", f"trial-{trial_id}")


def begun(sweep_dir: str) -> bool:
    """Whether a sweep started here: Tune saved its state (its tuner.pkl, written as the Tuner is built). Settings
    without it are a first start that stopped before (a check after Ray started): nothing to resume."""
    from ray.tune import Tuner  # a look at the storage: no Ray starts

    fs, inner = storage.filesystem(storage.normalize(sweep_dir))
    return Tuner.can_restore(inner, storage_filesystem=fs)


def has_settings(sweep_dir: str) -> bool:
    return storage.is_file(storage.join(storage.normalize(sweep_dir), SWEEP_FILE))


def save_settings(sweep_dir: str, settings: dict) -> None:
    storage.write_text(storage.join(sweep_dir, SWEEP_FILE), json.dumps(settings, indent=2))


def read_settings(sweep_dir: str) -> dict:
    return json.loads(storage.read_text(storage.join(storage.normalize(sweep_dir), SWEEP_FILE)))


def final_metrics(run: str) -> dict:
    """A trial's final record (variant, values, metrics, checkpoint); {} for a trial that did not finish."""
    path = storage.join(run, FINAL_METRICS)
    return json.loads(storage.read_text(path)) if storage.is_file(path) else {}
