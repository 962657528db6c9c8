"""Seed bow-fistful-of-words §2.3 / Table 7: semi-aligned training with pseudo Bag-of-Words captions — the arms × 3
seeds as one Ray Tune grid (rayvl.sweeps.comparison), mean ± std per metric.

    python jobs/pseudo_label.py                                   # the embedded demo
    python jobs/pseudo_label.py --data ALIGNED --unaligned IMAGES --eval-data HELD_OUT [--set key=value ...]
                                [--variants aligned_only,+weighted_count] [--seeds 3] [--name NAME [--resume]]
                                [--report DIR] [--dry-run]
    ray job submit --working-dir . -- python jobs/pseudo_label.py --data s3://... --unaligned s3://... ...

1. trains the labeller: a BoW model (configs/bow_pretrain.yaml) on the aligned shards S_a for --teacher-steps
   (the run <name>-labeller);
2. labels the unaligned images with the rule of each chosen arm (rayvl.methods.bow.pseudo_label: one retrieval, one
   shard set per rule, in <name>-pseudo/ beside the labeller's run; a rerun skips the shards labelled before);
3. continues the labeller for --steps more steps on S_a alone — Table 7's longer-trained aligned-only baseline —
   and, with the same steps and seeds, on S_a + each rule's pseudo-labelled shards: the arms × seeds as one grid;
4. reports Table-7-style rows per arm: zero-shot top-1 and R@1, the pseudo-labelled images trained on and, where the
   unaligned shards still carry their captions (the demo's do; the labeller never reads them), the rule's word
   precision against the true caption (rayvl.methods.bow.pseudo_captions, after each trial).

On the demo the aligned set is the first half of the training shards and the unaligned set the second half. The
paper trains each semi-aligned model from scratch for 10 epochs; continuing the labeller keeps this recipe within
its 2-core budget — pass --from-scratch to train the arms from scratch. With --name N --resume an interrupted
comparison reuses its finished labeller and labelled shards and continues its grid.
"""
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl import storage  # noqa: E402
from rayvl.config import ConfigError, RayvlConfig, load_config  # noqa: E402
from rayvl.methods.bow.check import RULES  # noqa: E402
from rayvl.sweeps.comparison import Comparison  # noqa: E402

ROWS = [("zero-shot top-1 %", "zeroshot_top1", ".1f"),
        ("image→text R@1 %", "i2t_R@1", ".1f"), ("text→image R@1 %", "t2i_R@1", ".1f"),
        ("pseudo-labelled images", "pseudo_images", ".0f"),
        ("pseudo words in the true caption %", "pseudo_word_precision", ".1f"),
        ("final training loss", "loss", ".3f")]
# the labelling job on the demo: its vocabulary has 41 content words, so t = 1000 would remove them all — t is scaled
# to 4 as bow_pretrain.yaml scales RmTopFreq; two labelling actors of half a CPU leave one CPU for Ray Data
DEMO_LABELLING = ["pseudo_label.top_t=4", "pseudo_label.actors=2", "pseudo_label.cpus_per_actor=0.5"]


@dataclass
class Split:
    """Where the job's data and outputs are."""

    aligned: str  # S_a: the labeller's and every arm's shards
    unaligned: str  # the images to label
    labeller: str  # the labeller's run directory
    pseudo: str  # the labelling job's output folder: <pseudo>/<rule>/ shards
    trials: list[str]  # overrides every run gets (on the demo: its held-out split and files)


def split(args) -> Split:
    """The user's aligned and unaligned data, or the demo's training shards cut in two halves."""
    from rayvl.data.specs import resolve_shards
    from rayvl.train.datasets import resolve_data

    cfg = load_config(args.config, list(args.set))
    store = storage.normalize(cfg.train.storage_path)
    local = storage.local_path(store)
    if local is None:  # rayvl.methods.bow.pseudo_label writes its shards with local file I/O
        raise ConfigError(f"train.storage_path: {store!r}: jobs/pseudo_label.py writes the labelled shards beside "
                          f"the labeller's run, which needs a path on this machine (or a shared mount)")
    paths = dict(labeller=storage.join(store, f"{args.name}-labeller"), pseudo=str(local / f"{args.name}-pseudo"))
    if args.data:
        if not args.unaligned:
            raise ConfigError("--unaligned: required with --data")
        return Split(args.data, args.unaligned, **paths, trials=[])
    train, evalset, files = resolve_data(cfg)[:3]
    shards = resolve_shards(train)
    half = len(shards) // 2
    trials = [f"data.eval={evalset}", *(f"data.{k.removesuffix('_file')}={v}" for k, v in files.items())]
    return Split(",".join(shards[:half]), args.unaligned or ",".join(shards[half:]), **paths, trials=trials)


class PseudoLabel(Comparison):
    def add_arguments(self, parser) -> None:
        parser.add_argument("--unaligned", default="", help="images without captions: shards or a folder of image "
                                                            "files (default on the demo: its second half)")
        parser.add_argument("--teacher-steps", type=int, default=80, help="steps of the labeller on the aligned shards")
        parser.add_argument("--steps", type=int, default=16, help="steps of every arm after the labeller")
        parser.add_argument("--from-scratch", action="store_true",
                            help="train the arms from scratch, not from the labeller")

    def defaults(self, args) -> list[str]:
        """On the demo: its held-out split and files (the arms' training data are the variants')."""
        return split(args).trials

    def bind(self, args) -> "PseudoLabel":
        """The arms' data (S_a, S_a + a rule's labelled shards) and, for every arm, S_a's BoW statistics counted once
        for the labeller (labelled folders are no part of them: bow counted_shards), the labeller's weights unless
        --from-scratch, and --steps (warm-up at most a fifth of them)."""
        s = split(args)
        variants = {n: [o.format(aligned=s.aligned, pseudo=s.pseudo) for o in overrides]
                    for n, overrides in self.variants.items()}
        warmup = min(load_config(args.config, list(args.set)).train.warmup_steps, args.steps // 5)
        arms = [f"bow.stats_path={storage.join(s.labeller, 'bow_stats.json')}",
                *([] if args.from_scratch else [f"train.init_from={s.labeller}"]),
                f"train.max_steps={args.steps}", f"train.warmup_steps={warmup}"]
        return dataclasses.replace(self, variants=variants, fixed=self.fixed + arms)

    def after_kwargs(self, args) -> dict:
        return {"unaligned": split(args).unaligned}

    def prepare(self, args, overrides: list[str]) -> None:
        """The labeller, trained (or continued; a resumed comparison's finished one is kept), then the unaligned
        images labelled with the chosen arms' rules."""
        from rayvl import session
        from rayvl.methods.bow import pseudo_label

        s = split(args)
        train_labeller(self.labeller_config(args, overrides), args.resume)
        rules = [n.removeprefix("+") for n in self.variants if n.startswith("+")]
        if not rules:
            return
        cfg = load_config(self.recipe, (DEMO_LABELLING if not args.data else []) + overrides + [
            f"pseudo_label.checkpoint={s.labeller}", f"pseudo_label.aligned={s.aligned}",
            f"pseudo_label.unaligned={s.unaligned}", f"pseudo_label.out={s.pseudo}",
            f"pseudo_label.rules=[{','.join(rules)}]"])
        session.connect(cfg.ray_address, cfg.local_num_cpus)  # the labeller's run connected, unless it was reused
        summary = pseudo_label.run(cfg, fixed_size=not (cfg.ray_address or os.environ.get("RAY_ADDRESS")))
        print(pseudo_label.format_summary(summary))

    def labeller_config(self, args, overrides: list[str]) -> RayvlConfig:
        """The BoW labeller on S_a for --teacher-steps (warm-up at most a fifth of them), run <name>-labeller."""
        steps, s = args.teacher_steps, split(args)
        warmup = min(load_config(self.recipe, overrides).train.warmup_steps, steps // 5)
        return load_config(self.recipe, overrides + [f"data.train={s.aligned}", "bow.enabled=true",
                                                      f"train.run_name={Path(s.labeller).name}",
                                                      f"train.max_steps={steps}", f"train.warmup_steps={warmup}"])

    def describe(self, grid, args, overrides: list[str]) -> str:
        """--dry-run: the labeller's run plan, then what follows it (the arms read shards it has not written yet)."""
        from rayvl.dry_run import describe

        s, seeds = split(args), len(grid.space["train.seed"]["grid"])
        rules = [n.removeprefix("+") for n in grid.variants if n.startswith("+")]
        return "\n".join([f"labeller ({args.teacher_steps} steps on the aligned shards):",
                          *("  " + line for line in describe(self.labeller_config(args, overrides)).splitlines()),
                          f"then: pseudo-label {s.unaligned} with {', '.join(rules) or 'no rule'} into {s.pseudo}/",
                          f"then: {len(grid.variants) * seeds} trials, arms {', '.join(grid.variants)} × seeds "
                          f"0…{seeds - 1}, {args.steps} steps each "
                          + ("from scratch" if args.from_scratch else "from the labeller's weights")])


def train_labeller(cfg: RayvlConfig, resume: bool) -> None:
    """Train the labeller or, in a resumed comparison, continue it; a finished one is kept as it is."""
    from rayvl.checkpoints import latest_checkpoint_dir, read_meta
    from rayvl.train.trainer import train

    run = storage.join(storage.normalize(cfg.train.storage_path), cfg.train.run_name)
    latest = latest_checkpoint_dir(run)
    if (latest is None) == resume:
        raise ConfigError(f"--name: the comparison's labeller {run!r} " + (
            "has no checkpoint: drop --resume" if resume else "exists: pass --resume to continue the comparison, "
                                                              "or --name another"))
    if latest is not None and read_meta(latest)["step"] >= cfg.train.max_steps:
        print(f"labeller: {run} (finished before, reused)")
        return
    result = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=latest is not None)),
                   progress=True)
    print(f"labeller: {result.uri}")


ARMS = {"aligned_only": ["data.train={aligned}"],
        **{f"+{rule}": [f"data.train={{aligned}},{{pseudo}}/{rule}"] for rule in RULES}}
COMPARISON = PseudoLabel(
    "pseudo_label (BoW Table 7)", str(REPO / "configs" / "bow_pretrain.yaml"), ARMS, ROWS, fixed=["bow.enabled=true"],
    # one trial at a time on 2 cores (2 × 0.45 + its driver's 0.1 + Ray Data's 1); the arms' steps are --steps
    demo=["train.cpus_per_worker=0.45"],
    after="rayvl.methods.bow.pseudo_captions:pseudo_caption_metrics",
    after_metrics=("pseudo_images", "pseudo_word_precision"))

if __name__ == "__main__":
    sys.exit(COMPARISON.main())
