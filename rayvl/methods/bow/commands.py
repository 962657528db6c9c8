"""[BoW]'s own commands, added to `rayvl` through its registration (``Method.commands``): `rayvl bow preview`
(intact → deformed captions, §2.2) and `rayvl pseudo-label` (pseudo-BoW captions for images without captions, §2.3),
with the labelling job's dry run."""
from __future__ import annotations

import sys

from rayvl import storage
from rayvl.cli.recipes import CONFIGS, data_cause, gpu_errors_in_one_line, one_line, print_dry_run
from rayvl.config import RayvlConfig, load_config
from rayvl.data.shard_io import ReadPolicy
from rayvl.dry_run import data_lines, sample_lines
from rayvl.methods.bow.config import PseudoLabelConfig


def add_commands(sub) -> None:
    """`rayvl bow ...` and `rayvl pseudo-label`: their parsers, each naming its main (``method_command``)."""
    _bow_parser(sub)
    _pseudo_label_parser(sub)


def _bow_parser(sub) -> None:
    b = sub.add_parser("bow", help="Bag-of-Words caption deformation").add_subparsers(dest="bow_command",
                                                                                         required=True,
                                                                                         metavar="ACTION")
    bp = b.add_parser("preview", help="print intact → deformed captions of the first N samples")
    bp.add_argument("--data", default=None, help="img2dataset shards (default: the embedded demo's training split)")
    bp.add_argument("-n", type=int, default=20, help="samples to show (default: 20)")
    bp.add_argument("--config", default=str(CONFIGS / "bow_pretrain.yaml"),
                    help="recipe with a bow section (default: bow_pretrain.yaml)")
    bp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. --set 'bow.ops=[shuffle]'")
    bp.add_argument("--stats", default=None, help="statistics artifact to reuse or write (default: computed, not "
                                                  "saved)")
    bp.set_defaults(method_command=bow_main)


def _pseudo_label_parser(sub) -> None:
    ps = sub.add_parser("pseudo-label", help="pseudo-BoW captions for images without captions ([BoW] §2.3): "
                                              "new shards to train on beside the aligned ones")
    ps.add_argument("run", nargs="?", default=None, metavar="RUN",
                    help="the labelling model: a run directory, a checkpoint or an export; sets "
                         "pseudo_label.checkpoint (default: the --config's)")
    ps.add_argument("--aligned", default=None, help="S_a: the aligned shards whose captions are retrieved; sets "
                                                    "pseudo_label.aligned")
    ps.add_argument("--unaligned", default=None, help="the images to label: shards or a folder of image files; "
                                                      "sets pseudo_label.unaligned")
    ps.add_argument("--out", default=None, help="output folder: <out>/<rule>/ shards, <out>/index/; sets "
                                                "pseudo_label.out")
    ps.add_argument("--rules", default=None, help="comma list of max_count, rm_top_max_count, rm_top_rand, "
                                                  "weighted_count (default: pseudo_label.rules, "
                                                  f"{','.join(PseudoLabelConfig().rules)})")
    ps.add_argument("--config", default=None, help="a YAML with a pseudo_label section (optional)")
    ps.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any config field, e.g. --set pseudo_label.crops=10 --set pseudo_label.k=5")
    ps.add_argument("--verbose", action="store_true", help="show Ray's and the actors' own output")
    ps.add_argument("--dry-run", action="store_true", help="check the inputs and print what the job would do, without "
                                                           "starting Ray")
    ps.set_defaults(method_command=pseudo_label_main)


def bow_main(args) -> int:
    from rayvl.methods.bow.preview import preview

    preview(load_config(args.config, list(args.set)), args.data or "", args.n, args.stats or "")
    return 0


def pseudo_label_main(args) -> int:
    from rayvl import session
    from rayvl.methods.bow import pseudo_label

    flags = {"checkpoint": args.run, "aligned": args.aligned, "unaligned": args.unaligned, "out": args.out}
    overrides = list(args.set) + [f"pseudo_label.{k}={v}" for k, v in flags.items() if v is not None]
    if args.rules:
        overrides.append(f"pseudo_label.rules=[{args.rules}]")
    if args.dry_run:
        return print_dry_run(lambda: describe_pseudo_label(load_config(args.config, overrides)))
    cfg = load_config(args.config, overrides)
    checked = pseudo_label.check(cfg)  # every path named by its key before Ray starts
    x = cfg.pseudo_label
    without_ray = session.runs_without_ray(x.actors, x.gpus_per_actor, cfg.ray_address)
    started = not without_ray and session.connect(cfg.ray_address, cfg.local_num_cpus, verbose=args.verbose,
                                                  include_dashboard=False)
    try:
        summary = gpu_errors_in_one_line(lambda: pseudo_label.run(cfg, fixed_size=started, checked=checked,
                                                                   without_ray=without_ray))
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


def labellers_line(cfg: RayvlConfig) -> str:
    """Who labels: the actors of a Ray, or the one labeller in the command's process (session.runs_without_ray)."""
    from rayvl.methods.bow import pseudo_label
    from rayvl.session import runs_without_ray

    x = cfg.pseudo_label
    if runs_without_ray(x.actors, x.gpus_per_actor, cfg.ray_address):
        cpus = f"{pseudo_label.labeller_cpus(cfg)} CPUs" if cfg.local_num_cpus else "the machine's CPUs"
        return (f"  one labeller in this process, no Ray ({cpus}"
                + (", this machine's GPU" if x.gpus_per_actor else "") + ")")
    writing = pseudo_label.finisher_cpus(x.cpus_per_actor, x.gpus_per_actor)
    writers = pseudo_label.finishers_per_labeller(x.cpus_per_actor, x.gpus_per_actor)
    who = (f"{x.actors or 1} labelling actors" if x.actors or not x.gpus_per_actor else
           "labelling actors, as many as the cluster's GPUs hold when the job starts (pseudo_label.actors=0),")
    return (f"  {who} of {{CPU: {x.cpus_per_actor - writing * writers:g}"
            + (f", GPU: {x.gpus_per_actor:g}" if x.gpus_per_actor else "")
            + (f"}}, each with an actor writing its shards of {{CPU: {writing:g}}}" if writers == 1 else
               f"}}, each with {writers} actors writing its shards, of {{CPU: {writing:g}}} each"))


def describe_pseudo_label(cfg: RayvlConfig) -> str:
    """What a labelling job would do (``rayvl pseudo-label --dry-run``'s report)."""
    from rayvl.data.specs import check
    from rayvl.methods.bow import pseudo_label

    x, policy = cfg.pseudo_label, ReadPolicy.of(cfg.data)
    ckpt, units = pseudo_label.check(cfg)
    lines = [f"pseudo-label with {ckpt}", "data:"]
    lines += data_lines("pseudo_label.aligned", check(x.aligned), policy)[0]
    shards = [u.paths[0] for u in units if u.kind == "tar"]
    lines.append(f"  pseudo_label.unaligned: {len(units)} units ("
                 + (f"{len(shards)} shards" if shards else f"image files in shards of {x.shard_size}") + ")")
    if shards:
        lines += sample_lines("pseudo_label.unaligned", shards, policy)
    done = sum(pseudo_label.finished(storage.local_path(x.out), u, x.rules) for u in units) \
        if storage.local_path(x.out).is_dir() else 0
    lines += ["job:", f"  rules {', '.join(x.rules)}; {x.crops} crops × top-{x.k} captions per image; {done} of "
                      f"{len(units)} units finished before (skipped)",
              labellers_line(cfg),
              f"  output {x.out}/<rule>/, index {x.out}/index/"]
    return "\n".join(lines)
