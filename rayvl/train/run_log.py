"""What a run leaves as it goes: every report appended to ``metrics.jsonl``, TensorBoard scalars and MLflow metrics,
the dashboard redrawn and all of it copied to the run directory as the run goes.

Written by a Ray Train callback, which runs in the run's controller — on the driver's node, where the run's log
directory is — so the files grow during the run (tail-able) and a crash keeps what was written. On object storage
the log directory is a local folder, copied into the run directory at a report once ``train.sync_every_s`` has passed
since the last copy (and at the end): a user follows the run from the bucket, and losing the head loses at most
that much. The loggers are the libraries' own (``torch.utils.tensorboard``, the MLflow client); the callback is
pickled to the controller and opens them there, on the first report.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from ray.train import UserCallback

from rayvl import plugins
from rayvl.checkpoints import METRICS_FILE
from rayvl.eval.tasks import METRIC_PREFIXES, is_constant
from rayvl.plots import PLOTS_DIR, history, plot_runs
from rayvl.train.run_dir import TENSORBOARD_DIR, constants_once, copy_logs, rounded, run_key

RUN_TAG = "rayvl.run_dir"  # the MLflow tag a resumed run is found by


# what TensorBoard and MLflow leave out: the report's bookkeeping (and evaluation constants, eval.tasks.CONSTANTS)
NOT_PLOTTED = ("step", "first_step", "resumed_from", "time", "elapsed_s", "checkpoint")


def scalars(row: dict) -> dict[str, float]:
    """A report's plottable numbers, named by group (``train/loss``, ``eval/t2i_R@1``, ``data/samples_kept``);
    not the bookkeeping, nor an evaluation's constants (its chance levels and set sizes: eval.json has them)."""
    out = {}
    for key, value in row.items():
        if key in NOT_PLOTTED or isinstance(value, bool) or is_constant(key):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            group = "eval" if key.startswith(METRIC_PREFIXES) else "data" if key.startswith(
                ("samples_", "caption_", "data_", *plugins.data_metric_prefixes())) else "train"
            out[f"{group}/{key.removeprefix('data_')}"] = float(value)  # data/rows_trained, not data/data_rows_trained
    return out


def _existing_cwd(fallback: Path) -> None:
    """Under `ray job submit` the controller's working directory (the job's unpacked --working-dir) can be gone
    by the time it reports; importing mlflow then fails (pkgutil.extend_path resolves sys.path's '' against the
    cwd: FileNotFoundError, seen in CI — no MLflow run was written). The run directory is a cwd that exists."""
    try:
        os.getcwd()
    except FileNotFoundError:
        os.chdir(fallback)


def mlflow_name(tag: str) -> str:
    """MLflow allows letters, digits and ``_ - . / : space`` in metric names: ``eval/t2i_R@1`` → ``eval/t2i_R_at_1``."""
    return tag.replace("@", "_at_")


class RunLog(UserCallback):
    """Appends rank 0's report (with the wall-clock ``time``) to ``<log_dir>/metrics.jsonl``, hands its scalars
    to the loggers of ``train.report_to``, and every ``sync_every_s`` redraws the dashboard and copies the log
    directory into ``run_dir`` (when that is not the log directory itself)."""

    def __init__(self, log_dir: str, run: dict, report_to: list[str], mlflow_uri: str, sync_every_s: float = 0.0):
        self.log_dir, self.run, self.report_to, self.mlflow_uri = Path(log_dir), run, list(report_to), mlflow_uri
        self.sync_every_s, self.started = sync_every_s, time.time()
        # W&B is configured by environment variables; the driver's travel to the controller with this callback
        self.wandb_env = {k: v for k, v in os.environ.items() if k.startswith("WANDB_")}
        self._tensorboard = self._mlflow = self._wandb = None
        self._synced = -math.inf  # the first report is copied at once: the run shows up in its directory early
        self._constants: dict = {}  # the evaluation constants metrics.jsonl holds already

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        now = time.time()
        row = {**metrics[0], "time": round(now, 1), "elapsed_s": round(now - self.started, 1),
               **({"checkpoint": True} if checkpoint is not None else {})}  # the dashboard marks it
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(rounded(constants_once(row, self._constants))) + "\n")
        values, step = scalars(row), int(row["step"])
        writers = {"tensorboard": lambda: self._write_tensorboard(values, step),
                   "mlflow": lambda: self._write_mlflow(values, step, step == self.run["config"]["train"]["max_steps"]),
                   "wandb": lambda: self._write_wandb(values, step)}
        for name in self.report_to:
            _quietly(writers[name], f"train.report_to: {name} failed at step {step}")
        if time.monotonic() - self._synced >= self.sync_every_s:
            _quietly(self.sync, f"copying the run's records to {self.run['run_dir']} failed at step {step}")
            self._synced = time.monotonic()

    def sync(self) -> None:
        """Redraw the dashboard from metrics.jsonl and copy the log directory into the run directory."""
        plot_runs({self.run["name"]: history(str(self.log_dir))}, self.log_dir / PLOTS_DIR)
        copy_logs(self.log_dir, self.run["run_dir"])

    def _write_tensorboard(self, values: dict, step: int) -> None:
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.log_dir / TENSORBOARD_DIR))
            self._write_hparams()
        for tag, value in values.items():
            self._tensorboard.add_scalar(tag, value, step)
        self._tensorboard.flush()

    def _write_wandb(self, values: dict, step: int) -> None:
        """Scalars to the run's W&B run (one across resumes: its id is made from the run directory), closed at the
        invocation's last step so that its files are complete."""
        if self._wandb is None:
            os.environ.update(self.wandb_env)
            import wandb

            recipe = self.run["config"]["recipe"]
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT") or recipe, name=self.run["name"],
                                     id=run_key(self.run["run_dir"]), resume="allow", dir=str(self.log_dir),
                                     config=self.run["config"], tags=[recipe])
        self._wandb.log(values, step=step)
        train = self.run["config"]["train"]
        if step >= (train["stop_at_step"] or train["max_steps"]):
            self._wandb, run = None, self._wandb
            run.finish()

    def after_exception(self, run_context, worker_exceptions) -> None:
        """Workers failed: the W&B run is closed as failed (a restart of the worker group resumes it)."""
        if self._wandb is not None:
            self._wandb, run = None, self._wandb
            _quietly(lambda: run.finish(exit_code=1), "train.report_to: wandb")

    def _write_hparams(self) -> None:
        """The run's config as TensorBoard's hyperparameters (its HParams tab compares runs by them), in the same
        event file as the scalars."""
        from torch.utils.tensorboard.summary import hparams

        config = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                  for k, v in flatten(self.run["config"]).items() if v is not None}
        for summary in hparams(config, {}):
            self._tensorboard.file_writer.add_summary(summary)

    def _write_mlflow(self, values: dict, step: int, finished: bool) -> None:
        _existing_cwd(self.log_dir)
        from mlflow.entities import Metric

        client, run_id = self._mlflow or self._open_mlflow()
        stamp = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), v, stamp, step) for k, v in values.items()]
        for i in range(0, len(metrics), 500):  # the tracking API takes ≤ 1000 metrics a batch
            client.log_batch(run_id, metrics=metrics[i:i + 500])
        if finished:
            client.set_terminated(run_id, "FINISHED")

    def _open_mlflow(self, reopen: bool = True):
        """The MLflow run of this rayvl run (one run across resumes), created with the config as params and the
        git commit as tags."""
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.mlflow_uri)
        recipe, run_dir = self.run["config"]["recipe"], self.run["run_dir"]
        found = client.get_experiment_by_name(recipe)
        experiment = found.experiment_id if found else client.create_experiment(
            recipe, artifact_location=artifact_root(self.mlflow_uri, recipe))
        runs = client.search_runs([experiment], filter_string=f"tags.`{RUN_TAG}` = '{run_dir}'", max_results=1)
        if runs:
            run_id = runs[0].info.run_id
            if reopen:  # a resume reports to it again (not the end's artifacts: the run keeps its status)
                client.update_run(run_id, status="RUNNING")
        else:
            tags = {RUN_TAG: run_dir, "mlflow.source.git.commit": self.run["git_commit"] or "unknown"}
            run_id = client.create_run(experiment, run_name=self.run["name"], tags=tags).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flatten(self.run["config"]).items()]
            for i in range(0, len(params), 100):  # ≤ 100 params a batch
                client.log_batch(run_id, params=params[i:i + 100])
            client.log_batch(run_id, tags=[RunTag("rayvl.command", " ".join(self.run["argv"])[:5000])])
        self._mlflow = client, run_id
        return self._mlflow

    def log_artifacts(self, files: list[Path]) -> None:
        """The run's end in MLflow: the dashboard, eval.json and run.json (the config) as artifacts of its run."""
        if "mlflow" not in self.report_to:
            return

        def log() -> None:
            client, run_id = self._mlflow or self._open_mlflow(reopen=False)
            for f in files:
                if f.is_file():
                    client.log_artifact(run_id, str(f))
        _quietly(log, "train.report_to: mlflow artifacts")


def artifact_root(uri: str, recipe: str) -> str | None:
    """Where a SQLite store's experiment keeps its artifacts: beside the database (MLflow's default is ./mlruns
    under whatever the working directory happens to be); a tracking server decides for itself (None)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).parent / "artifacts" / recipe).as_uri()


def _quietly(fn, what: str) -> None:
    """A logger's or a copy's failure (a locked store, a tracking server or a bucket down) never stops training:
    metrics.jsonl has the report, and the next sync copies it."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        logging.getLogger("rayvl").warning(f"{what}: {e!r} (metrics.jsonl has the report)")


def flatten(config: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": 1e-3}}`` → ``{"train.lr": 1e-3}``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
