"""`rayvl ...` subcommands. Jobs (jobs/*.py) call `run_recipe` with their recipe file."""
from __future__ import annotations

import argparse
import os
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


def run_comparison(default_config: str, variants: dict[str, list[str]], rows: list[tuple[str, str, str]],
                   argv: list[str] | None = None, defaults=None, after=None) -> int:
    """Train the same recipe once per variant (same data, seed and steps; each variant adds its own --set
    overrides) and print the evaluations side by side. ``rows``: (label, metric key, format).
    ``defaults(args)`` may return overrides applied before the user's --set (e.g. a demo data split);
    ``after(result)`` may return more metrics for a finished run (e.g. a second evaluation set)."""
    import time

    p = argparse.ArgumentParser(description=f"rayvl comparison {Path(default_config).stem}: {', '.join(variants)}")
    add_train_args(p, default_config)
    args = p.parse_args(argv)
    try:
        configs = {}
        base = defaults(args) if defaults else []
        for name, overrides in variants.items():
            args_v = argparse.Namespace(**{**vars(args), "set": base + list(args.set) + overrides})
            configs[name] = config_from_args(args_v)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from rayvl.train.trainer import caption_stats, format_data_report, train

    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = {}
    for name, cfg in configs.items():
        cfg.train.run_name = f"{cfg.train.run_name or cfg.recipe + '-' + stamp}-{name}"
        print(f"\n== {name}: training {cfg.train.run_name} ==", flush=True)
        try:
            result = train(cfg)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        print(format_data_report(result.data_report))
        results[name] = {**result.metrics, **caption_stats(result.data_report["counts"]),
                         **(after(result) if after else {}), "run_dir": str(result.run_dir)}
    print(f"\n== {Path(default_config).stem}: held-out evaluation side by side ==")
    print(format_side_by_side(results, rows))
    for name, r in results.items():
        print(f"{name}: {r['run_dir']}")
    return 0


def format_side_by_side(results: dict[str, dict], rows: list[tuple[str, str, str]]) -> str:
    names = list(results)
    table = [("", *names)] + [(label, *(format(results[n][key], fmt) if key in results[n] else "-" for n in names))
                              for label, key, fmt in rows]
    width = max(len(r[0]) for r in table)
    cols = [max(len(r[i]) for r in table) for i in range(1, len(names) + 1)]
    return "\n".join(f"{r[0]:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(r[1:], cols)) for r in table)


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
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    results = run_eval(str(ckpt), tasks, sources, args.out or None, actors=args.actors,
                       cpus_per_actor=args.cpus_per_actor, k=args.k, limit=args.limit)
    print(f"checkpoint {ckpt}\ndata {sources.data} ({sources.kind})")
    print(format_tables(results))
    print(f"\nresults: {Path(args.out) if args.out else ckpt.parent / 'eval'}")
    return 0


def bow_preview(args) -> int:
    """The configured cascade on the first N captions: what a user reads before committing to a BoW run."""
    import tempfile

    from rayvl.data import bow
    from rayvl.data.shards import DataPlaneError, iter_tar_samples, resolve_shards
    from rayvl.data.text import validate_caption

    try:
        cfg = load_config(args.config, list(args.set))
        data = args.data
        if not data:
            from rayvl.data.demo import ensure_demo

            data = str(ensure_demo(cfg.data.demo_dir, cfg.data.demo_samples, cfg.data.demo_eval_samples,
                                   seed=cfg.train.seed) / "train")
        paths = resolve_shards(data)
    except (ConfigError, DataPlaneError) as e:
        print(f"rayvl bow preview: {e}", file=sys.stderr)
        return 2
    from rayvl.train.trainer import bow_deformer

    cfg.bow.enabled = True  # the preview shows the cascade whether or not the recipe switches it on
    cfg.bow.stats_path = args.stats or str(Path(tempfile.mkdtemp()) / "bow_stats.json")
    if bow.needs_stats(bow.parse_ops(cfg.bow.ops)):  # the statistics pass runs on Ray Data
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        deform = bow_deformer(cfg, data, "")
    except ConfigError as e:
        print(f"rayvl bow preview: {e}", file=sys.stderr)
        return 2
    ops = deform.ops
    print(f"cascade: {' + '.join(op.name + (f'({op.arg})' if op.arg is not None else '') for op in ops)}; "
          f"base split {cfg.bow.base_fraction:.0%}\n")
    shown = before = after = emptied = 0
    for path in paths:
        with _open(path) as f:
            for sample in iter_tar_samples(f, ("key", "txt")):
                text, reason = validate_caption(sample.get("txt"))
                if reason:
                    continue
                out, base = deform(sample["key"], text)
                note = "  (base: intact)" if base else ("  (emptied: sample dropped)" if not out else "")
                print(f"{sample['key']}: {text}\n{'':>{len(sample['key'])}}  → {out}{note}")
                shown += 1
                before += len(text.split())
                after += len(out.split())
                emptied += not out
                if shown >= args.n:
                    break
        if shown >= args.n:
            break
    kept = max(1, shown - emptied)
    print(f"\n{shown} captions: {before / max(1, shown):.1f} → {after / kept:.1f} words on average, "
          f"{emptied} emptied")
    return 0


def _open(path: str):
    if "://" not in path:
        return open(path, "rb")
    import pyarrow.fs as pafs

    fs, inner = pafs.FileSystem.from_uri(path)
    return fs.open_input_stream(inner)


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
    b = sub.add_parser("bow", help="Bag-of-Words caption deformation").add_subparsers(dest="bow_command",
                                                                                         required=True)
    bp = b.add_parser("preview", help="print intact → deformed captions of the first N samples")
    bp.add_argument("--data", default="", help="img2dataset shards (default: the embedded demo's training split)")
    bp.add_argument("-n", type=int, default=20, help="samples to show")
    bp.add_argument("--config", default=str(REPO / "configs" / "bow_pretrain.yaml"), help="recipe with a bow section")
    bp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. --set 'bow.ops=[shuffle]'")
    bp.add_argument("--stats", default="", help="statistics artifact to reuse or write (default: computed, not saved)")
    a = sub.add_parser("assets", help="offline assets").add_subparsers(dest="assets_command", required=True)
    a.add_parser("fetch", help="unpack Debian data packages (Fashion-MNIST) into the environment")
    a.add_parser("check", help="verify that the pretrained towers load offline")
    args = p.parse_args(argv)

    if args.command == "train":
        argv = list(argv if argv is not None else sys.argv[1:])[1:]
        return run_recipe(args.config, argv)
    if args.command == "eval":
        return eval_main(args)
    if args.command == "bow":
        return bow_preview(args)
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
        from rayvl.data.bow import stopwords

        print("nltk English stopwords:", len(stopwords()), "words")
        if assets.nltk_data_dir() is not None:
            from rayvl.data.ontology import wordnet

            print("WordNet:", wordnet().get_version(), "e.g. puppies →", wordnet().morphy("puppies", "n"))
        else:
            print("WordNet: not installed (rayvl assets fetch)")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
