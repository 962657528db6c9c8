"""`rayvl ...` subcommands. Jobs (jobs/*.py) call `run_recipe` with their recipe file."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rayvl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


def add_train_args(p: argparse.ArgumentParser, default_config: str | None) -> None:
    p.add_argument("--config", default=default_config, help="recipe YAML (configs/*.yaml)")
    p.add_argument("--data", help="training shards (dir, glob, list file or URL); sets data.train")
    p.add_argument("--eval-data", help="held-out shards; sets data.eval")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set train.zero_stage=3 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue train.run_name from its latest checkpoint")


def config_from_args(args) -> "RayvlConfig":  # noqa: F821
    overrides = list(args.set)
    if args.data:
        overrides.append(f"data.train={args.data}")
    if args.eval_data:
        overrides.append(f"data.eval={args.eval_data}")
    if args.resume:
        overrides.append("train.resume=true")
    return load_config(args.config, overrides)


def run_recipe(default_config: str, argv: list[str] | None = None) -> int:
    """Parse, validate (before Ray starts), train, print the evaluation table and where the run is."""
    p = argparse.ArgumentParser(description=f"rayvl recipe {Path(default_config).stem}")
    add_train_args(p, default_config)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from rayvl.train.trainer import format_data_report, format_eval_table, train

    try:
        result = train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n== evaluation (held-out split) ==")
    print(format_eval_table(result.metrics))
    print("\n== data ==")
    print(format_data_report(result.data_report))
    print(f"\nrun directory: {result.run_dir}")
    print(f"  checkpoint:  {result.checkpoint_dir}")
    print(f"  metrics:     {result.run_dir / 'metrics.jsonl'}")
    print(f"  evaluation:  {result.run_dir / 'eval.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rayvl")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a dual encoder (default recipe: laion_adapt)")
    add_train_args(t, str(REPO / "configs" / "laion_adapt.yaml"))
    data = sub.add_parser("data", help="dataset utilities").add_subparsers(dest="data_command", required=True)
    demo = data.add_parser("demo", help="write the embedded demo dataset in img2dataset layout")
    demo.add_argument("--out", required=True)
    demo.add_argument("--samples", type=int, default=4000)
    demo.add_argument("--eval-samples", type=int, default=500)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--shard-size", type=int, default=1000)
    a = sub.add_parser("assets", help="offline assets").add_subparsers(dest="assets_command", required=True)
    a.add_parser("fetch", help="unpack Debian data packages (Fashion-MNIST) into the environment")
    a.add_parser("check", help="verify that the pretrained towers load offline")
    args = p.parse_args(argv)

    if args.command == "train":
        argv = list(argv if argv is not None else sys.argv[1:])[1:]
        return run_recipe(args.config, argv)
    if args.command == "data":
        from rayvl.data.demo import write_demo

        out = write_demo(args.out, args.samples, args.eval_samples, args.seed, args.shard_size)
        print(f"wrote demo dataset: {out} ({args.samples} train, {args.eval_samples} held-out)")
        return 0
    if args.command == "assets":
        from rayvl import assets

        if args.assets_command == "fetch":
            done = assets.fetch_debian_packages()
            print(f"assets in {assets.data_root()}: fetched {done or 'nothing new'}; "
                  f"fashion-mnist: {assets.fashion_mnist_dir()}")
            return 0
        print("text minilm-l6:", assets.text_model_path("minilm-l6"))
        print("vision efficientnet-lite0:", len(assets.vision_state_dict("efficientnet-lite0")), "tensors")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
