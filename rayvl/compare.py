"""Comparisons: one recipe under named variants × seeds, on identical data and steps, as one Ray Tune grid run by
the sweep machinery (``rayvl.tune``: trials share the cluster, fail alone, and an interrupted comparison resumes
with ``--resume``), summarised per variant as mean ± std over the seeds of every metric, with a figure of bars
and one of learning curves.

Seeds are the grid dimension ``train.seed`` (0 … seeds − 1): it seeds the model's new layers, each row's crop and
prompt, the shard order, the shuffle buffers and the TOnICS sampler. The data — the shards, or the embedded demo
dataset, which does not depend on the run's seed — are the same for every trial, and a comparison reads them in
Ray Data's block order (``data.deterministic``, unless its overrides turn it off), so variants with the same seed
differ only by their overrides (on GPU also by non-deterministic kernels).
The spread is the sample standard deviation (n − 1) over the seeds whose trial finished; a variant with a failed
trial shows its n.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rayvl import storage
from rayvl.tune import (FINAL_METRICS, SWEEP_FILE, Sweep, SweepError, hook, run_sweep, sweep_directory, trial_rows,
                        validate)

DEFAULT_SEEDS = 3


@dataclass
class Comparison:
    """A comparison a job runs. ``rows``: (label, metric key, format) of its table; ``fixed``: overrides every
    trial gets first (the paper's setup); ``demo``: overrides after those on the embedded demo (the budget that
    fits 2 cores); ``demo_variants``: the variants the demo runs unless --variants says otherwise (all when
    empty: a comparison whose every arm does not fit the demo's budget names the ones that do); ``after``:
    "module:function" each trial calls on its finished run for more metrics (``after_metrics``: their names);
    ``metric``: what Tune ranks trials by (every report carries the loss); ``notes``: "module:function" that
    turns the trials' results into more of the printed report (what a table row cannot show)."""

    title: str
    recipe: str
    variants: dict[str, list[str]]
    rows: list[tuple[str, str, str]]
    demo: list[str] = field(default_factory=list)
    demo_variants: tuple[str, ...] = ()
    fixed: list[str] = field(default_factory=list)
    after: str = ""
    after_metrics: tuple[str, ...] = ()
    metric: str = "loss"
    mode: str = "min"
    notes: str = ""  # "module:function": given the trials (trial_results), more text for the report

    def chosen(self, names: str, demo: bool) -> "Comparison":
        """This comparison over the variants ``names`` lists (comma-separated; "all"), by default over all of them
        or, on the demo, over ``demo_variants``. Unknown names are an error naming --variants."""
        if names == "all" or not (names or demo and self.demo_variants):
            picked = list(self.variants)
        else:
            picked = [n for n in names.split(",") if n] if names else list(self.demo_variants)
        unknown = [n for n in picked if n not in self.variants]
        if unknown or not picked:
            raise SweepError(f"{self.title}: --variants: unknown {', '.join(unknown) or '(none given)'}; "
                             f"known: {', '.join(self.variants)} (or all)")
        return dataclasses.replace(self, variants={n: self.variants[n] for n in picked})

    def sweep(self, overrides: list[str], seeds: int, after_kwargs: dict | None = None, name: str = "",
              parts: list[str] = ()) -> Sweep:
        """The Tune grid (variants × ``train.seed``) over ``fixed`` + ``overrides``, validated against the config tree
        before Ray starts; ``parts``: the directories of earlier stages of the same comparison."""
        if seeds < 1:
            raise SweepError(f"{self.title}: --seeds: must be ≥ 1, got {seeds}")
        sweep = Sweep(path=self.title, recipe=self.recipe, metric=self.metric, mode=self.mode,
                      space={"train.seed": {"grid": list(range(seeds))}},
                      fixed=PAIRED + self.fixed + list(overrides), name=name,
                      variants=dict(self.variants), after=self.after, after_kwargs=dict(after_kwargs or {}),
                      after_metrics=tuple(self.after_metrics), rows=[list(r) for r in self.rows], parts=list(parts))
        validate(sweep)
        return sweep


# a comparison's seeds pair its variants: same seed, same rows in the same order (a later override may undo it)
PAIRED = ["data.deterministic=true"]


def trial_results(sweep_dir: str, order: list[str] = ()) -> tuple[dict, list[dict]]:
    """(the sweep's settings, one row per trial: variant, seed, status, error, its run directory and its final
    metrics — empty for a trial that did not finish). A comparison run in stages (``Sweep.parts``) lists the
    trials of its earlier stages first; the settings' variants are then those of every stage."""
    sweep_dir = storage.normalize(sweep_dir)
    settings = json.loads(storage.read_text(storage.join(sweep_dir, SWEEP_FILE)))
    out = []
    for part in [*settings.get("parts", []), sweep_dir]:
        part_settings, rows = trial_rows(part)
        runs = storage.join(part, "runs")
        for r in rows:
            run = storage.join(runs, f"trial-{r['trial']}")
            path = storage.join(run, FINAL_METRICS)
            record = json.loads(storage.read_text(path)) if storage.is_file(path) else {}
            out.append({"trial": r["trial"], "variant": r.get("variant") or "", "seed": r.get("train.seed"),
                        "status": r["status"], "error": r["error"], "run": run, "metrics": record.get("metrics", {})})
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


def format_summary(summary: dict, rows: list[tuple[str, str, str]], seeds: int) -> str:
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


def default_rows(trials: list[dict]) -> list[tuple[str, str, str]]:
    """For a space file with variants (`rayvl tune`): every evaluation metric the trials report, and the loss."""
    from rayvl.eval.tasks import METRIC_PREFIXES
    from rayvl.plots import SKIPPED

    keys = sorted({k for t in trials for k in t["metrics"] if k.startswith(METRIC_PREFIXES)
                   and not any(s in k for s in SKIPPED)})
    return [(k, k, ".2f") for k in keys] + [("final training loss", "loss", ".3f")]


def write_report(sweep_dir: str, rows: list[tuple[str, str, str]] | None = None,
                 title: str = "", order: list[str] = (), notes: str = "") -> tuple[str, list[str]]:
    """The rows given, else the comparison's own (saved with the sweep), else every evaluation metric.
    comparison.csv (one row per trial), comparison.json (mean ± std per variant and metric), comparison.png
    (a bar per variant with its spread and seeds for each metric) and curves_<metric>.png (mean ± std over the
    seeds against the step) in the sweep directory; returns the printed table (variants in ``order``, then what
    the ``notes`` hook makes of the trials) and the files' names."""
    import tempfile

    sweep_dir = storage.normalize(sweep_dir)
    settings, trials = trial_results(sweep_dir, order)
    rows = [tuple(r) for r in rows or settings.get("rows") or default_rows(trials)]
    seeds = len({t["seed"] for t in trials})
    summary = summarize(trials, [key for _, key, _ in rows])
    local = storage.local_path(sweep_dir)
    with tempfile.TemporaryDirectory(prefix="rayvl-comparison-") as staging:
        out = local or Path(staging)
        _files(out, trials, summary, rows, title or settings.get("space_file", ""))
        names = sorted(p.name for p in out.iterdir() if p.name.startswith(("comparison", "curves_")))
        if local is None:
            for n in names:
                storage.write_bytes(storage.join(sweep_dir, n), (out / n).read_bytes())
    lines = [format_summary(summary, rows, seeds)]
    missing = [t for t in trials if not t["metrics"]]  # failed, or not run yet (an interrupted comparison)
    lines += [f"{'failed' if t['status'] == 'ERROR' else 'not finished'}: {t['variant']} seed {t['seed']} "
              f"({t['status']}{': ' + t['error'] if t['error'] else ''})" for t in missing]
    lines += [hook(notes)(trials)] if notes else []
    return "\n".join(lines), names


def _files(out: Path, trials: list[dict], summary: dict, rows: list[tuple[str, str, str]], title: str) -> None:
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


def _bars(path: Path, summary: dict, rows: list[tuple[str, str, str]], title: str) -> None:
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


def _curves(out: Path, trials: list[dict]) -> None:
    """Per metric of the runs' histories: each variant's mean over its seeds at each step, ± std shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from rayvl.plots import TRAINING, history, plotted_metrics

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
            by_step: dict[int, list[float]] = {}
            for h in hs:
                for r in h:
                    if r.get(metric) is not None:
                        by_step.setdefault(r["step"], []).append(float(r[metric]))
            if not by_step:
                continue
            steps = sorted(by_step)
            mean = np.array([np.mean(by_step[s]) for s in steps])
            std = np.array([np.std(by_step[s], ddof=1) if len(by_step[s]) > 1 else 0.0 for s in steps])
            ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, markersize=3, color=f"C{i}",
                    label=f"{variant} (n={len(hs)})")
            ax.fill_between(steps, mean - std, mean + std, color=f"C{i}", alpha=0.2)
        ax.set(xlabel="step", ylabel=TRAINING.get(metric, metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"curves_{metric.replace('@', '_at_').replace('/', '_')}.png", dpi=100)
        plt.close(fig)


# ----------------------------------------------------------------------------- the jobs' command line

def main(comparison: Comparison, argv: list[str] | None = None, defaults=None, add_args=None,
         after_kwargs=None, staged=None, bind=None) -> int:
    """Parse, validate (before Ray starts), run the grid, print and write the comparison.
    ``defaults(args)`` returns overrides applied before the user's --set (a demo data split);
    ``add_args(parser)`` adds the job's own options; ``after_kwargs(args)`` the keyword arguments of ``after``;
    ``staged(args, comparison)`` may split the run in two (see run_stages): (the variants to run first, a function
    from their finished comparison directory to overrides for the other variants), or None; ``bind(args,
    comparison)`` returns the comparison its variants need for these arguments (data paths the variants name)."""
    from rayvl import session
    from rayvl.recipes import USER_ERRORS, config_overrides, one_line

    p = argparse.ArgumentParser(description=f"rayvl comparison {comparison.title}: "
                                            f"{', '.join(comparison.variants)} × seeds, as a Ray Tune grid")
    p.add_argument("--config", default=comparison.recipe, help="recipe YAML (configs/*.yaml)")
    p.add_argument("--data", help="training shards (dir, glob, list file or URL); sets data.train")
    p.add_argument("--eval-data", help="held-out shards; sets data.eval")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field of every trial (repeatable)")
    p.add_argument("--variants", default="", metavar="A,B,...",
                   help="the variants to run, or all (default: all"
                        + (f"; on the demo: {','.join(comparison.demo_variants)}" if comparison.demo_variants else "")
                        + ")")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per variant (train.seed = 0 … N-1)")
    p.add_argument("--name", default="", help="comparison name (default: <job>-<time>); with --resume, the one "
                                              "to continue")
    p.add_argument("--resume", action="store_true", help="continue an interrupted comparison (--name)")
    p.add_argument("--report", default="", metavar="DIR", help="only print and write the report of a comparison "
                                                                "directory (finished or interrupted)")
    p.add_argument("--dry-run", action="store_true", help="check the grid, the config and the data and print the "
                                                           "plan, without starting Ray")
    if add_args:
        add_args(p)
    args = p.parse_args(argv)
    session.setup_logging(True)  # Tune's trial table is the progress of a comparison
    if args.report:
        session.connect("", 1, include_dashboard=False)  # Tune's ExperimentAnalysis reads trials through a session
        print(write_report(args.report, comparison.rows, comparison.title, list(comparison.variants),
                           comparison.notes)[0])
        return 0
    if args.resume and not args.name:
        print("config error: --resume: give the --name of the comparison to continue", file=sys.stderr)
        return 2
    try:
        comparison = dataclasses.replace(comparison, recipe=args.config)
        comparison = (bind(args, comparison) if bind else comparison).chosen(args.variants, demo=not args.data)
        overrides = (comparison.demo if not args.data else []) + (defaults(args) if defaults else [])
        overrides += config_overrides(args)
        name = args.name or f"{comparison.title.split()[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
        if args.dry_run:
            return _print_plan(comparison.sweep(overrides, args.seeds, after_kwargs(args) if after_kwargs else {},
                                                name))
        plan = staged(args, comparison) if staged else None
        sweep_dir = run_stages(comparison, overrides, args.seeds, after_kwargs(args) if after_kwargs else {}, name,
                               args.resume, *(plan or ((), None)))
    except USER_ERRORS as e:
        print(f"config error: {one_line(e)}", file=sys.stderr)
        return 2
    _print_result(comparison, sweep_dir, args.seeds)
    return 0


def _print_plan(sweep: Sweep) -> int:
    """--dry-run: the grid's trials and one trial's run plan (rayvl.plan), nothing started."""
    from rayvl.plan import describe_sweep

    print(describe_sweep(sweep))
    return 0


def _print_result(comparison: Comparison, sweep_dir: str, seeds: int) -> None:
    table, files = write_report(sweep_dir, comparison.rows, comparison.title, list(comparison.variants),
                                comparison.notes)
    print(f"\n== {comparison.title}: mean ± std over {seeds} seeds, held-out evaluation ==")
    print(table)
    print(f"\ncomparison directory: {sweep_dir}\n  per trial: {storage.join(sweep_dir, 'comparison.csv')}\n"
          f"  summary:   {storage.join(sweep_dir, 'comparison.json')}\n  plots:     "
          + ", ".join(n for n in files if n.endswith(".png"))
          + f"\n  runs:      {storage.join(sweep_dir, 'runs')}/trial-*  (again: {Path(sys.argv[0]).name} --report "
          f"{sweep_dir})")


def run_stages(comparison: Comparison, overrides: list[str], seeds: int, after_kwargs: dict, name: str,
               resume: bool, first=(), then=None) -> str:
    """Run the comparison's grid; returns its directory. With ``first``, in two stages: those variants as the grid
    ``<name>-<first>``, then the others as the grid ``<name>`` with the overrides ``then(<first stage's directory>)``
    (a setting read from the first arms' results, e.g. a threshold from a control's learning curve); the second
    stage's report includes the first stage's trials. Both grids are validated before Ray starts; --resume
    continues whichever stage was interrupted."""
    first = [v for v in first if v in comparison.variants]
    rest = [v for v in comparison.variants if v not in first]
    stages = [(f"{name}-{'+'.join(first)}", first), (name, rest)] if first and rest else [(name, rest)]
    sweeps = [comparison.chosen(",".join(v), demo=False).sweep(overrides, seeds, after_kwargs, n) for n, v in stages]
    prepare_data(sweeps[0])
    parts: list[str] = []
    for sweep in sweeps:
        if parts:  # the second stage: the first one's results decide its extra overrides
            write_report(parts[-1], comparison.rows, comparison.title, list(comparison.variants))
            sweep = comparison.chosen(",".join(sweep.variants), demo=False).sweep(
                overrides + then(parts[-1]), seeds, after_kwargs, sweep.name, parts)
        begun = storage.exists(sweep_directory(sweep.base_config(), sweep.name))
        sweep_dir, _ = run_sweep(sweep, name=sweep.name, resume=resume and (not parts or begun))  # else it starts
        parts.append(sweep_dir)
    return parts[-1]


def prepare_data(sweep: Sweep) -> None:
    """What every trial reads must exist before they start side by side: the demo dataset, generated once."""
    from rayvl.train.datasets import resolve_data

    resolve_data(sweep.base_config())
