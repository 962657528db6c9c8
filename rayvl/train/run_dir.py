"""A run's directory: ``<train.storage_path>/<run name>`` — where Ray Train keeps the checkpoints, and where a
finished run leaves what a user looks for (metrics.jsonl, eval.json, data_report.json). The storage path is a
local folder or a URL (``rayvl.storage``); every file here is read and written through it."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

from rayvl import __version__, storage
from rayvl.checkpoints import DECAY_RULE, METRICS_FILE, latest_checkpoint_dir, read_meta
from rayvl.config import ConfigError, RayvlConfig, TrainConfig, from_dict, upsampling_factors
from rayvl.data.mix import Mix
from rayvl.eval.tasks import METRIC_PREFIXES, is_constant
from rayvl.plots import DASHBOARD_FILE, PLOTS_DIR, history, plot_runs

RUN_FILE = "run.json"
EVAL_FILE = "eval.json"


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


def run_paths(cfg: RayvlConfig, sources: tuple[int, ...] = ()) -> tuple[str, str, int, tuple | None]:
    """(storage path, run name, the step of the checkpoint a resume continues — 0 for none, that checkpoint's
    engine layout (ZeRO stage, offload) — None for none). A run with checkpoints is continued only with
    train.resume; train.resume without a run name continues the newest run of the recipe."""
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
    step, layout = 0, None
    if latest is not None:
        meta = read_meta(latest)
        check_resumable(cfg, meta, run_dir, sources)
        written = meta["config"]["train"]
        step, layout = meta["step"], (written["zero_stage"], written.get("zero_offload", "none"))
    return store, name, step, layout


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
    elsewhere = started_runs().get(run)  # a run this machine started under another train.storage_path
    if elsewhere and storage.exists(elsewhere):
        return elsewhere
    raise ConfigError(f"RUN: {run!r} is neither a run directory nor checkpoint, nor a run's name under {store!r} "
                      f"(or latest), nor one this machine started under another train.storage_path")


def _started_file() -> Path:
    return Path(os.environ.get("RAYVL_CACHE", "~/.cache/rayvl")).expanduser() / "started_runs.json"


def started_runs() -> dict[str, str]:
    """{run name: run directory} of the runs started on this machine (remember_run), wherever they were stored."""
    try:
        return json.loads(_started_file().read_text())
    except (OSError, ValueError):
        return {}


def remember_run(run_dir: str) -> None:
    """Note a run's directory under its name, so that `rayvl eval / export / plot NAME` find a run kept under a
    train.storage_path other than the default (a bucket, a shared disk) — the newest run of a name wins."""
    from filelock import FileLock

    path = _started_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):  # writers one at a time; a reader sees the old list or the new (renamed in)
        runs = {**started_runs(), run_dir.rstrip("/").rsplit("/", 1)[-1]: run_dir}
        storage.write_text(str(path), json.dumps(runs, indent=1))


def log_dir(store: str, name: str) -> Path:
    """Where the run's controller writes metrics.jsonl and the TensorBoard events as the run goes: the run
    directory itself on a local storage path, else a local folder of this run directory's URL (two buckets' runs of
    one name are two folders), copied into the run directory as the run goes."""
    run_dir = storage.join(store, name)
    local = storage.local_path(run_dir)
    if local is not None:
        return local
    return Path(os.environ.get("RAYVL_CACHE", "~/.cache/rayvl")).expanduser() / "runs" / run_key(run_dir) / name


def run_key(run_dir: str) -> str:
    """A short name of a run directory's URL: its local log folder's and its W&B run's id."""
    return hashlib.sha1(run_dir.encode()).hexdigest()[:16]


def copy_logs(logs: Path, run_dir: str) -> None:
    """The log folder copied into the run directory, when that is not the log folder itself (object storage)."""
    if storage.local_path(run_dir) != logs:
        storage.upload(logs, run_dir)


MLFLOW_DIR = "mlruns"
TENSORBOARD_DIR = "tensorboard"


def mlflow_uri(cfg: RayvlConfig, logs: Path) -> str:
    """``train.mlflow_uri``, else ``MLFLOW_TRACKING_URI``, else a SQLite store beside the runs: ``mlruns/`` under a
    local storage path (one store for all its runs), or in the run's log folder on object storage — copied into
    the run directory with the rest of its records, so the history outlives the head node."""
    uri = cfg.train.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri
    root = storage.local_path(storage.normalize(cfg.train.storage_path)) or logs
    (root / MLFLOW_DIR).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / MLFLOW_DIR / 'mlflow.db'}"


RECORDS = (METRICS_FILE, TENSORBOARD_DIR, MLFLOW_DIR)  # what a run's log folder grows, kept across its starts


def continue_records(run_dir: str, logs: Path, resume: bool) -> None:
    """The local log folder of a run on object storage as the start needs it: empty for a new run (a folder left
    by an earlier run of the same URL — killed before its first checkpoint — must not be copied into this one);
    for a resume on a machine whose folder lacks the records (a new head node), the run directory's copies, so the
    next sync appends to the run's history instead of replacing it with the new start's. The run is remembered
    by name on this machine (remember_run)."""
    remember_run(run_dir)
    if storage.local_path(run_dir) == logs:
        return
    if not resume:
        shutil.rmtree(logs, ignore_errors=True)
        return
    if (logs / METRICS_FILE).is_file():
        return
    for name in RECORDS:
        remote = storage.join(run_dir, name)
        if storage.exists(remote):
            target = logs / name
            if storage.is_file(remote):
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(storage.read_bytes(remote))
            else:
                storage.download_to(remote, target)


def shard_list(paths) -> dict:
    """The training shards a run reads, as its run.json keeps them: their count and a digest of the list in its
    order (the data position counts finished shards by their place in it: rayvl.data.position)."""
    paths = list(paths)
    return {"shards": len(paths), "digest": hashlib.sha1("\n".join(paths).encode()).hexdigest()[:16]}


def check_same_shards(run_dir: str, paths, step: int) -> None:
    """A resume reads the shards the run started on, in the same order: another list — shards added to its folder,
    another brace range, one replaced — would mark other shards finished, or fail inside a worker. Refused before
    Ray starts, naming data.train; runs whose run.json does not say (an earlier rayvl's) are not compared."""
    path = storage.join(run_dir, RUN_FILE)
    if not paths or not storage.is_file(path):
        return
    then, now = json.loads(storage.read_text(path)).get("train_shards"), shard_list(paths)
    if then is not None and then != now:
        same = "the same number of" if then["shards"] == now["shards"] else f"{now['shards']} instead of its"
        raise ConfigError(
            f"data.train: this resume lists {same} {then['shards']} shards, but not the run's own list (its run.json: "
            f"digest {then['digest']}, now {now['digest']}; checkpoint at step {step}) — a resume continues the run's "
            f"data position, which counts its shards by their place: resume with the data.train the run started "
            f"with, or start a new run from its weights with --init-from {run_dir}")


def run_record(cfg: RayvlConfig, run_dir: str, name: str, train_shards=()) -> dict:
    """What started the run: its config, the training shards it reads (``shard_list``), the git commit of the code,
    the command line — saved as ``run.json`` in the run directory (each resume adds its invocation) and given to the
    experiment loggers."""
    path = storage.join(run_dir, RUN_FILE)
    earlier = json.loads(storage.read_text(path))["invocations"] if storage.is_file(path) else []
    record = {"name": name, "run_dir": run_dir, "config": cfg.to_dict(), "git_commit": git_commit(),
              "argv": list(sys.argv), "rayvl_version": __version__,
              **({"train_shards": shard_list(train_shards)} if train_shards else {})}
    invocation = {k: record[k] for k in ("git_commit", "argv")} | {"started": _stamp(), "started_unix": time.time(),
                                                                   "status": "running"}
    storage.write_text(path, json.dumps({**record, "status": "running", "invocations": earlier + [invocation]},
                                        indent=2))
    return record


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def end_record(run_dir: str, logs: Path, status: str, metrics: dict, **more) -> dict:
    """run.json at the end of an invocation: its end time, duration and ``status`` (finished, stopped — at
    train.stop_at_step — or failed, with the error), the run's status and final metrics; written to the log folder
    too, whose copy goes to the run directory with the rest."""
    path = storage.join(run_dir, RUN_FILE)
    record = json.loads(storage.read_text(path))
    now = record["invocations"][-1]
    now.update(ended=_stamp(), duration_s=round(time.time() - now.get("started_unix", time.time()), 1),
               status=status, **more)
    record.update(status=status, ended=now["ended"], final_metrics=rounded(metrics),
                  duration_s=round(sum(i.get("duration_s", 0) for i in record["invocations"]), 1))
    text = json.dumps(record, indent=2)
    storage.write_text(path, text)
    if storage.local_path(run_dir) != logs:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / RUN_FILE).write_text(text)
    return record


def constants_once(row: dict, written: dict) -> dict:
    """``row`` without the evaluation constants (chance levels, set sizes) that an earlier row of ``written`` (updated
    here) gave with the same value: metrics.jsonl holds each once, and again when it changes."""
    out = {k: v for k, v in row.items() if not (is_constant(k) and k in written and written[k] == v)}
    written.update((k, v) for k, v in row.items() if is_constant(k))
    return out


def rounded(metrics: dict, digits: int = 7) -> dict:
    """Floats to ``digits`` significant digits — what a float32 metric holds: ``91.00000262260437`` → ``91.0`` —
    but for numbers of 10⁷ and more (a Unix time keeps its decimals)."""
    return {k: float(f"{v:.{digits}g}") if isinstance(v, float) and abs(v) < 1e7 else v for k, v in metrics.items()}


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
SCHEDULE_KEYS = ("lr", "warmup_steps", "max_steps", "weight_decay", "betas", "eps", "lr_schedule", "cooldown_steps",
                 "cooldown_power", "cooldown_end_lr")


def refuse_finished(cfg: RayvlConfig, run: str, step: int) -> None:
    """A user's resume (``--resume``) of a run that reached train.max_steps (its checkpoint's ``step``) is refused:
    nothing is left to train. (A sweep's restored trial may resume a finished run of its own: it gets that run's
    result.)"""
    if cfg.train.resume and step >= cfg.train.max_steps:
        raise ConfigError(f"train.resume: run {run!r} finished at step {step} (train.max_steps): nothing is left to "
                          f"train — to train it further, start a new run from its weights with --init-from {run} "
                          f"(train.init_from), on a schedule of its own")


def check_resumable(cfg: RayvlConfig, meta: dict, run: str, sources: tuple[int, ...] = ()) -> None:
    """A resume continues the run's own data position and schedule: upsampling factors that read other slots, what
    draws a fractional factor's shards (train.seed, data.shuffle_files) and any schedule key changed since it
    started are refused, naming the key; so is a ``stop_at_step`` the run has already passed. ``sources``: the
    shards of each ``::`` source of data.train (the run's plan lists them; () = compare the factors as written)."""
    written = from_dict(meta["config"])  # typed as the config is (JSON has lists where it has tuples)
    _check_same_mix(cfg, written, meta["step"], run, sources)
    started = written.train
    for key in SCHEDULE_KEYS:
        now, then = getattr(cfg.train, key), getattr(started, key)
        if now != then and key == "max_steps" and (cfg.train.max_passes or started.max_passes):
            raise ConfigError(
                f"train.max_passes: {cfg.train.max_passes:g} is {now} steps here, the run started with "
                f"{then} (train.max_passes={started.max_passes:g}; checkpoint at step {meta['step']}) — a resume "
                f"continues the run's schedule: resume with the passes, batch and data it started with, or start a "
                f"new run from its weights with --init-from {run}")
        if now != then:
            raise ConfigError(
                f"train.{key}: {now} differs from {then}, the value the run started with (checkpoint at step "
                f"{meta['step']}); a resume continues the run's optimizer and learning-rate schedule — resume with "
                f"train.{key}={then}, or start a new run from its weights with --init-from {run} "
                f"(train.init_from), on a schedule of its own")
    m = cfg.model
    locked = [f"model.{key}" for key in ("vision_strategy", "text_strategy") if getattr(m, key) == "frozen"]
    if DECAY_RULE not in meta and m.clip.vision_width and locked:
        raise ConfigError(
            f"{locked[0]}: frozen: a whole CLIP's projection is now locked with its tower and counted as its last "
            f"group (open_clip's --lock-image / --lock-text), so this run's optimizer no longer holds what its "
            f"checkpoint (step {meta['step']}, written by an earlier rayvl, which trained the projection) holds — "
            f"resume it with the rayvl that started it, or start a new run from its weights with --init-from {run}")
    if 0 < cfg.train.stop_at_step <= meta["step"]:
        raise ConfigError(f"train.stop_at_step: {cfg.train.stop_at_step} is not after the checkpoint's step "
                          f"{meta['step']}")


def _check_same_mix(cfg: RayvlConfig, written: RayvlConfig, step: int, run: str, sources: tuple[int, ...]) -> None:
    """The data position counts the slots of the mix's passes (rayvl.data.mix): factors that give other slots are
    another position, and where a source's pass is not whole cycles the shuffle (and with it the seed) draws which
    shards a slot reads."""
    def factors(c: RayvlConfig) -> tuple[float, ...]:
        f = upsampling_factors(c.data)
        return () if all(x == 1 for x in f) else f

    now, then = factors(cfg), factors(written)
    if sources and len(now or sources) == len(then or sources) == len(sources):
        started = Mix.of(sources, then)
        same, drawn = Mix.of(sources, now).slots == started.slots, not started.whole_cycles
    else:  # the shard counts unknown: as written
        same, drawn = now == then, any(f != int(f) for f in then)
    changed = [] if same else [("data.upsampling_factors", cfg.data.upsampling_factors,
                                written.data.upsampling_factors)]
    if drawn:  # in spec order (no shuffle) the seed draws nothing
        shuffled = written.data.shuffle_files
        changed += [(k, a, b) for k, a, b in (("data.shuffle_files", cfg.data.shuffle_files, shuffled),
                                              ("train.seed", cfg.train.seed, written.train.seed))
                    if a != b and (k == "data.shuffle_files" or shuffled)]
    if changed:
        key, a, b = changed[0]
        raise ConfigError(f"{key}: {a!r} differs from {b!r}, the value the run started with (checkpoint at step "
                          f"{step}); a resume continues its data position, whose passes are its mix's "
                          f"(data.upsampling_factors={written.data.upsampling_factors!r}) — resume with {key}={b!r}, "
                          f"or start a new run from its weights with --init-from {run}")


def finish(run_dir: str, logs: Path, result, data_report: dict, stopped: bool = False,
           log_artifacts: Callable[[list[Path]], None] = lambda files: None) -> RunResult:
    """Leave in the run directory what a user looks for: metrics.jsonl (now the history of the steps that count:
    a restart's repeated steps replaced), eval.json (with the step and checkpoint it scored), data_report.json,
    the dashboard, run.json's end; a run on object storage gets its log folder (TensorBoard events, MLflow's store,
    plots) copied over once more. ``log_artifacts`` hands the dashboard, eval.json and run.json to the experiment
    loggers before that copy (MLflow's store is one of the files copied)."""
    run_dir = storage.normalize(run_dir)
    checkpoint_dir = storage.join(run_dir, Path(result.checkpoint.path).name) if result.checkpoint else ""
    metrics = dict(result.metrics or {})
    logs.mkdir(parents=True, exist_ok=True)
    if checkpoint_dir and storage.is_file(storage.join(checkpoint_dir, METRICS_FILE)):
        _keep_history(storage.read_text(storage.join(checkpoint_dir, METRICS_FILE)), logs / METRICS_FILE)
    if (logs / METRICS_FILE).is_file():
        plot_runs({Path(run_dir).name: history(str(logs))}, logs / PLOTS_DIR)
    evals = rounded({k: v for k, v in metrics.items() if k.startswith(METRIC_PREFIXES)})
    scored = {"step": metrics.get("step"), "checkpoint": checkpoint_dir}
    if not evals:  # the file says so rather than being empty
        from rayvl.eval.tables import NO_EVALUATION

        scored["evaluation"] = NO_EVALUATION
    (logs / EVAL_FILE).write_text(json.dumps({**scored, **evals}, indent=2))
    (logs / "data_report.json").write_text(json.dumps(data_report, indent=2))
    end_record(run_dir, logs, "stopped" if stopped else "finished", metrics)
    log_artifacts([logs / PLOTS_DIR / DASHBOARD_FILE, logs / EVAL_FILE, logs / RUN_FILE])
    copy_logs(logs, run_dir)
    return RunResult(run_dir, checkpoint_dir, metrics, data_report)


def _keep_history(checkpointed: str, live: Path) -> None:
    """metrics.jsonl as the checkpoint's history of the steps that count, each line with the time (and checkpoint
    mark) the live file gave its step (the workers' rows carry neither)."""
    when = {}
    if live.is_file():
        for line in live.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "time" in row:
                when[row["step"]] = {k: row[k] for k in ("time", "elapsed_s", "checkpoint") if k in row}
    rows, written = [json.loads(x) for x in checkpointed.splitlines() if x.strip()], {}
    live.write_text("".join(json.dumps(rounded(constants_once({**r, **when.get(r["step"], {})}, written))) + "\n"
                            for r in rows))


def failed(run_dir: str, logs: Path, error: BaseException) -> None:
    """run.json of an invocation that raised (a KeyboardInterrupt included), and the log folder copied once more:
    best effort, the error itself is what the caller reports."""
    try:
        end_record(run_dir, logs, "failed", {}, error=f"{type(error).__name__}: {error}"[:2000])
        copy_logs(logs, run_dir)  # end_record has made the folder
    except Exception as e:  # noqa: BLE001
        logging.getLogger("rayvl").warning(f"recording the failed run in {run_dir} failed: {e!r}")
