"""A run's directory: ``<train.storage_path>/<run name>`` — where Ray Train keeps the checkpoints, and where a
finished run leaves what a user looks for (metrics.jsonl, eval.json, data_report.json). The storage path is a
local folder or a URL (``rayvl.storage``); every file here is read and written through it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rayvl import __version__, storage
from rayvl.checkpoints import METRICS_FILE, latest_checkpoint_dir, read_meta
from rayvl.config import ConfigError, RayvlConfig, TrainConfig, from_dict
from rayvl.eval.tasks import METRIC_PREFIXES
from rayvl.plots import PLOTS_DIR, history, plot_runs

RUN_FILE = "run.json"


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


STAMPED = re.compile(r"-\d{8}-\d{6}$")  # <recipe>-<YYYYmmdd-HHMMSS>, the name a run gets by default


def run_paths(cfg: RayvlConfig) -> tuple[str, str]:
    """(storage path, run name). A run with checkpoints is continued only with train.resume; train.resume without
    a run name continues the newest run of the recipe."""
    store = storage.normalize(cfg.train.storage_path)
    name = cfg.train.run_name or (newest_run(store, cfg.recipe) if cfg.train.resume else "") \
        or f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = storage.join(store, name)
    latest = latest_checkpoint_dir(run_dir)
    if latest is not None and not cfg.train.resume:
        raise ConfigError(f"train.run_name: run {run_dir!r} already has checkpoints; "
                          f"set train.resume=true (--resume) to continue it, or choose another name")
    if cfg.train.resume and latest is None:
        raise ConfigError(f"train.resume: run {run_dir!r} has no checkpoint to resume from")
    if latest is not None:
        check_resumable(cfg, read_meta(latest), run_dir)
    return store, name


def newest_run(store: str, recipe: str) -> str:
    """The newest ``<recipe>-<timestamp>`` run under the storage path that has a checkpoint."""
    run = _newest_checkpointed(store, f"{recipe}-")
    if run is None:
        raise ConfigError(f"train.resume: no run of recipe {recipe!r} with a checkpoint under {store!r} (name one: "
                          f"--resume RUN)")
    return Path(run).name


def _newest_checkpointed(store: str, prefix: str) -> str | None:
    """The newest ``<prefix>…-<timestamp>`` run directory under ``store`` that has a checkpoint (names sort by
    time), None when none has."""
    runs = [d.rstrip("/") for d in storage.subdirs(store, prefix) if STAMPED.search(d.rstrip("/"))]
    for run in sorted(runs, key=lambda d: STAMPED.search(d).group(), reverse=True):
        if latest_checkpoint_dir(run) is not None:
            return run
    return None


def find_run(run: str, store: str | None = None) -> str:
    """What `rayvl eval`, `export` and `plot` take as RUN: a run directory or checkpoint (a path or a URL) as it is;
    a run's name under the storage path (``store``, default train.storage_path's); ``latest``, the newest
    ``<recipe>-<timestamp>`` run there with a checkpoint, of any recipe."""
    if storage.is_url(run) or "/" in run or Path(run).expanduser().exists():  # a path: as it is, found or not
        return run
    store = storage.normalize(store or TrainConfig().storage_path)
    if run == "latest":
        newest = _newest_checkpointed(store, "")
        if newest is None:
            raise ConfigError(f"RUN: latest: no run with a checkpoint under {store!r}")
        return newest
    named = storage.join(store, run)
    if storage.exists(named):
        return named
    raise ConfigError(f"RUN: {run!r} is neither a run directory nor checkpoint, nor a run's name under {store!r} "
                      f"(or latest)")


def log_dir(store: str, name: str) -> Path:
    """Where the run's controller writes metrics.jsonl and the TensorBoard events as the run goes: the run
    directory itself on a local storage path, else a local folder copied to the run directory at the end."""
    local = storage.local_path(storage.join(store, name))
    return local if local is not None else Path(os.environ.get("RAYVL_CACHE", "~/.cache/rayvl")).expanduser() / \
        "runs" / name


def mlflow_uri(cfg: RayvlConfig) -> str:
    """``train.mlflow_uri``, or a SQLite store in ``mlruns/`` beside the runs (under ~/rayvl-runs for a run on
    object storage)."""
    if cfg.train.mlflow_uri:
        return cfg.train.mlflow_uri
    root = storage.local_path(storage.normalize(cfg.train.storage_path)) or Path("~/rayvl-runs").expanduser()
    (root / "mlruns").mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"


def run_record(cfg: RayvlConfig, run_dir: str, name: str) -> dict:
    """What started the run: its config, the git commit of the code, the command line — saved as ``run.json`` in
    the run directory (each resume adds its invocation) and given to the experiment loggers."""
    path = storage.join(run_dir, RUN_FILE)
    earlier = json.loads(storage.read_text(path))["invocations"] if storage.is_file(path) else []
    record = {"name": name, "run_dir": run_dir, "config": cfg.to_dict(), "git_commit": git_commit(),
              "argv": list(sys.argv), "rayvl_version": __version__}
    invocation = {k: record[k] for k in ("git_commit", "argv")} | {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    storage.write_text(path, json.dumps({**record, "invocations": earlier + [invocation]}, indent=2))
    return record


def git_commit() -> str:
    """``RAYVL_GIT_COMMIT`` if set, else the commit of the rayvl source tree (``-dirty`` with uncommitted changes);
    '' outside a git checkout — a `ray job submit` working directory is uploaded without ``.git``, so a job can
    pass its commit in the environment (``--runtime-env-json '{"env_vars": {"RAYVL_GIT_COMMIT": ...}}'``)."""
    if os.environ.get("RAYVL_GIT_COMMIT"):
        return os.environ["RAYVL_GIT_COMMIT"]
    where = str(Path(__file__).resolve().parent)
    try:
        out = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() + ("-dirty" if dirty else "")


# The optimizer and its schedule as the run started them: DeepSpeed restores AdamW's hyperparameters and the
# LR scheduler's position from the checkpoint, and the warm-up + cosine curve is drawn over max_steps — a changed
# value would be ignored (AdamW's) or bend the curve mid-run (an LR jump), so a resume keeps them all.
SCHEDULE_KEYS = ("lr", "warmup_steps", "max_steps", "weight_decay", "betas", "eps")


def refuse_finished(cfg: RayvlConfig) -> None:
    """A user's resume (``--resume``) of a run that reached train.max_steps is refused: nothing is left to train. (A
    sweep's restored trial may resume a finished run of its own: it gets that run's result.)"""
    store, name = run_paths(cfg)
    run = storage.join(store, name)
    latest = latest_checkpoint_dir(run)
    step = read_meta(latest)["step"] if latest is not None else 0
    if step >= cfg.train.max_steps:
        raise ConfigError(f"train.resume: run {run!r} finished at step {step} (train.max_steps): nothing is left to "
                          f"train — to train it further, start a new run from its weights with --init-from {run} "
                          f"(train.init_from), on a schedule of its own")


def check_resumable(cfg: RayvlConfig, meta: dict, run: str) -> None:
    """A resume continues the run's own schedule: any schedule key changed since it started is refused, naming
    the key; so is a ``stop_at_step`` the run has already passed."""
    started = from_dict(meta["config"]).train  # typed as the config is (JSON has lists where it has tuples)
    for key in SCHEDULE_KEYS:
        now, then = getattr(cfg.train, key), getattr(started, key)
        if now != then:
            raise ConfigError(
                f"train.{key}: {now} differs from {then}, the value the run started with (checkpoint at step "
                f"{meta['step']}); a resume continues the run's optimizer and learning-rate schedule — resume with "
                f"train.{key}={then}, or start a new run from its weights with --init-from {run} "
                f"(train.init_from), on a schedule of its own")
    if 0 < cfg.train.stop_at_step <= meta["step"]:
        raise ConfigError(f"train.stop_at_step: {cfg.train.stop_at_step} is not after the checkpoint's step "
                          f"{meta['step']}")


def finish(run_dir: str, logs: Path, result, data_report: dict) -> RunResult:
    """Leave in the run directory what a user looks for: metrics.jsonl (now the history of the steps that count:
    a restart's repeated steps replaced), eval.json, data_report.json, the plots; a run on object storage gets
    its local log folder (TensorBoard events, plots) copied over."""
    run_dir = storage.normalize(run_dir)
    checkpoint_dir = storage.join(run_dir, Path(result.checkpoint.path).name) if result.checkpoint else ""
    metrics = dict(result.metrics or {})
    if checkpoint_dir and storage.is_file(storage.join(checkpoint_dir, METRICS_FILE)):
        text = storage.read_text(storage.join(checkpoint_dir, METRICS_FILE))
        logs.mkdir(parents=True, exist_ok=True)
        (logs / METRICS_FILE).write_text(text)
    if (logs / METRICS_FILE).is_file():
        plot_runs({Path(run_dir).name: history(str(logs))}, logs / PLOTS_DIR)
    if storage.local_path(run_dir) != logs:
        storage.upload(logs, run_dir)
    evals = {k: v for k, v in metrics.items() if k.startswith(METRIC_PREFIXES)}
    storage.write_text(storage.join(run_dir, "eval.json"), json.dumps(evals, indent=2))
    storage.write_text(storage.join(run_dir, "data_report.json"), json.dumps(data_report, indent=2))
    return RunResult(run_dir, checkpoint_dir, metrics, data_report)
