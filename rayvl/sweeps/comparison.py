"""Comparisons: one recipe under named variants × seeds, on identical data and steps, as one Ray Tune grid run by the
sweep runner (trials share the cluster, fail alone, and an interrupted comparison resumes with ``--resume``),
reported per variant as mean ± std over the seeds (rayvl.sweeps.comparison_report).

Seeds are the grid dimension ``train.seed`` (0 … seeds − 1): it seeds the model's new layers, each row's crop and
prompt, the shard order, the shuffle buffers and the TOnICS sampler. The data — the shards, or the embedded demo
dataset, which does not depend on the run's seed — are the same for every trial, and a comparison reads them in
Ray Data's block order (``data.deterministic``, unless its overrides turn it off), so variants with the same seed
differ only by their overrides (on GPU also by non-deterministic kernels).

A job is a ``Comparison`` (a subclass where it needs more: its own options, default overrides, the keyword
arguments of its per-trial ``after`` evaluation, data its variants name, a first stage) and
``sys.exit(COMPARISON.main())``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from rayvl import storage
from rayvl.sweeps import directory
from rayvl.sweeps.comparison_report import Row, save_comparison, write_report
from rayvl.sweeps.runner import run_sweep
from rayvl.sweeps.spaces import Sweep, SweepError, check_evaluated, pinned_variants, validate
from rayvl.sweeps.trials import After

DEFAULT_SEEDS = 3
# a comparison's seeds pair its variants: same seed, same rows in the same order (a later override may undo it)
PAIRED = ["data.deterministic=true"]
HELD_OUT = "--eval-data SHARDS, or --set data.eval=SHARDS"  # how a job's command line gives held-out shards


class Stages(NamedTuple):
    """A comparison run in two grids: the variants ``first`` (grid ``<name>-<first>``), then the others (grid
    ``<name>``) with the overrides ``then(<first grid's directory>)`` — a setting read from the first arms' results,
    e.g. a threshold from a control's learning curve."""

    first: list[str]
    then: Callable[[str], list[str]]


@dataclass
class Comparison:
    """A comparison a job runs: its ``variants`` (named "key=value" overrides) of ``recipe`` and the ``rows``
    (label, metric key, format) of its table."""

    title: str
    recipe: str
    variants: dict[str, list[str]]
    rows: list[Row]
    demo: list[str] = field(default_factory=list)
    """overrides after ``fixed`` on the embedded demo: the budget that fits 2 cores."""
    demo_variants: tuple[str, ...] = ()
    """the variants the demo runs unless --variants says otherwise (all when empty: a comparison whose every arm
    does not fit the demo's budget names the ones that do)."""
    fixed: list[str] = field(default_factory=list)
    """overrides every trial gets first (the paper's setup)."""
    after: str = ""
    """"module:function" each trial calls on its finished run for more metrics (``after_metrics``: their names)."""
    after_metrics: tuple[str, ...] = ()
    metric: str = "loss"
    """what Tune ranks trials by (every report carries the loss)."""
    mode: str = "min"
    pinned: list[str] = field(default_factory=list)
    """the command line's --set: it wins over a variant's value of the same key, as over the recipe's and the
    demo's (``--variants vit,vit_patch_dropout --set model.vision=vit_base_patch16_224``: both arms a ViT-B)."""

    # ------------------------------------------------------------------------- what a job's subclass may add

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The job's own command-line options."""

    def bind(self, args) -> "Comparison":
        """This comparison with what its variants need from the arguments (e.g. the data paths they name)."""
        return self

    def defaults(self, args) -> list[str]:
        """Overrides every trial gets before the user's --set (e.g. the demo's data split)."""
        return []

    def after_kwargs(self, args) -> dict:
        """The keyword arguments of ``after``."""
        return {}

    def stages(self, args) -> Stages | None:
        """Two grids instead of one (see Stages), or None."""
        return None

    def prepare(self, args, overrides: list[str]) -> None:
        """Work the trials need done before they start (after every check, before the grid): none by default."""

    def describe(self, grid: Sweep, args, overrides: list[str]) -> str:
        """--dry-run: the grid's trials and one trial's run plan (rayvl.dry_run), nothing started."""
        from rayvl.dry_run import describe_sweep

        return describe_sweep(grid)

    def notes(self, trials: list[dict]) -> str:
        """More of the printed report, from the trials' results (what a table row cannot show)."""
        return ""

    # ------------------------------------------------------------------------- the grid

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

    def sweep(self, overrides: list[str], seeds: int, name: str = "") -> Sweep:
        """The Tune grid (variants × ``train.seed``) over ``fixed`` + ``overrides``, validated against the config tree
        before Ray starts — its rows too: an evaluation metric needs held-out data."""
        if seeds < 1:
            raise SweepError(f"{self.title}: --seeds: must be ≥ 1, got {seeds}")
        grid = Sweep(path=self.title, recipe=self.recipe, metric=self.metric, mode=self.mode,
                     space={"train.seed": {"grid": list(range(seeds))}}, fixed=PAIRED + self.fixed + list(overrides),
                     name=name, variants=pinned_variants(self.title, self.variants, self.pinned), pinned=self.pinned)
        validate(grid, extra_metrics=tuple(self.after_metrics), held_out=HELD_OUT)
        check_evaluated(grid, {key: f"row {label!r}" for label, key, _ in self.rows if key != self.metric}, HELD_OUT)
        return grid

    def run(self, overrides: list[str], seeds: int, name: str, resume: bool = False, after_kwargs: dict | None = None,
            stages: Stages | None = None) -> str:
        """Run the grid (or its two stages; the second stage's report includes the first stage's trials), each trial
        ending with ``after`` called with ``after_kwargs``; returns the grid's directory. Every grid is validated
        before Ray starts; --resume continues whichever stage was interrupted."""
        from rayvl.train.datasets import resolve_data

        first = [v for v in (stages.first if stages else ()) if v in self.variants]
        rest = [v for v in self.variants if v not in first]
        plan = [(f"{name}-{'+'.join(first)}", first), (name, rest)] if first and rest else [(name, list(self.variants))]
        grids = [self.chosen(",".join(v), demo=False).sweep(overrides, seeds, n) for n, v in plan]
        resolve_data(grids[0].base_config())  # what every trial reads exists before they start: the demo, once
        after, parts = After(self.after, dict(after_kwargs or {})), []
        for grid in grids:
            if parts:  # the second stage: the first one's results decide its extra overrides
                self.report(parts[-1])
                grid = self.chosen(",".join(grid.variants), demo=False).sweep(
                    overrides + stages.then(parts[-1]), seeds, grid.name)
            sweep_dir = directory.sweep_directory(grid.base_config(), grid.name)
            resumed = resume and (not parts or directory.begun(sweep_dir))  # a second stage not begun starts
            if not resumed and not directory.begun(sweep_dir):
                save_comparison(sweep_dir, self.title, self.rows, list(self.variants), parts)
            parts.append(run_sweep(grid, name=grid.name, resume=resumed, after=after)[0])
        return parts[-1]

    def report(self, sweep_dir: str) -> tuple[str, list[str]]:
        """The comparison's table and files (rayvl.sweeps.comparison_report), variants in this one's order."""
        return write_report(sweep_dir, self.rows, self.title, list(self.variants), self.notes)

    # ------------------------------------------------------------------------- the job's command line

    def main(self, argv: list[str] | None = None) -> int:
        """Parse, validate (before Ray starts), prepare, run the grid, print and write the comparison. A user's
        error is one line, ``rayvl: error: ...``, and exit status 2."""
        from rayvl import session
        from rayvl.cli.recipes import USER_ERRORS, user_error

        args = self.parser().parse_args(argv)
        session.setup_logging(True)  # Tune's trial table is the progress of a comparison
        if args.report:
            print(self.report(args.report)[0])
            return 0
        try:
            if args.resume and not args.name:
                raise SweepError("--resume: give the --name of the comparison to continue")
            args.name = args.name or f"{self.title.split()[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
            comparison, overrides = self.configured(args)
            grid = comparison.sweep(overrides, args.seeds, args.name)  # the whole grid, checked before Ray starts
            if args.dry_run:
                print(comparison.describe(grid, args, overrides))
                return 0
            comparison.prepare(args, overrides)
            sweep_dir = comparison.run(overrides, args.seeds, args.name, args.resume, comparison.after_kwargs(args),
                                       comparison.stages(args))
        except USER_ERRORS as e:
            return user_error(e)
        comparison.print_result(sweep_dir, args.seeds)
        return 0

    def configured(self, args) -> tuple["Comparison", list[str]]:
        """This comparison for the arguments, and the overrides every trial gets after ``fixed``: the demo's budget
        (without --data), the job's defaults, then --set, --data and --eval-data."""
        from rayvl.cli.recipes import config_overrides

        comparison = dataclasses.replace(self, recipe=args.config, pinned=list(args.set)).bind(args) \
            .chosen(args.variants, not args.data)
        return comparison, (comparison.demo if not args.data else []) + comparison.defaults(args) \
            + config_overrides(args)

    def parser(self) -> argparse.ArgumentParser:
        from rayvl.cli.recipes import RayvlParser  # a usage mistake ends as every user error does: rayvl: error: ...

        p = RayvlParser(description=f"rayvl comparison {self.title}: {', '.join(self.variants)} × seeds, "
                                                f"as a Ray Tune grid")
        p.add_argument("--config", default=self.recipe, help="recipe YAML (configs/*.yaml)")
        p.add_argument("--data", help="training shards (dir, glob, list file or URL); sets data.train")
        p.add_argument("--eval-data", help="held-out shards; sets data.eval")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field of every trial (repeatable)")
        p.add_argument("--variants", default="", metavar="A,B,...", help="the variants to run, or all (default: all"
                       + (f"; on the demo: {','.join(self.demo_variants)}" if self.demo_variants else "") + ")")
        p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per variant (train.seed = 0 … N-1)")
        p.add_argument("--name", default="", help="comparison name (default: <job>-<time>); with --resume, the one "
                                                  "to continue")
        p.add_argument("--resume", action="store_true", help="continue an interrupted comparison (--name)")
        p.add_argument("--report", default="", metavar="DIR", help="only print and write the report of a "
                                                                    "comparison directory (finished or interrupted)")
        p.add_argument("--dry-run", action="store_true", help="check the grid, the config and the data and print "
                                                               "what it would do, without starting Ray")
        self.add_arguments(p)
        return p

    def print_result(self, sweep_dir: str, seeds: int) -> None:
        table, files = self.report(sweep_dir)
        print(f"\n== {self.title}: mean ± std over {seeds} seeds, held-out evaluation ==")
        print(table)
        print(f"\ncomparison directory: {sweep_dir}\n  per trial: {storage.join(sweep_dir, 'comparison.csv')}\n"
              f"  summary:   {storage.join(sweep_dir, 'comparison.json')}\n  plots:     "
              + ", ".join(n for n in files if n.endswith(".png"))
              + f"\n  runs:      {storage.join(sweep_dir, 'runs')}/trial-*  (again: {Path(sys.argv[0]).name} "
              f"--report {sweep_dir})")

