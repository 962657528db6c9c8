"""A comparison's report: per variant, the mean ± sample standard deviation (n − 1) over the seeds whose trial
finished of every metric of its rows (a variant with a failed trial shows its n), printed as a table and written as
comparison.csv (one row per trial), comparison.json (per variant and metric: mean, std, n, the values),
comparison.png (a bar per variant at its mean with ± std and a dot per seed) and curves_<metric>.png (each
variant's mean over its seeds against the step, ± std shaded)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable

from rayvl import storage
from rayvl.sweeps.directory import final_metrics, read_settings, trial_run
from rayvl.sweeps.reports import trial_rows

# beside the sweep's settings: the comparison's title, table rows, variant order and earlier stages, so that
# `rayvl tune --report DIR` and `<job> --report DIR` print what the job printed
COMPARISON_FILE = "rayvl_comparison.json"

Row = tuple[str, str, str]  # (label, metric key, format)


def save_comparison(sweep_dir: str, title: str, rows: list[Row], order: list[str], parts: list[str] = ()) -> None:
    """``parts``: the directories of the earlier stages of a comparison run in stages, whose trials its report
    includes."""
    storage.write_text(storage.join(sweep_dir, COMPARISON_FILE), json.dumps(
        {"title": title, "rows": [list(r) for r in rows], "order": list(order), "parts": list(parts)}, indent=2))


def saved_comparison(sweep_dir: str) -> dict:
    """What save_comparison wrote; {} for a sweep that is not a job's comparison (a space file's variants)."""
    path = storage.join(storage.normalize(sweep_dir), COMPARISON_FILE)
    if storage.is_file(path):
        return json.loads(storage.read_text(path))
    older = read_settings(sweep_dir)  # comparisons run before this file existed kept rows and parts there
    return {key: older[key] for key in ("rows", "parts") if older.get(key)}


def trial_results(sweep_dir: str, order: list[str] = ()) -> tuple[dict, list[dict]]:
    """(the sweep's settings, one row per trial: variant, seed, status, error, its run directory and its final
    metrics — empty for a trial that did not finish). A comparison run in stages lists the trials of its earlier
    stages first; the settings' variants are then those of every stage."""
    sweep_dir = storage.normalize(sweep_dir)
    settings = read_settings(sweep_dir)
    out = []
    for part in [*saved_comparison(sweep_dir).get("parts", []), sweep_dir]:
        part_settings, rows = trial_rows(part)
        for r in rows:
            run = trial_run(part, r["trial"])
            out.append({"trial": r["trial"], "variant": r.get("variant") or "", "seed": r.get("train.seed"),
                        "status": r["status"], "error": r["error"], "run": run,
                        "metrics": final_metrics(run).get("metrics", {})})
        if part != sweep_dir:
            settings = {**settings, "variants": {**part_settings.get("variants", {}), **settings.get("variants", {})}}
    order = list(order or settings.get("variants") or {})
    out.sort(key=lambda t: (order.index(t["variant"]) if t["variant"] in order else len(order), t["seed"] or 0))
    return settings, out


def summarize(trials: list[dict], keys: list[str]) -> dict[str, dict[str, dict]]:
    """variant → metric → {mean, std, n, values}: over the trials of the variant that report the metric."""
    out: dict[str, dict[str, dict]] = {}
    for t in trials:
        out.setdefault(t["variant"], {})
    for variant in out:
        for key in keys:
            values = [float(t["metrics"][key]) for t in trials if t["variant"] == variant and key in t["metrics"]]
            if values:
                out[variant][key] = {"mean": statistics.fmean(values), "n": len(values), "values": values,
                                     "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def format_summary(summary: dict, rows: list[Row], seeds: int) -> str:
    """Rows of metrics, a column per variant: mean ± std, and (n) where fewer than ``seeds`` trials report it."""
    names = list(summary)

    def cell(variant: str, key: str, fmt: str) -> str:
        s = summary[variant].get(key)
        if s is None:
            return "-"
        if s["n"] == 1:  # one seed has no spread to show
            return format(s["mean"], fmt) + (" (n=1)" if seeds > 1 else "")
        text = f"{format(s['mean'], fmt)} ± {format(s['std'], fmt.lstrip('+'))}"
        return text + (f" (n={s['n']})" if s["n"] < seeds else "")

    table = [("", *names)] + [(label, *(cell(n, key, fmt) for n in names)) for label, key, fmt in rows]
    width = max(len(r[0]) for r in table)
    cols = [max(len(r[i]) for r in table) for i in range(1, len(names) + 1)]
    return "\n".join(f"{r[0]:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(r[1:], cols)) for r in table)


def default_rows(trials: list[dict]) -> list[Row]:
    """For a space file with variants (`rayvl tune`): every evaluation metric the trials report, and the loss."""
    from rayvl.eval.tasks import METRIC_PREFIXES
    from rayvl.eval.tasks import is_constant

    keys = sorted({k for t in trials for k in t["metrics"] if k.startswith(METRIC_PREFIXES)
                   and not is_constant(k)})
    return [(k, k, ".2f") for k in keys] + [("final training loss", "loss", ".3f")]


def write_report(sweep_dir: str, rows: list[Row] | None = None, title: str = "", order: list[str] = (),
                 notes: Callable[[list[dict]], str] | None = None) -> tuple[str, list[str]]:
    """The report's files in the sweep directory, for the rows given, else the comparison's own (saved with it),
    else every evaluation metric; returns the printed table (variants in ``order``, the trials that did not finish,
    then what ``notes`` makes of the trials) and the files' names."""
    import tempfile

    sweep_dir = storage.normalize(sweep_dir)
    saved = saved_comparison(sweep_dir)
    settings, trials = trial_results(sweep_dir, order or saved.get("order", []))
    rows = [tuple(r) for r in rows or saved.get("rows") or default_rows(trials)]
    seeds = len({t["seed"] for t in trials})
    summary = summarize(trials, [key for _, key, _ in rows])
    local = storage.local_path(sweep_dir)
    with tempfile.TemporaryDirectory(prefix="rayvl-comparison-") as staging:
        out = local or Path(staging)
        _files(out, trials, summary, rows, title or saved.get("title") or settings.get("space_file", ""))
        names = sorted(p.name for p in out.iterdir() if p.name.startswith(("comparison", "curves_")))
        if local is None:
            for n in names:
                storage.write_bytes(storage.join(sweep_dir, n), (out / n).read_bytes())
    lines = [format_summary(summary, rows, seeds)]
    missing = [t for t in trials if not t["metrics"]]  # failed, or not run yet (an interrupted comparison)
    lines += [f"{'failed' if t['status'] == 'ERROR' else 'not finished'}: {t['variant']} seed {t['seed']} "
              f"({t['status']}{': ' + t['error'] if t['error'] else ''})" for t in missing]
    lines += [notes(trials)] if notes else []
    return "\n".join(line for line in lines if line), names


def variants_report(sweep_dir: str) -> str:
    """`rayvl tune` on a sweep with variants (a space file's, or a job's comparison): mean ± std per variant over
    the other keys, and where its files are; "" for a sweep without variants."""
    settings = read_settings(sweep_dir)
    if not settings.get("variants"):
        return ""
    table, files = write_report(sweep_dir)
    return (f"\n== variants: mean ± std over {', '.join(settings['keys']) or 'one trial each'} ==\n{table}\n"
            f"  files: {', '.join(files)}")


def _files(out: Path, trials: list[dict], summary: dict, rows: list[Row], title: str) -> None:
    import csv

    keys = [key for _, key, _ in rows]
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["variant", "seed", "trial", "status", *keys])
        for t in trials:
            writer.writerow([t["variant"], t["seed"], t["trial"], t["status"],
                             *(t["metrics"].get(k, "") for k in keys)])
    (out / "comparison.json").write_text(json.dumps(
        {"title": title, "rows": [list(r) for r in rows],
         "summary": {v: {k: {"mean": s["mean"], "std": s["std"], "n": s["n"], "values": s["values"]}
                         for k, s in m.items()} for v, m in summary.items()}}, indent=2))
    _bars(out / "comparison.png", summary, rows, title)
    _curves(out, trials)


def _bars(path: Path, summary: dict, rows: list[Row], title: str) -> None:
    """One panel per metric: a bar per variant at its mean, an error bar of ± std and a dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(label, key) for label, key, _ in rows if any(key in m for m in summary.values())]
    if not shown:
        return
    cols = min(3, len(shown))
    lines = -(-len(shown) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(4.2 * cols, 3.2 * lines), squeeze=False)
    names = list(summary)
    for ax, (label, key) in zip(axes.flat, shown):
        for i, name in enumerate(names):
            s = summary[name].get(key)
            if s is None:
                continue
            ax.bar(i, s["mean"], yerr=s["std"], capsize=4, color=f"C{i}", alpha=0.6)
            ax.plot([i] * len(s["values"]), s["values"], "k.", markersize=5)
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=30 if len(names) > 3 else 0,
                      ha="right" if len(names) > 3 else "center")
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle(f"{title}: mean ± std over seeds (dots: seeds)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # keep the panels' titles below the suptitle
    fig.savefig(path, dpi=100)
    plt.close(fig)


def seed_curve(histories: list[list[dict]], metric: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean over the seeds, std over the seeds) of one variant's ``metric``, valued as the run's dashboard
    draws it (a share as a percentage)."""
    import numpy as np

    from rayvl.plots import points

    by_step: dict[int, list[float]] = {}
    for h in histories:
        for step, value in points(h, metric):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (steps, [float(np.mean(by_step[s])) for s in steps],
            [float(np.std(by_step[s], ddof=1)) if len(by_step[s]) > 1 else 0.0 for s in steps])


def _curves(out: Path, trials: list[dict]) -> None:
    """Per metric of the runs' histories: each variant's mean over its seeds at each step, ± std shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from rayvl.plots import history, plotted_metrics, title

    histories: dict[str, list[list[dict]]] = {}
    for t in trials:
        try:
            histories.setdefault(t["variant"], []).append(history(t["run"]))
        except FileNotFoundError:  # a trial that failed before its first report
            continue
    metrics = list(dict.fromkeys(m for hs in histories.values() for h in hs for m in plotted_metrics(h)))
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for i, (variant, hs) in enumerate(histories.items()):
            steps, mean, std = map(np.array, seed_curve(hs, metric))
            if not len(steps):
                continue
            ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, markersize=3, color=f"C{i}",
                    label=f"{variant} (n={len(hs)})")
            ax.fill_between(steps, mean - std, mean + std, color=f"C{i}", alpha=0.2)
        ax.set(xlabel="step", ylabel=title(metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"curves_{metric.replace('@', '_at_').replace('/', '_')}.png", dpi=100)
        plt.close(fig)
