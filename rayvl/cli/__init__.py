"""`rayvl ...` subcommands: one argparse parser per command, built once; the work lives in the modules named here
(a method's own commands in its ``commands`` module: ``plugins.add_commands``).
An option that sets a config field defaults to None, so that the config's own default applies (the help shows it);
every mistake a user can fix ends as ``rayvl: error: <one line>`` with exit status 2."""
from __future__ import annotations

import sys

import rayvl
from rayvl import plugins
from rayvl.config import EVAL_CPU_BATCH, EVAL_GPU_BATCH, DataConfig, EvalConfig
from rayvl.cli.recipes import (CONFIGS, USER_ERRORS, RayvlParser, add_train_args, config_from_args,
                           gpu_errors_in_one_line, print_dry_run, train_command, user_error)
from rayvl.eval.linear_probe import ProbeSettings

# commands that start no distributed work: a missing file or a bad value they raise comes from the command line
LOCAL_COMMANDS = ("plot", "export")
# `rayvl check NAME ARGS`: the module whose main(ARGS) runs the check, and its line in `rayvl check --help`
CHECKS = {"gpu": ("rayvl.checks.gpu", "does rayvl train, label and evaluate on this machine's GPUs, and how fast "
                                      "against a hand-written loop (exit status 2 without a GPU)"),
          "census": ("rayvl.checks.census", "what one training step asks of the host (aten ops, kernel launches, "
                                            "syncs), counted on a CPU")}


def build_parser() -> RayvlParser:
    p = RayvlParser(prog="rayvl", description="Train, evaluate and export CLIP-style dual encoders on Ray.")
    p.add_argument("--version", action="version", version=f"rayvl {rayvl.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    t = sub.add_parser("train", help="train a dual encoder (default recipe: laion_adapt)")
    add_train_args(t, str(CONFIGS / "laion_adapt.yaml"))
    _data_parser(sub)
    _config_parser(sub)
    _eval_parser(sub)
    _tune_parser(sub)
    pl = sub.add_parser("plot", help="a run's dashboard PNG (also of a run still going); several runs: one "
                                      "dashboard with a line per run")
    pl.add_argument("runs", nargs="+", metavar="RUN", help="run directories, run names or latest")
    pl.add_argument("--out", default=None, help="output folder (default: <run>/plots; required for several runs)")
    ex = sub.add_parser("export", help="write a run's model as safetensors + config + tokenizer + model card")
    ex.add_argument("run", metavar="RUN", help="a run directory (its newest checkpoint), a checkpoint, a run's name "
                                                "(under ~/rayvl-runs, or wherever this machine started it), or "
                                                "latest")
    ex.add_argument("--out", required=True, help="the export folder (rayvl.load reads it)")
    plugins.add_commands(sub)  # the methods' own: `rayvl bow`, `rayvl pseudo-label` ([BoW])
    a = sub.add_parser("assets", help="offline assets").add_subparsers(dest="assets_command", required=True,
                                                                       metavar="ACTION")
    a.add_parser("fetch", help="unpack Debian data packages (Fashion-MNIST) into the environment")
    a.add_parser("check", help="verify that the pretrained towers load offline")
    _check_parser(sub)
    return p


def _check_parser(sub) -> None:
    """`rayvl check` in the command list and its help; main() hands `rayvl check NAME ...` to the check before this
    parser reads it, so the check's options and its --help are its own."""
    c = sub.add_parser("check", help="checks of this machine: its GPUs, a training step's host work").add_subparsers(
        dest="check_command", required=True, metavar="CHECK")
    for name, (_, text) in CHECKS.items():
        c.add_parser(name, help=f"{text}; `rayvl check {name} --help` lists its options", add_help=False)


def _data_parser(sub) -> None:
    data = sub.add_parser("data", help="dataset utilities").add_subparsers(dest="data_command", required=True,
                                                                           metavar="ACTION")
    dc = data.add_parser("check", help="what a shard spec holds: shard count, samples from img2dataset's files, "
                                       "the first samples decoded with the reasons any would be dropped")
    dc.add_argument("spec", help="shards as --data takes them, e.g. 's3://bucket/laion/{00000..41407}.tar'")
    dc.add_argument("-n", type=int, default=8, help="samples of the first shard to decode (default: 8)")
    d = DataConfig()
    demo = data.add_parser("demo", help="write the embedded demo dataset in img2dataset layout")
    demo.add_argument("--out", required=True, help="the folder to write (train/, eval/ and the text sets)")
    demo.add_argument("--samples", type=int, default=None,
                      help=f"training samples (default: data.demo_samples, {d.demo_samples})")
    demo.add_argument("--eval-samples", type=int, default=None,
                      help=f"held-out samples (default: data.demo_eval_samples, {d.demo_eval_samples})")
    demo.add_argument("--seed", type=int, default=None, help="generator seed (default: the one every run's demo "
                                                             "uses)")
    demo.add_argument("--shard-size", type=int, default=None, help="samples per shard (default: 1000)")


def _config_parser(sub) -> None:
    c = sub.add_parser("config", help="the resolved config").add_subparsers(dest="config_command", required=True,
                                                                          metavar="SUBCOMMAND")
    show = c.add_parser("show", help="print the config a `rayvl train` with these options would run, as YAML with "
                                     "each key's meaning above it (itself a recipe: --config FILE)")
    add_train_args(show, str(CONFIGS / "laion_adapt.yaml"))


def config_main(args) -> int:
    from rayvl.annotated import show

    print(show(config_from_args(args)), end="")
    return 0


def _eval_parser(sub) -> None:
    d = EvalConfig()
    e = sub.add_parser("eval", help="evaluate a checkpoint: zero-shot, retrieval, paraphrase, STS, linear probe; "
                                    "unset options take the run's eval section")
    e.add_argument("run", metavar="RUN", help="a run directory (its newest checkpoint) or a checkpoint, local or a "
                                              "URL; a run's name (under ~/rayvl-runs, or wherever this machine "
                                              "started it); latest; or a whole CLIP as it is (an OpenAI .pt, an "
                                              "open_clip checkpoint, a Hugging Face CLIP folder): the scores a run "
                                              "from it starts at")
    e.add_argument("--set", action="append", default=[], metavar="eval.KEY=VALUE",
                   help="any eval.* setting of the checkpoint's, e.g. --set eval.batch_size=512 (the options below "
                        "win where both are given)")
    e.add_argument("--tasks", default=None, metavar="A,B,...",
                   help=f"comma list of tasks (default: eval.checkpoint_tasks, {','.join(d.checkpoint_tasks)})")
    e.add_argument("--data", action="append", default=[],
                   help="img2dataset shards, a CLIP_benchmark webdataset set (its folder: the test split; or a "
                        "split's folder), an ImageFolder tree or Fashion-MNIST IDX files (default: the checkpoint's "
                        "held-out data). Repeat it for several sets, each scored by the same warm model into "
                        "<out>/<set's folder name>/, with a summary of all")
    e.add_argument("--kind", default="auto",
                   choices=["auto", "shards", "clip_benchmark", "imagefolder", "fashion-mnist"],
                   help="what --data holds (default: auto, told from the files)")
    e.add_argument("--classes", default="", help="JSON {classes, templates}, or CLIP_benchmark's classnames.txt, "
                                                 "for zero-shot (default: the run's, or the CLIP_benchmark set's)")
    e.add_argument("--paraphrases", default="", help="JSON lines {caption, paraphrase[, expansions]} (default: "
                                                     "the run's)")
    e.add_argument("--sts", default="", help="TSV sentence1, sentence2, score (default: the run's)")
    e.add_argument("--out", default="", help="output directory (default: <run>/eval)")
    e.add_argument("--gpus", type=float, default=None, metavar="N",
                   help="GPUs per embedding actor, at most 1 (0: embed on CPU in fp32; 1: an actor per GPU, in bf16 "
                        "autocast; 0.5: two actors share a GPU). GPUs used = --actors × N. The tasks' "
                        "nearest-neighbour searches run on every GPU this process sees "
                        f"(default: eval.gpus_per_actor, {d.gpus_per_actor:g})")
    e.add_argument("--actors", type=int, default=None,
                   help="embedding actors (Ray Data actor pool size; 0: 1 on CPU, with --gpus as many as the "
                        f"cluster's GPUs hold now; default: eval.actors, {d.actors}). With no cluster named "
                        "(RAY_ADDRESS) and one model to run — 0 or 1 actors on CPU, or with --gpus a machine's "
                        "only GPU — the model embeds in this process, fed by --workers loader processes, and no Ray "
                        "starts")
    e.add_argument("--cpus-per-actor", type=float, default=None,
                   help="CPUs each embedding actor reserves, and each read task (default: eval.cpus_per_actor, "
                        f"{d.cpus_per_actor:g})")
    e.add_argument("--workers", type=int, default=None,
                   help="without Ray (see --actors): the loader processes that read and decode (0: this machine's "
                        f"CPUs − 1; default: eval.loader_workers, {d.loader_workers})")
    e.add_argument("--batch-size", type=int, default=None,
                   help=f"images per actor call, texts 4× as many (0: {EVAL_GPU_BATCH:,} on a GPU, "
                        f"{EVAL_CPU_BATCH} on CPU; default: eval.batch_size, {d.batch_size})")
    e.add_argument("--decode", default=None, choices=["auto", "cpu", "device"],
                   help="where held-out shards' JPEGs are decoded: cpu (Ray Data's read tasks, or the loader's "
                        "workers), device (the embedding model's GPU, by nvJPEG: the read tasks keep them encoded), "
                        f"auto (the device where the model has a GPU); default: eval.decode, {d.decode}")
    e.add_argument("--k", type=int, default=None, help=f"k of AO@k / JS@k (default: eval.paraphrase_k, "
                                                       f"{d.paraphrase_k})")
    e.add_argument("--limit", type=int, default=0, help="use only the first N Fashion-MNIST images (default: all)")
    _probe_options(e)
    e.add_argument("--verbose", action="store_true", help="show Ray's and the actors' own output")


def _probe_options(e) -> None:
    """The linear probe's options: CLIP_benchmark's, by its names and defaults (rayvl.eval.linear_probe)."""
    d = ProbeSettings()
    probe = e.add_argument_group("linear probe", "with --tasks linear_probe on a CLIP_benchmark set that has a train "
                                 "split: CLIP_benchmark's protocol, trained on that split's images (otherwise a "
                                 "logistic regression on a split of the evaluated set's own labelled images)")
    probe.add_argument("--train-split", default=None, metavar="NAME",
                       help=f"the set's split the probe trains on (default: {d.train_split}, where the set has it; "
                            "none: the evaluated set's own split)")
    probe.add_argument("--fewshot-k", type=int, metavar="K", default=d.fewshot_k,
                       help=f"images of each class it trains on, -1 every one (default: {d.fewshot_k})")
    probe.add_argument("--fewshot-epochs", type=int, metavar="N", default=d.epochs, help=f"epochs (default: {d.epochs})")
    probe.add_argument("--fewshot-lr", type=float, metavar="LR", default=d.lr, help=f"AdamW's learning rate (default: {d.lr:g})")
    probe.add_argument("--probe-batch-size", type=int, metavar="N", default=d.batch_size,
                       help=f"features a step (default: {d.batch_size})")
    probe.add_argument("--val-proportion", type=float, metavar="P", default=d.val_proportion,
                       help="a share of the train split held out to search the weight decay on (default: 0, no "
                            "search: weight decay 0)")
    probe.add_argument("--seed", type=int, metavar="N", default=d.seed, help=f"the probe's seed (default: {d.seed})")


def _probe(args, tasks: list[str]) -> tuple[ProbeSettings, str]:
    """(the probe's settings, the split default_sources looks for: '' when none is to be read)."""
    probe = ProbeSettings(args.train_split or ProbeSettings.train_split, args.fewshot_k, args.fewshot_epochs,
                          args.fewshot_lr, args.probe_batch_size, args.val_proportion, args.seed)
    probe.check()
    wanted = "linear_probe" in tasks and probe.train_split != "none"
    return probe, probe.train_split if wanted else ""


def _tune_parser(sub) -> None:
    tu = sub.add_parser("tune", help="hyperparameter sweep over a tune_spaces/*.yaml search space (Ray Tune)")
    tu.add_argument("space", nargs="?", help="search-space YAML, e.g. tune_spaces/alignment_depth.yaml")
    tu.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field of every trial (after the space's own `set`)")
    tu.add_argument("--name", default="", help="sweep name (default: the space file's name)")
    tu.add_argument("--resume", action="store_true", help="continue an interrupted sweep of that name")
    tu.add_argument("--report", default="", metavar="DIR", help="only print and write the report of a sweep "
                                                                 "directory (finished or interrupted)")
    tu.add_argument("--dry-run", action="store_true", help="check the space, the config and the data and print "
                                                           "what it would do, without starting Ray")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"] and argv[1:2] and argv[1] in CHECKS:  # the check parses its own options
        return check_main(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    from rayvl.session import setup_logging

    setup_logging(verbose=args.command == "tune" or getattr(args, "verbose", False))  # a sweep shows Tune's table
    commands = {"train": train_command, "eval": eval_main, "data": data_main, "config": config_main,
                "assets": assets_main, "tune": tune_main, "plot": plot_main, "export": export_main}
    try:
        return (commands.get(args.command) or method_command(args))(args)
    except USER_ERRORS as e:  # a config key, a data spec, a missing asset: one line naming it, before Ray starts
        return user_error(e)
    except (FileNotFoundError, ValueError) as e:  # elsewhere these may be bugs: their traceback is kept
        if args.command not in LOCAL_COMMANDS:
            raise
        return user_error(e)


def method_command(args):
    """The main a method's parser named (Method.commands: ``set_defaults(method_command=main)``)."""
    found = getattr(args, "method_command", None)
    if found is None:
        raise RuntimeError(f"rayvl {args.command}: its method's parser names no main (set_defaults(method_command=))")
    return found


def check_main(name: str, argv: list[str]) -> int:
    """`rayvl check NAME ARGV`: the check's own main, imported only now (the GPU check says there is no GPU before it
    starts anything)."""
    import importlib

    return importlib.import_module(CHECKS[name][0]).main(argv)


def eval_main(args) -> int:
    from rayvl import session
    from rayvl.checkpoints import checkpoint_uri, read_meta
    from rayvl.eval.embed import check_gpus
    from rayvl.eval.runner import HEADLINE, default_out, default_sources, headline, run_eval, set_names, settings
    from rayvl.eval.tables import format_side_by_side, format_tables
    from rayvl.train.run_dir import find_run

    try:  # everything the command line names, checked before any embedding
        ckpt = checkpoint_uri(find_run(args.run))  # a path or a URL (s3://, gs://, ...), a run's name, latest
        config = read_meta(ckpt)["config"]
        flags = dict(actors=args.actors, cpus_per_actor=args.cpus_per_actor, gpus_per_actor=args.gpus,
                     batch_size=args.batch_size, paraphrase_k=args.k, loader_workers=args.workers,
                     decode=args.decode)
        pool = settings(config, **{**_eval_sets(args.set), **{k: v for k, v in flags.items() if v is not None}})
        tasks = _tasks(args.tasks, pool)
        _check_pool(pool)
        probe, split = _probe(args, tasks)
        texts = (args.kind, args.classes, args.paraphrases, args.sts, split)
        sources = ({name: default_sources(config, data, *texts) for name, data in zip(set_names(args.data), args.data)}
                   if len(args.data) > 1 else default_sources(config, "".join(args.data), *texts))
        _check_train_split(args.train_split, split, sources)
        gpus = pool.gpus_per_actor
        without_ray = session.runs_without_ray(pool.actors, gpus)
        if not without_ray:
            started = session.connect(verbose=args.verbose, include_dashboard=False)
            check_gpus(gpus, f"--gpus {gpus:g}", "--gpus 0", fixed_size=started)
    except (FileNotFoundError, ValueError) as e:
        return user_error(e)
    results = gpu_errors_in_one_line(lambda: run_eval(
        ckpt, tasks, sources, args.out or None, actors=pool.actors, cpus_per_actor=pool.cpus_per_actor,
        batch_size=pool.batch_size, k=pool.paraphrase_k, limit=args.limit, gpus_per_actor=gpus,
        without_ray=without_ray, loader_workers=pool.loader_workers, decode=pool.decode, probe=probe))
    if results is None:
        return 1
    print(f"checkpoint {ckpt}")
    for name, one in (sources.items() if isinstance(sources, dict) else [("", sources)]):
        print(f"\n##### {name}" if name else "", f"data {one.data} ({one.kind})", sep="\n" if name else "")
        print(format_tables(results[name] if name else results))
    if isinstance(sources, dict):
        print("\n##### summary\n" + format_side_by_side({n: headline(r) for n, r in results.items()},
                                                        [(label, key, ".1f" if key != "images" else "d")
                                                         for label, _, key in HEADLINE]))
    print(f"\nresults: {args.out or default_out(ckpt)}")
    return 0


def _check_train_split(given: str | None, split: str, sources) -> None:
    """--train-split named (not the default): every set must have it."""
    if not given or not split:
        return
    missing = [one.data for one in (sources.values() if isinstance(sources, dict) else [sources])
               if not one.probe_train]
    if missing:
        raise ValueError(f"--train-split {given}: no such split beside {', '.join(missing)} (a CLIP_benchmark set's "
                         f"<root>/{given}/nshards.txt), or it is the split evaluated")


def _eval_sets(overrides: list[str]) -> dict:
    """--set's eval.KEY=VALUE, typed and checked as the config checks them; the checkpoint's model and data are its
    own, so another section is a usage error naming it."""
    from rayvl.config import from_dict, parse_override

    given: dict = {}
    for text in overrides:
        section = parse_override(text)
        if set(section) != {"eval"}:
            raise ValueError(f"--set {text}: rayvl eval takes eval.* keys (the checkpoint's model and data are its "
                             f"own; --data, --classes, ... choose what it evaluates on)")
        given.update(section["eval"])
    typed = from_dict({"eval": given}).eval
    return {key: getattr(typed, key) for key in given}


def _tasks(given: str | None, pool: EvalConfig) -> list[str]:
    """--tasks, else the run's eval.checkpoint_tasks — each one a task `rayvl eval` knows."""
    from rayvl.eval.tasks import TASKS

    source = "--tasks" if given is not None else "eval.checkpoint_tasks"
    tasks = [t.strip() for t in given.split(",") if t.strip()] if given is not None else list(pool.checkpoint_tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"{source}: unknown {bad or 'none given'} (known: {', '.join(TASKS)})")
    return tasks


def _check_pool(pool: EvalConfig) -> None:
    if not 0 <= pool.gpus_per_actor <= 1:  # an actor's model runs on one GPU: more GPUs make more actors (--actors)
        raise ValueError(f"--gpus {pool.gpus_per_actor:g} (eval.gpus_per_actor): GPUs per embedding actor, from 0 "
                         f"to 1 (more GPUs: more --actors)")
    if pool.actors < 0 or pool.batch_size < 1 or pool.cpus_per_actor < 0 or pool.loader_workers < 0:
        raise ValueError("--actors, --cpus-per-actor, --workers, --batch-size (eval.actors, eval.cpus_per_actor, "
                         "eval.loader_workers, eval.batch_size) must be ≥ 0 (--batch-size 0: by the device)")


def tune_main(args) -> int:
    from rayvl.sweeps.comparison_report import variants_report
    from rayvl.sweeps.spaces import load_sweep

    if args.report:
        from rayvl import storage
        from rayvl.sweeps.directory import SWEEP_FILE
        from rayvl.sweeps.reports import write_report

        if not storage.is_file(storage.join(storage.normalize(args.report), SWEEP_FILE)):
            return user_error(f"--report {args.report}: not a sweep's directory (it has no {SWEEP_FILE}, which "
                              f"`rayvl tune SPACE` writes in the directory of each sweep)")
        # no Ray: Tune's ExperimentAnalysis (Ray 2.60) reads the experiment state and the trials' results from storage
        print(write_report(args.report)[0] + variants_report(args.report))
        return 0
    if not args.space:
        return user_error("tune: give a search-space file (tune_spaces/*.yaml) or --report DIR")
    if args.dry_run:
        from rayvl import dry_run

        return print_dry_run(lambda: dry_run.describe_sweep(load_sweep(args.space, args.set), args.name))
    from rayvl.sweeps.runner import sweep_and_report

    sweep = load_sweep(args.space, args.set)  # every key and domain checked before Ray starts
    variants = variants_report(sweep_and_report(sweep, name=args.name, resume=args.resume))
    if variants:  # a space with variants is a comparison: mean ± std per variant over the other keys
        print(variants)
    return 0


def plot_main(args) -> int:
    from pathlib import Path

    from rayvl.plots import history, plot_run, plot_runs
    from rayvl.train.run_dir import find_run

    args.runs = [find_run(r) for r in args.runs]
    if len(args.runs) == 1:
        drawn = plot_run(args.runs[0], args.out)
    elif not args.out:
        return user_error("plot: several runs need --out (the folder for their dashboard)")
    else:
        drawn = plot_runs({Path(r.rstrip("/")).name: history(r) for r in args.runs}, args.out)
    print(f"wrote {drawn.path}: {len(drawn.panels)} curves"
          + (f", {len(drawn.table)} metrics reported once in a table" if drawn.table else ""))
    return 0


def export_main(args) -> int:
    from rayvl.export import export
    from rayvl.train.run_dir import find_run

    args.run = find_run(args.run)
    out = export(args.run, args.out)
    print(f"exported {args.run} → {out} (load it with rayvl.load({str(out)!r}))")
    return 0


def data_main(args) -> int:
    if args.data_command == "check":
        from rayvl import dry_run

        return print_dry_run(lambda: dry_run.check_data(args.spec, args.n))
    from rayvl.data.demo import DEMO_SEED, write_demo

    d = DataConfig()
    samples = d.demo_samples if args.samples is None else args.samples
    eval_samples = d.demo_eval_samples if args.eval_samples is None else args.eval_samples
    shards = {} if args.shard_size is None else {"shard_size": args.shard_size}
    out = write_demo(args.out, samples, eval_samples, DEMO_SEED if args.seed is None else args.seed, **shards)
    print(f"wrote demo dataset: {out} ({samples} train, {eval_samples} held-out)")
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
        from rayvl.data.wordnet import wordnet
        from rayvl.data.text import stopwords

        print(f"nltk English stopwords: {len(stopwords())} words; WordNet {wordnet().get_version()}: "
              f"puppies → {wordnet().morphy('puppies', 'n')}")
    if missing:  # a check that failed (status 1), not a mistake on the command line
        print(f"rayvl: error: missing {', '.join(missing)} — run `rayvl assets fetch` (make install does)",
              file=sys.stderr)
    return 1 if missing else 0
