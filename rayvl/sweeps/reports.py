"""What a sweep leaves: one row per trial (its values, final and best metric, steps, status, error) best first, as a
printed table and trials.csv, one PNG of the metric against each swept key, learning_curves.png and
best_config.yaml — the best trial's full config as a recipe. Works on a finished or an interrupted sweep (Tune's
experiment state on disk), local or at a URL."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from rayvl import storage
from rayvl.sweeps.directory import final_metrics, read_settings, trial_run
from rayvl.sweeps.spaces import trial_config


def trial_rows(sweep_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(the sweep's settings, one row per trial: its values, final and best metric, steps, status, error, its
    learning curve), best first."""
    from ray.tune import ExperimentAnalysis

    sweep_dir = storage.normalize(sweep_dir)
    settings = read_settings(sweep_dir)
    metric, sign = settings["metric"], 1 if settings["mode"] == "max" else -1
    fs, inner = storage.filesystem(sweep_dir)
    analysis = ExperimentAnalysis(inner, storage_filesystem=fs)
    frames = analysis.trial_dataframes
    rows = []
    for t in analysis.trials:
        frame = frames.get(t.trial_id)
        series = frame[metric].dropna() if frame is not None and metric in frame else None
        last = t.last_result or {}
        steps = int(last.get("step", 0) or 0)
        status = t.status
        budget = min(settings["max_steps"], settings.get("max_t") or settings["max_steps"])  # ASHA's last rung
        if status == "TERMINATED" and steps < budget and not final_metrics(trial_run(sweep_dir, t.trial_id)):
            # a scheduler's decision, not a failure; a trial that wrote its final record ran to its own end, whatever
            # its steps (a space over the batch size with a budget in passes gives each trial its own). ASHA stops
            # a trial at its last rung too, before the record: the sweep's budget tells that one
            status = "STOPPED EARLY"
        rows.append({"trial": t.trial_id, **({"variant": t.config.get("variant")} if settings.get("variants") else {}),
                     **{k: t.config["set"].get(k) for k in settings["keys"]},
                     "final": last.get(metric), "best": None if series is None or series.empty
                     else float(series.max() if sign > 0 else series.min()), "steps": steps, "status": status,
                     "error": _error_line(sweep_dir, t), "curve": [] if series is None else
                     list(zip(frame.loc[series.index, "step"].tolist(), series.tolist()))})
    rows.sort(key=lambda r: (r["final"] is None, -sign * (r["final"] or 0.0)))
    return settings, rows


def columns(settings: dict) -> list[str]:
    """What tells a sweep's trials apart: the variant and the searched keys."""
    return (["variant"] if settings.get("variants") else []) + settings["keys"]


def _error_line(sweep_dir: str, t) -> str:
    """The last line of a failed trial's traceback, from the sweep's storage: ``t.error_file`` names the staging
    folder of the Ray session the trial failed in, gone once that session ended (a trial that failed before an
    interruption, read by the resumed sweep)."""
    if t.status != "ERROR":
        return ""
    path = storage.join(sweep_dir, Path(t.path).name, "error.txt")
    text = storage.read_text(path) if storage.is_file(path) else ""
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def format_trials(settings: dict, rows: list[dict]) -> str:
    keys, metric = columns(settings), settings["metric"]
    head = ["#", "trial", *keys, f"final {metric}", f"best {metric}", "steps", "status"]
    shown = [[str(i + 1), r["trial"], *(str(r[k]) for k in keys), _num(r["final"]), _num(r["best"]),
              str(r["steps"]), r["status"] + (f": {r['error']}" if r["error"] else "")] for i, r in enumerate(rows)]
    widths = [max(len(x) for x in col) for col in zip(head, *shown)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *shown])


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def write_report(sweep_dir: str | os.PathLike) -> tuple[str, list[str]]:
    """trials.csv, the plots and best_config.yaml in the sweep directory (local or a URL); returns the printed
    table and the files' names."""
    import tempfile

    sweep_dir = storage.normalize(sweep_dir)
    settings, rows = trial_rows(sweep_dir)
    local = storage.local_path(sweep_dir)
    with tempfile.TemporaryDirectory(prefix="rayvl-sweep-report-") as staging:
        out = local or Path(staging)  # object storage: written here, then uploaded
        _report_files(out, settings, rows)
        names = sorted(p.name for p in out.iterdir() if p.suffix in (".csv", ".png", ".yaml"))
        if local is None:
            for n in names:
                storage.write_bytes(storage.join(sweep_dir, n), (out / n).read_bytes())
    return format_trials(settings, rows), names


def _report_files(sweep_dir: Path, settings: dict, rows: list[dict]) -> None:
    import csv

    fields = ["trial", *columns(settings), "final", "best", "steps", "status", "error"]
    with open(sweep_dir / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    _plots(sweep_dir, settings, rows)
    best = next((r for r in rows if r["final"] is not None), None)
    if best is not None:
        _best_recipe(sweep_dir / "best_config.yaml", settings, best)


def _plots(sweep_dir: Path, settings: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    metric = settings["metric"]
    scored = [r for r in rows if r["final"] is not None]
    for key in columns(settings):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        labels = sorted({str(r[key]) for r in scored}, key=lambda v: (_as_float(v) is None, _as_float(v) or 0, v))
        ax.scatter([labels.index(str(r[key])) for r in scored], [r["final"] for r in scored])
        ax.set_xticks(range(len(labels)), labels)
        ax.set(xlabel=key, ylabel=f"final {metric}", title=f"{metric} against {key}")
        fig.tight_layout()
        fig.savefig(sweep_dir / f"{metric.replace('@', 'at')}_vs_{key}.png", dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["curve"]:
            steps, values = zip(*r["curve"])
            ax.plot(steps, values, marker="o", label=", ".join(f"{k.split('.')[-1]}={r[k]}" for k in columns(settings)))
    ax.set(xlabel="step", ylabel=metric, title="learning curves (each trial)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sweep_dir / "learning_curves.png", dpi=120)
    plt.close(fig)


def _as_float(v: str):
    try:
        return float(v)
    except ValueError:
        return None


def _best_recipe(path: Path, settings: dict, best: dict) -> None:
    """The best trial's full config as a recipe YAML (`jobs/laion_adapt.py --config` takes it)."""
    cfg = trial_config(settings["recipe"], settings["fixed"], {k: best[k] for k in settings["keys"]},
                       settings.get("variants", {}).get(best.get("variant"), []))
    values = _plain(cfg.to_dict())
    values["train"].update(run_name="", resume=False)
    header = (f"# best trial {best['trial']} of the sweep {settings['space_file']}: final {settings['metric']} "
              f"{best['final']:.4g}\n")
    path.write_text(header + yaml.safe_dump(values, sort_keys=False))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
