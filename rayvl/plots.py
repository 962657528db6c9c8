"""One PNG dashboard of a run's ``metrics.jsonl`` (matplotlib): training loss, learning rate, samples/s, data
wait, logit scale and gradient norm over steps, each evaluation metric that has more than one point as a curve, and the metrics with a single
point (most evaluations of a short run) as a table in the same figure. One run (``rayvl plot RUN``, also while it
runs; every finished run gets ``<run>/plots/run.png``), or several runs with a line per run (``rayvl plot RUN RUN
... --out DIR``). TensorBoard and MLflow keep every scalar; this is the page a user opens first."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from rayvl import storage
from rayvl.checkpoints import METRICS_FILE
from rayvl.eval.tasks import METRIC_PREFIXES, is_constant

PLOTS_DIR = "plots"
DASHBOARD_FILE = "run.png"
TRAINING = {"loss": "training loss", "lr": "learning rate", "samples_per_s": "samples/s (all workers)",
            "data_wait_share": "data wait (% of step time)", "logit_scale": "logit scale (1/τ)",
            "logit_bias": "logit bias (SigLIP's b)", "grad_norm": "gradient norm"}
SCALE = {"data_wait_share": 100.0}  # a share in the file, a percentage on the axis
COLUMNS = 3


@dataclass
class Dashboard:
    """What a dashboard drew, so that a caller (or a test) can tell without reading pixels: the curve panels'
    titles in drawing order, the table's single-point metrics as {metric: {run: (step, value)}} in the order of its
    rows (by task), and the steps marked on every panel: {"checkpoint": steps, "evaluation": steps}."""

    path: Path
    runs: list[str]
    panels: list[str] = field(default_factory=list)
    table: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    marks: dict[str, list[int]] = field(default_factory=dict)


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
    evals = sorted((k for k in keys if k.startswith(METRIC_PREFIXES) and not is_constant(k)),
                   key=lambda k: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", k)])  # R@5 before R@10
    return [k for k in TRAINING if k in keys] + evals


# evaluation metrics as a person reads them, by task: (group, pattern, label); the groups order the table
LABELS = (
    ("retrieval", r"t2i_R@(\d+)", "text→image R@{0} %"), ("retrieval", r"i2t_R@(\d+)", "image→text R@{0} %"),
    ("retrieval", r"t2i_same_object_R@(\d+)", "same-object text→image R@{0} %"),
    ("retrieval", r"i2t_same_object_R@(\d+)", "same-object image→text R@{0} %"),
    ("zero-shot", r"zeroshot_top(\d+)", "zero-shot top-{0} %"),
    ("zero-shot", r"zeroshot_mean_per_class_recall", "zero-shot mean per-class recall %"),
    ("zero-shot", r"single_template_zeroshot_top(\d+)", "zero-shot top-{0}, one prompt %"),
    ("zero-shot", r"single_template_zeroshot_mean_per_class_recall", "zero-shot mean per-class recall, one prompt %"),
    ("paraphrase", r"paraphrase_(AO|JS)@(\d+)", "paraphrase {0}@{1} %"),
    ("paraphrase", r"qe_paraphrase_(AO|JS)@(\d+)", "paraphrase {0}@{1}, query expansion %"),
    ("STS", r"sts_(pearson|spearman)", "STS {0} × 100"),
    ("linear probe", r"linear_probe_top1", "linear probe top-1 %"),
)
GROUPS = ("retrieval", "zero-shot", "paraphrase", "STS", "linear probe", "other")


def labelled(metric: str) -> tuple[str, str]:
    """(group, label) of a metric; a ``heldout_`` prefix (a comparison's evaluation after training) is said."""
    held = metric.startswith("heldout_")
    key = metric.removeprefix("heldout_")
    for group, pattern, label in LABELS:
        found = re.fullmatch(pattern, key)
        if found:
            return group, ("held-out " if held else "") + label.format(*found.groups())
    return "other", metric


def title(metric: str) -> str:
    return TRAINING.get(metric) or labelled(metric)[1]


def points(rows: list[dict], metric: str) -> list[tuple[int, float]]:
    """(step, value) of every row that reported ``metric`` as a number."""
    return [(r["step"], float(r[metric]) * SCALE.get(metric, 1.0)) for r in rows
            if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)]


def layout(runs: dict[str, list[dict]]) -> tuple[list[str], dict[str, dict[str, tuple[int, float]]]]:
    """(metrics drawn as curves, the table): a metric is a curve where some run has more than one point of it —
    a single evaluation drawn as a lone dot on its own axes says less than a number in a table."""
    metrics = list(dict.fromkeys(m for rows in runs.values() for m in plotted_metrics(rows)))
    curves, table = [], {}
    for metric in metrics:
        each = {name: points(rows, metric) for name, rows in runs.items()}
        if any(len(p) > 1 for p in each.values()):
            curves.append(metric)
        elif any(each.values()):
            table[metric] = {name: p[0] for name, p in each.items() if p}
    order = sorted(table, key=lambda m: (GROUPS.index(labelled(m)[0]), list(table).index(m)))
    return curves, {m: table[m] for m in order}


def marks(runs: dict[str, list[dict]]) -> dict[str, list[int]]:
    """Steps where something paused training — a checkpoint written (the report's ``checkpoint``), an evaluation
    run — which explains a dip in samples/s; of a single run only (several runs' marks would be noise)."""
    if len(runs) != 1:
        return {}
    (rows,) = runs.values()
    return {"checkpoint": [r["step"] for r in rows if r.get("checkpoint")],
            "evaluation": [r["step"] for r in rows if any(k.startswith(METRIC_PREFIXES) for k in r)]}


def plot_runs(runs: dict[str, list[dict]], out_dir: str | Path) -> Dashboard:
    """``<out_dir>/run.png``: a panel per curve (a line per run, a marker per point where points are few) and the
    table of single-point metrics below them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves, table = layout(runs)
    dashboard = Dashboard(out / DASHBOARD_FILE, list(runs), [title(m) for m in curves], table, marks(runs))
    columns = max(1, min(COLUMNS, len(curves)))
    rows = math.ceil(len(curves) / columns)
    table_height = 0.4 + 0.28 * (len(table) + 1) if table or not curves else 0.0
    fig = plt.figure(figsize=(5 * columns if curves else 8, 3.3 * rows + table_height), layout="constrained")
    grid = fig.add_gridspec(rows + bool(table_height), columns,
                            height_ratios=[3.3] * rows + ([table_height] if table_height else []))
    for i, metric in enumerate(curves):
        _curve(fig.add_subplot(grid[i // columns, i % columns]), metric, runs, dashboard.marks)
    if table_height:
        _table(fig.add_subplot(grid[rows, :]), table, list(runs))
    fig.suptitle((", ".join(runs) if len(runs) <= 3 else f"{len(runs)} runs") + (
        "  (dotted: checkpoints, dashed: evaluations)" if any(dashboard.marks.values()) else ""), fontsize=10)
    fig.savefig(dashboard.path, dpi=90)
    plt.close(fig)
    return dashboard


def _curve(ax, metric: str, runs: dict[str, list[dict]], marked: dict[str, list[int]]) -> None:
    for kind, style in (("checkpoint", ":"), ("evaluation", "--")):
        for step in marked.get(kind, ()):
            ax.axvline(step, color="0.6", linestyle=style, linewidth=0.8)
    for name, rows in runs.items():
        found = points(rows, metric)
        if found:
            ax.plot(*zip(*found), marker="o" if len(found) < 30 else None, markersize=3, label=name)
    ax.set_title(title(metric), fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=7)
    if metric == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))


def _table(ax, table: dict[str, dict[str, tuple[int, float]]], names: list[str]) -> None:
    ax.axis("off")
    if not table:
        ax.text(0.5, 0.5, "no metrics reported yet", ha="center", va="center")
        return
    cells = [[labelled(m)[0], title(m), *(f"{v[1]:.4g} (step {v[0]})" if v else "-"
                                          for v in (row.get(n) for n in names))] for m, row in table.items()]
    drawn = ax.table(cellText=cells, colLabels=["task", "reported once", *names], loc="upper center",
                     cellLoc="left")
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(8)


def plot_run(run: str, out_dir: str | Path | None = None) -> Dashboard:
    """A run's dashboard, ``<run>/plots/run.png`` (or in ``out_dir``; needed for a run on object storage)."""
    if out_dir is None:
        local = storage.local_path(run)
        if local is None:
            raise ValueError(f"{run}: a run on object storage needs --out (a local folder for the dashboard)")
        out_dir = local / PLOTS_DIR
    return plot_runs({Path(str(run).rstrip("/")).name: history(run)}, out_dir)
