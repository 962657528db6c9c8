"""PNG plots of a run's ``metrics.jsonl`` (matplotlib): loss, learning rate, samples/s and every evaluation metric
over steps — one run (``rayvl plot RUN``, also while it runs), or several runs on one figure per metric (the
comparison jobs, ``rayvl plot RUN RUN ... --out DIR``)."""
from __future__ import annotations

import json
from pathlib import Path

from rayvl import storage
from rayvl.checkpoints import METRICS_FILE
from rayvl.eval.tasks import METRIC_PREFIXES

PLOTS_DIR = "plots"
TRAINING = {"loss": "training loss", "lr": "learning rate", "samples_per_s": "samples/s (all workers)"}
SKIPPED = ("_chance_", "zeroshot_classes", "zeroshot_templates", "_images", "_captions", "_pairs")


def history(run: str) -> list[dict]:
    """The rows of a run directory's ``metrics.jsonl`` (local or a URL), one per step: where a restart repeated
    steps after its checkpoint, the later row."""
    path = storage.join(storage.normalize(run), METRICS_FILE)
    if not storage.is_file(path):
        raise FileNotFoundError(f"{run}: no {METRICS_FILE} (not a rayvl run directory, or no report yet)")
    rows = {}
    for line in storage.read_text(path).splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def plotted_metrics(rows: list[dict]) -> list[str]:
    """The training curves, then every evaluation metric the run reported (not chance levels or set sizes)."""
    keys = {k for r in rows for k in r}
    evals = sorted(k for k in keys if k.startswith(METRIC_PREFIXES) and not any(s in k for s in SKIPPED))
    return [k for k in TRAINING if k in keys] + evals


def plot_runs(runs: dict[str, list[dict]], out_dir: str | Path) -> list[Path]:
    """One PNG per metric in ``out_dir``, each run a line (a marker per point: evaluations are sparse)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    metrics = list(dict.fromkeys(m for rows in runs.values() for m in plotted_metrics(rows)))
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, rows in runs.items():
            points = [(r["step"], r[metric]) for r in rows if r.get(metric) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(TRAINING.get(metric, metric))
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
        if metric == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        fig.tight_layout()
        path = out / f"{metric.replace('@', '_at_').replace('/', '_')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def plot_run(run: str, out_dir: str | Path | None = None) -> list[Path]:
    """A run's PNGs, in ``<run>/plots/`` (or ``out_dir``; needed for a run on object storage)."""
    if out_dir is None:
        local = storage.local_path(run)
        if local is None:
            raise ValueError(f"{run}: a run on object storage needs --out (a local folder for the PNGs)")
        out_dir = local / PLOTS_DIR
    return plot_runs({Path(str(run).rstrip("/")).name: history(run)}, out_dir)
