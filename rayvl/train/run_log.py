"""What a run leaves as it goes: every report appended to ``metrics.jsonl``, TensorBoard scalars and MLflow metrics.

Written by a Ray Train callback, which runs in the run's controller — on the driver's node, where the run's log
directory is — so the files grow during the run (tail-able) and a crash keeps what was written. The loggers are
the libraries' own (``torch.utils.tensorboard``, the MLflow client); the callback is pickled to the controller and
opens them there, on the first report.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from ray.train import UserCallback

from rayvl.checkpoints import METRICS_FILE
from rayvl.eval.tasks import METRIC_PREFIXES

TENSORBOARD_DIR = "tensorboard"
RUN_TAG = "rayvl.run_dir"  # the MLflow tag a resumed run is found by


def scalars(row: dict) -> dict[str, float]:
    """A report's plottable numbers, named by group (``train/loss``, ``eval/t2i_R@1``, ``data/samples_kept``)."""
    out = {}
    for key, value in row.items():
        if key in ("step", "first_step", "resumed_from", "time") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            group = "eval" if key.startswith(METRIC_PREFIXES) else "data" if key.startswith(
                ("samples_", "caption_", "data_", "bow_", "tonics_rows")) else "train"
            out[f"{group}/{key}"] = float(value)
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
    """Appends rank 0's report (with the wall-clock ``time``) to ``<log_dir>/metrics.jsonl`` and hands its scalars
    to the loggers of ``train.report_to``."""

    def __init__(self, log_dir: str, run: dict, report_to: list[str], mlflow_uri: str):
        self.log_dir, self.run, self.report_to, self.mlflow_uri = Path(log_dir), run, list(report_to), mlflow_uri
        self._tensorboard = self._mlflow = None

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        row = {**metrics[0], "time": time.time()}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
        values, step = scalars(row), int(row["step"])
        writers = {"tensorboard": lambda: self._write_tensorboard(values, step),
                   "mlflow": lambda: self._write_mlflow(values, step, step == self.run["config"]["train"]["max_steps"])}
        for name in self.report_to:
            try:
                writers[name]()
            except Exception as e:  # a logger's failure (a locked store, a tracking server down) never stops training
                logging.getLogger("rayvl").warning(f"train.report_to: {name} failed at step {step}: {e!r} "
                                                   f"(metrics.jsonl has the report)")

    def _write_tensorboard(self, values: dict, step: int) -> None:
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.log_dir / TENSORBOARD_DIR))
        for tag, value in values.items():
            self._tensorboard.add_scalar(tag, value, step)
        self._tensorboard.flush()

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

    def _open_mlflow(self):
        """The MLflow run of this rayvl run (one run across resumes), created with the config as params and the
        git commit as tags."""
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.mlflow_uri)
        recipe, run_dir = self.run["config"]["recipe"], self.run["run_dir"]
        found = client.get_experiment_by_name(recipe)
        experiment = found.experiment_id if found else client.create_experiment(recipe)
        runs = client.search_runs([experiment], filter_string=f"tags.`{RUN_TAG}` = '{run_dir}'", max_results=1)
        if runs:
            run_id = runs[0].info.run_id
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


def flatten(config: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": 1e-3}}`` → ``{"train.lr": 1e-3}``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
