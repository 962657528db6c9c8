"""`rayvl ...` subcommands: parse the command line and dispatch (the work lives in the modules named here)."""
from __future__ import annotations

import argparse
import sys

from rayvl.config import ConfigError, load_config
from rayvl.recipes import CONFIGS, add_train_args, data_cause, dry_run, one_line, run_recipe


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayvl")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a dual encoder (default recipe: laion_adapt)")
    add_train_args(t, str(CONFIGS / "laion_adapt.yaml"))
    data = sub.add_parser("data", help="dataset utilities").add_subparsers(dest="data_command", required=True)
    dc = data.add_parser("check", help="what a shard spec holds: shard count, samples from img2dataset's files, "
                                       "the first samples decoded with the reasons any would be dropped")
    dc.add_argument("spec", help="shards as --data takes them, e.g. 's3://bucket/laion/{00000..41407}.tar'")
    dc.add_argument("-n", type=int, default=8, help="samples of the first shard to decode")
    demo = data.add_parser("demo", help="write the embedded demo dataset in img2dataset layout")
    demo.add_argument("--out", required=True)
    demo.add_argument("--samples", type=int, default=4000)
    demo.add_argument("--eval-samples", type=int, default=500)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--shard-size", type=int, default=1000)
    _eval_parser(sub)
    b = sub.add_parser("bow", help="Bag-of-Words caption deformation").add_subparsers(dest="bow_command",
                                                                                         required=True)
    bp = b.add_parser("preview", help="print intact → deformed captions of the first N samples")
    bp.add_argument("--data", default="", help="img2dataset shards (default: the embedded demo's training split)")
    bp.add_argument("-n", type=int, default=20, help="samples to show")
    bp.add_argument("--config", default=str(CONFIGS / "bow_pretrain.yaml"), help="recipe with a bow section")
    bp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. --set 'bow.ops=[shuffle]'")
    bp.add_argument("--stats", default="", help="statistics artifact to reuse or write (default: computed, not saved)")
    tu = sub.add_parser("tune", help="hyperparameter sweep over a tune_spaces/*.yaml search space (Ray Tune)")
    tu.add_argument("space", nargs="?", help="search-space YAML, e.g. tune_spaces/alignment_depth.yaml")
    tu.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field of every trial (after the space's own `set`)")
    tu.add_argument("--name", default="", help="sweep name (default: the space file's name)")
    tu.add_argument("--resume", action="store_true", help="continue an interrupted sweep of that name")
    tu.add_argument("--report", default="", metavar="DIR", help="only print and write the report of a sweep "
                                                                 "directory (finished or interrupted)")
    tu.add_argument("--dry-run", action="store_true", help="check the space, the config and the data and print "
                                                           "the plan, without starting Ray")
    pl = sub.add_parser("plot", help="PNG plots of a run's metrics (also of a run still going); several runs: "
                                      "one figure per metric with a line per run")
    pl.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    pl.add_argument("--out", default="", help="output folder (default: <run>/plots; required for several runs)")
    ex = sub.add_parser("export", help="write a run's model as safetensors + config + tokenizer + model card")
    ex.add_argument("run", metavar="RUN", help="a run directory (its newest checkpoint) or a checkpoint")
    ex.add_argument("--out", required=True, help="the export folder (rayvl.load reads it)")
    _pseudo_label_parser(sub)
    a = sub.add_parser("assets", help="offline assets").add_subparsers(dest="assets_command", required=True)
    a.add_parser("fetch", help="unpack Debian data packages (Fashion-MNIST) into the environment")
    a.add_parser("check", help="verify that the pretrained towers load offline")
    return p


def _eval_parser(sub) -> None:
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
    e.add_argument("--gpus", type=float, default=0.0, metavar="N",
                   help="GPUs per embedding actor, at most 1 (0: embed on CPU in fp32; 1: an actor per GPU, in bf16 "
                        "autocast; 0.5: two actors share a GPU). GPUs used = --actors × N. The tasks' "
                        "nearest-neighbour searches run on every GPU this process sees")
    e.add_argument("--actors", type=int, default=0,
                   help="embedding actors (Ray Data actor pool size; default: 1 on CPU, with --gpus as many as "
                        "the cluster's GPUs hold now)")
    e.add_argument("--cpus-per-actor", type=float, default=0.5)
    e.add_argument("--batch-size", type=int, default=128, help="images or texts per actor call")
    e.add_argument("--k", type=int, default=10, help="k of AO@k / JS@k")
    e.add_argument("--limit", type=int, default=0, help="use only the first N Fashion-MNIST images")
    e.add_argument("--verbose", action="store_true", help="show Ray's and the actors' own output")


def _pseudo_label_parser(sub) -> None:
    ps = sub.add_parser("pseudo-label", help="pseudo-BoW captions for images without captions ([BoW] §2.3): "
                                              "new shards to train on beside the aligned ones")
    ps.add_argument("--checkpoint", default=None, help="the labelling model: a run directory or a checkpoint")
    ps.add_argument("--aligned", default=None, help="S_a: the aligned shards whose captions are retrieved")
    ps.add_argument("--unaligned", default=None, help="the images to label: shards or a folder of image files")
    ps.add_argument("--out", default=None, help="output folder: <out>/<rule>/ shards, <out>/index/")
    ps.add_argument("--rules", default=None, help="comma list of max_count, rm_top_max_count, rm_top_rand, "
                                                  "weighted_count (default: weighted_count)")
    ps.add_argument("--config", default=None, help="a YAML with a pseudo_label section (optional)")
    ps.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any config field, e.g. --set pseudo_label.crops=10 --set pseudo_label.k=5")
    ps.add_argument("--verbose", action="store_true", help="show Ray's and the actors' own output")
    ps.add_argument("--dry-run", action="store_true", help="check the inputs and print the plan, without "
                                                           "starting Ray")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "train":
        return run_recipe(args.config, argv[1:])
    from rayvl.session import setup_logging

    setup_logging(verbose=args.command == "tune" or getattr(args, "verbose", False))  # a sweep shows Tune's table
    commands = {"eval": eval_main, "bow": bow_main, "data": data_main, "assets": assets_main, "tune": tune_main,
                "plot": plot_main, "export": export_main, "pseudo-label": pseudo_label_main}
    if args.command not in ("plot", "export"):
        return commands[args.command](args)
    try:
        return commands[args.command](args)
    except (FileNotFoundError, ValueError) as e:  # a path or a flag the user can fix: one line, status 2
        print(f"rayvl {args.command}: {e}", file=sys.stderr)
        return 2


def eval_main(args) -> int:
    from rayvl import session, storage
    from rayvl.checkpoints import checkpoint_uri, read_meta
    from rayvl.eval.embed import check_gpus
    from rayvl.eval.runner import default_sources, run_eval
    from rayvl.eval.tables import format_tables
    from rayvl.eval.tasks import TASKS

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        print(f"--tasks: unknown {bad} (known: {', '.join(TASKS)})", file=sys.stderr)
        return 2
    try:
        _check_pool_flags(args)
        ckpt = checkpoint_uri(args.checkpoint)  # a local path or a URL (s3://, gs://, file://, ...)
        sources = default_sources(read_meta(ckpt)["config"], args.data, args.kind, args.classes, args.paraphrases,
                                  args.sts)
        started = session.connect(verbose=args.verbose, include_dashboard=False)
        check_gpus(args.gpus, f"--gpus {args.gpus:g}", "--gpus 0", fixed_size=started)  # before any embedding
    except (FileNotFoundError, ValueError) as e:
        print(f"rayvl eval: {e}", file=sys.stderr)
        return 2
    results = _gpu_errors_in_one_line(lambda: run_eval(
        ckpt, tasks, sources, args.out or None, actors=args.actors, cpus_per_actor=args.cpus_per_actor,
        batch_size=args.batch_size, k=args.k, limit=args.limit, gpus_per_actor=args.gpus))
    if results is None:
        return 1
    print(f"checkpoint {ckpt}\ndata {sources.data} ({sources.kind})")
    print(format_tables(results))
    print(f"\nresults: {args.out or storage.join(storage.parent(ckpt), 'eval')}")
    return 0


def _check_pool_flags(args) -> None:
    if not 0 <= args.gpus <= 1:  # an actor's model runs on one GPU: more GPUs make more actors (--actors)
        raise ValueError(f"--gpus {args.gpus:g}: GPUs per embedding actor, from 0 to 1 (more GPUs: more --actors)")
    if args.actors < 0 or args.batch_size < 1 or args.cpus_per_actor < 0:
        raise ValueError("--actors, --cpus-per-actor must be ≥ 0 and --batch-size ≥ 1")


def _gpu_errors_in_one_line(job):
    """``job()``, or None after printing in one line why an actor given a GPU could not use it (NoCudaError)."""
    from rayvl.eval.embed import no_cuda_cause

    try:
        return job()
    except Exception as e:  # anything else is re-raised as it was
        cause = no_cuda_cause(e)
        if cause is None:
            raise
        print(f"rayvl: error: {one_line(cause)}", file=sys.stderr)
        return None


def bow_main(args) -> int:
    from rayvl.bow_preview import preview
    from rayvl.data.report import DataPlaneError

    try:
        preview(load_config(args.config, list(args.set)), args.data, args.n, args.stats)
    except (ConfigError, DataPlaneError) as e:
        print(f"rayvl bow preview: {e}", file=sys.stderr)
        return 2
    return 0


def tune_main(args) -> int:
    from rayvl import tune

    if args.report:
        from rayvl import session

        session.connect("", 1, include_dashboard=False)  # Tune's ExperimentAnalysis reads trials through a session
        print(tune.write_report(args.report)[0])
        _comparison(args.report)
        return 0
    if not args.space:
        print("rayvl tune: give a search-space file (tune_spaces/*.yaml) or --report DIR", file=sys.stderr)
        return 2
    if args.dry_run:
        from rayvl import plan

        return dry_run(lambda: plan.describe_sweep(tune.load_sweep(args.space, args.set)))
    try:
        sweep = tune.load_sweep(args.space, args.set)  # every key and domain checked before Ray starts
        sweep_dir = tune.sweep_and_report(sweep, name=args.name, resume=args.resume)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _comparison(sweep_dir)
    return 0


def _comparison(sweep_dir: str) -> None:
    """A space with variants is a comparison: mean ± std per variant over the other keys (rayvl.compare)."""
    import json

    from rayvl import compare, storage, tune

    settings = json.loads(storage.read_text(storage.join(storage.normalize(sweep_dir), tune.SWEEP_FILE)))
    if settings.get("variants"):
        table, files = compare.write_report(sweep_dir)
        print(f"\n== variants: mean ± std over {', '.join(settings['keys']) or 'one trial each'} ==\n{table}\n"
              f"  files: {', '.join(files)}")


def plot_main(args) -> int:
    from pathlib import Path

    from rayvl.plots import history, plot_run, plot_runs

    if len(args.runs) == 1:
        written = plot_run(args.runs[0], args.out or None)
    elif not args.out:
        raise ValueError("several runs need --out (the folder for the comparison figures)")
    else:
        written = plot_runs({Path(r.rstrip("/")).name: history(r) for r in args.runs}, args.out)
    print(f"wrote {len(written)} plots to {written[0].parent if written else args.out}")
    return 0


def export_main(args) -> int:
    from rayvl.export import export

    out = export(args.run, args.out)
    print(f"exported {args.run} → {out} (load it with rayvl.load({str(out)!r}))")
    return 0


def pseudo_label_main(args) -> int:
    from rayvl import pseudo_label, session

    flags = {"checkpoint": args.checkpoint, "aligned": args.aligned, "unaligned": args.unaligned, "out": args.out}
    overrides = list(args.set) + [f"pseudo_label.{k}={v}" for k, v in flags.items() if v is not None]
    if args.rules:
        overrides.append(f"pseudo_label.rules=[{args.rules}]")
    if args.dry_run:
        from rayvl import plan

        return dry_run(lambda: plan.describe_pseudo_label(load_config(args.config, overrides)))
    try:
        cfg = load_config(args.config, overrides)
        checked = pseudo_label.check(cfg)  # every path named by its key before Ray starts
        started = session.connect(cfg.ray_address, cfg.local_num_cpus, verbose=args.verbose,
                                  include_dashboard=False)
        summary = _gpu_errors_in_one_line(lambda: pseudo_label.run(cfg, fixed_size=started, checked=checked))
    except ConfigError as e:
        print(f"config error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # an unreadable shard (or another data failure) in one line, not an actor's traceback
        cause = data_cause(e)
        if cause is None:
            raise
        print(f"rayvl: error: {one_line(cause)}", file=sys.stderr)
        return 1
    if summary is None:  # an actor given a GPU that torch cannot use, said in one line
        return 1
    print(pseudo_label.format_summary(summary))
    print(f"train on them beside the aligned shards: --data {cfg.pseudo_label.aligned},"
          f"{summary['rules'][cfg.pseudo_label.rules[0]]['shards']}")
    return 0


def data_main(args) -> int:
    from rayvl.data.demo import write_demo

    if args.data_command == "check":
        from rayvl import plan

        return dry_run(lambda: plan.check_data(args.spec, args.n))
    out = write_demo(args.out, args.samples, args.eval_samples, args.seed, args.shard_size)
    print(f"wrote demo dataset: {out} ({args.samples} train, {args.eval_samples} held-out)")
    return 0


def assets_main(args) -> int:
    from rayvl import assets

    if args.assets_command == "fetch":
        done = assets.fetch_debian_packages()
        print(f"assets in {assets.data_root()}: fetched {done or 'nothing new'}")
        return 0
    lines, missing = assets.check()
    print("\n".join(lines))
    if not missing:  # and the language resources read through nltk's own readers
        from rayvl.data.ontology import wordnet
        from rayvl.data.text import stopwords

        print(f"nltk English stopwords: {len(stopwords())} words; WordNet {wordnet().get_version()}: "
              f"puppies → {wordnet().morphy('puppies', 'n')}")
    if missing:
        print(f"rayvl assets check: missing {', '.join(missing)} — run `rayvl assets fetch` (make install does)",
              file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
