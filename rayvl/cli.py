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


def eval_main(args) -> int:
    import json

    import ray

    from rayvl.eval.embed import resolve_checkpoint
    from rayvl.eval.runner import TASKS, default_sources, format_tables, run_eval

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        print(f"--tasks: unknown {bad} (known: {', '.join(TASKS)})", file=sys.stderr)
        return 2
    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        config = json.loads((ckpt / "rayvl.json").read_text())["config"]
        sources = default_sources(config, args.data, args.kind, args.classes, args.paraphrases, args.sts)
    except (FileNotFoundError, ValueError) as e:
        print(f"rayvl eval: {e}", file=sys.stderr)
        return 2
    if not ray.is_initialized():
        import os

        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    results = run_eval(str(ckpt), tasks, sources, args.out or None, actors=args.actors,
                       cpus_per_actor=args.cpus_per_actor, k=args.k, limit=args.limit)
    print(f"checkpoint {ckpt}\ndata {sources.data} ({sources.kind})")
    print(format_tables(results))
    print(f"\nresults: {Path(args.out) if args.out else ckpt.parent / 'eval'}")
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
    e = sub.add_parser("eval", help="evaluate a checkpoint: zero-shot, retrieval, paraphrase, STS, linear probe")
    e.add_argument("--checkpoint", required=True, help="a checkpoint directory or a run directory (its latest)")
    e.add_argument("--tasks", default="zeroshot,retrieval,paraphrase,sts,linear_probe")
    e.add_argument("--data", default="", help="img2dataset shards, an ImageFolder tree or Fashion-MNIST IDX files "
                                              "(default: the checkpoint's held-out data)")
    e.add_argument("--kind", default="auto", choices=["auto", "shards", "imagefolder", "fashion-mnist"])
    e.add_argument("--classes", default="", help="JSON {classes, templates} for zero-shot")
    e.add_argument("--paraphrases", default="", help="JSON lines {caption, paraphrase[, expansions]}")
    e.add_argument("--sts", default="", help="TSV sentence1, sentence2, score")
    e.add_argument("--out", default="", help="output directory (default: <run>/eval)")
    e.add_argument("--actors", type=int, default=1, help="embedding actors (Ray Data actor pool size)")
    e.add_argument("--cpus-per-actor", type=float, default=0.5)
    e.add_argument("--k", type=int, default=10, help="k of AO@k / JS@k")
    e.add_argument("--limit", type=int, default=0, help="use only the first N Fashion-MNIST images")
    a = sub.add_parser("assets", help="offline assets").add_subparsers(dest="assets_command", required=True)
    a.add_parser("fetch", help="unpack Debian data packages (Fashion-MNIST) into the environment")
    a.add_parser("check", help="verify that the pretrained towers load offline")
    args = p.parse_args(argv)

    if args.command == "train":
        argv = list(argv if argv is not None else sys.argv[1:])[1:]
        return run_recipe(args.config, argv)
    if args.command == "eval":
        return eval_main(args)
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
