"""Recipes as programs: the jobs in ``jobs/`` train one recipe (``run_recipe``) or the same recipe once per variant
with the evaluations side by side (``run_comparison``). Config errors exit with status 2 before Ray starts."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from rayvl import storage
from rayvl.config import ConfigError, RayvlConfig, load_config
from rayvl.data.report import caption_stats, format_data_report
from rayvl.eval.tables import format_eval_table, format_side_by_side

CONFIGS = Path(__file__).resolve().parent.parent / "configs"  # the recipes of a source checkout


def add_train_args(p: argparse.ArgumentParser, default_config: str | None) -> None:
    p.add_argument("--config", default=default_config, help="recipe YAML (configs/*.yaml)")
    p.add_argument("--data", help="training shards (dir, glob, list file or URL); sets data.train")
    p.add_argument("--eval-data", help="held-out shards; sets data.eval")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set train.zero_stage=3 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue train.run_name from its latest checkpoint")


def config_from_args(args, extra: list[str] = ()) -> RayvlConfig:
    overrides = list(args.set) + list(extra)
    if args.data:
        overrides.append(f"data.train={args.data}")
    if args.eval_data:
        overrides.append(f"data.eval={args.eval_data}")
    if args.resume:
        overrides.append("train.resume=true")
    return load_config(args.config, overrides)


def _train(cfg: RayvlConfig):
    from rayvl.train.trainer import train  # Ray Train and DeepSpeed load only once the config is valid

    return train(cfg)


def run_recipe(default_config: str, argv: list[str] | None = None) -> int:
    """Parse, validate (before Ray starts), train, print the evaluation table and where the run is."""
    p = argparse.ArgumentParser(description=f"rayvl recipe {Path(default_config).stem}")
    add_train_args(p, default_config)
    args = p.parse_args(argv)
    try:
        result = _train(config_from_args(args))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n== evaluation (held-out split) ==")
    print(format_eval_table(result.metrics))
    print("\n== data ==")
    print(format_data_report(result.data_report))
    print(f"\nrun directory: {result.uri}")
    print(f"  checkpoint:  {result.checkpoint_dir}")
    print(f"  metrics:     {storage.join(result.uri, 'metrics.jsonl')}")
    print(f"  evaluation:  {storage.join(result.uri, 'eval.json')}")
    return 0


def run_comparison(default_config: str, variants: dict[str, list[str]], rows: list[tuple[str, str, str]],
                   argv: list[str] | None = None, defaults=None, after=None) -> int:
    """Train the same recipe once per variant (same data, seed and steps; each variant adds its own --set
    overrides) and print the evaluations side by side. ``rows``: (label, metric key, format).
    ``defaults(args)`` may return overrides applied before the user's --set (e.g. a demo data split);
    ``after(result)`` may return more metrics for a finished run (e.g. a second evaluation set)."""
    p = argparse.ArgumentParser(description=f"rayvl comparison {Path(default_config).stem}: {', '.join(variants)}")
    add_train_args(p, default_config)
    args = p.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        base = defaults(args) if defaults else []
        configs = {}
        for name, overrides in variants.items():
            cfg = config_from_args(argparse.Namespace(**{**vars(args), "set": base + list(args.set)}), overrides)
            run = f"{cfg.train.run_name or cfg.recipe + '-' + stamp}-{name}"
            configs[name] = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_name=run))
        results = {name: _variant(name, cfg, after) for name, cfg in configs.items()}
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"\n== {Path(default_config).stem}: held-out evaluation side by side ==")
    print(format_side_by_side(results, rows))
    for name, r in results.items():
        print(f"{name}: {r['run_dir']}")
    return 0


def _variant(name: str, cfg: RayvlConfig, after) -> dict:
    print(f"\n== {name}: training {cfg.train.run_name} ==", flush=True)
    result = _train(cfg)
    print(format_data_report(result.data_report))
    return {**result.metrics, **caption_stats(result.data_report["counts"]), **(after(result) if after else {}),
            "run_dir": result.uri}
