"""Seed bow-fistful-of-words §2.3 / Table 7: semi-aligned training with pseudo Bag-of-Words captions.

    python jobs/pseudo_label.py                                   # the embedded demo
    python jobs/pseudo_label.py --data ALIGNED --unaligned IMAGES --eval-data HELD_OUT [--set key=value ...]
    ray job submit --working-dir . -- python jobs/pseudo_label.py --data s3://... --unaligned s3://... ...

1. trains the labeller: a BoW model (configs/bow_pretrain.yaml) on the aligned shards S_a;
2. labels the unaligned images with every rule (rayvl.pseudo_label: one retrieval, one shard set per rule);
3. continues the labeller for --steps more steps on S_a alone — Table 7's longer-trained aligned-only baseline —
   and, with the same steps and seed, on S_a + each rule's pseudo-labelled shards;
4. prints Table-7-style rows: zero-shot top-1 and R@1 per arm and, where the unaligned shards still carry their
   captions (the demo's do; the labeller never reads them), each rule's word precision against the true caption.

On the demo the aligned set is the first half of the training shards and the unaligned set the second half. The
paper trains each semi-aligned model from scratch for 10 epochs; continuing the labeller keeps this recipe within
its 2-core budget — pass --from-scratch to train the arms from scratch.
"""
import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl import plan, pseudo_label, session, storage  # noqa: E402
from rayvl.config import ConfigError, load_config, validate  # noqa: E402
from rayvl.data.specs import resolve_shards  # noqa: E402
from rayvl.data.word_rank import RULES  # noqa: E402
from rayvl.recipes import (USER_ERRORS, one_line, _train, add_train_args, config_from_args,  # noqa: E402
                           print_comparison, train_variants)
from rayvl.train.datasets import resolve_data  # noqa: E402

CONFIG = str(REPO / "configs" / "bow_pretrain.yaml")
ROWS = [("zero-shot top-1 %", "zeroshot_top1", ".1f"),
        ("image→text R@1 %", "i2t_R@1", ".1f"), ("text→image R@1 %", "t2i_R@1", ".1f"),
        ("pseudo-labelled images", "pseudo_images", "d"),
        ("pseudo words in the true caption %", "pseudo_word_precision", ".1f"),
        ("final training loss", "loss", ".3f")]


def _args(argv):
    p = argparse.ArgumentParser(description="pseudo-BoW semi-aligned training ([BoW] §2.3, Table 7)")
    add_train_args(p, CONFIG)
    p.add_argument("--unaligned", default="", help="images without captions: shards or a folder of image files "
                                                   "(default on the demo: its second half)")
    p.add_argument("--teacher-steps", type=int, default=80, help="steps of the labeller on the aligned shards")
    p.add_argument("--steps", type=int, default=16, help="steps of every arm after the labeller")
    p.add_argument("--rules", default=",".join(RULES), help="comma list of ranking rules")
    p.add_argument("--from-scratch", action="store_true", help="train the arms from scratch, not from the labeller")
    return p.parse_args(argv)


def _split(args) -> tuple[str, str, list[str]]:
    """(aligned, unaligned, overrides): the user's, or the demo's training shards cut in two halves."""
    if args.data:
        if not args.unaligned:
            raise ConfigError("--unaligned: required with --data")
        return args.data, args.unaligned, []
    train, evalset, files = resolve_data(load_config(args.config, list(args.set)))
    shards = resolve_shards(train)
    half = len(shards) // 2
    aligned, unaligned = ",".join(shards[:half]), ",".join(shards[half:])
    # the demo's vocabulary has 41 content words: t = 1000 would remove them all, so t is scaled to 4 as
    # bow_pretrain.yaml scales RmTopFreq; two labelling actors of half a CPU leave one CPU for Ray Data
    demo = ["pseudo_label.top_t=4", "pseudo_label.actors=2", "pseudo_label.cpus_per_actor=0.5", f"data.eval={evalset}",
            *(f"data.{k.removesuffix('_file')}={v}" for k, v in files.items())]
    return aligned, args.unaligned or unaligned, demo


def main(argv=None) -> int:
    args = _args(argv)
    session.setup_logging(args.verbose)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        aligned, unaligned, demo = _split(args)
        args.data = None
        base = config_from_args(argparse.Namespace(**{**vars(args), "set": demo + list(args.set)}),
                                [f"data.train={aligned}", "bow.enabled=true"])
        if args.dry_run:  # the labeller's run; the arms train the same data plus what it labels
            print(plan.describe(_with(base, f"pseudo_label-{stamp}-labeller", args.teacher_steps)))
            print(f"then: pseudo-label {unaligned} with rules {args.rules}, and train each arm {args.steps} steps")
            return 0
        name = base.train.run_name or f"pseudo_label-{stamp}"
        teacher = _train(_with(base, f"{name}-labeller", args.teacher_steps), args.verbose)
        rules = [r.strip() for r in args.rules.split(",") if r.strip()]
        out = Path(str(teacher.uri)).parent / f"{name}-pseudo"
        labelled = load_config(args.config, demo + list(args.set) + [
            f"pseudo_label.checkpoint={teacher.uri}", f"pseudo_label.aligned={aligned}",
            f"pseudo_label.unaligned={unaligned}", f"pseudo_label.out={out}",
            f"pseudo_label.rules=[{','.join(rules)}]"])
        summary = pseudo_label.run(labelled, fixed_size=not (labelled.ray_address or os.environ.get("RAY_ADDRESS")))
        print(pseudo_label.format_summary(summary))
        # every arm: S_a's BoW statistics, counted once for the labeller (pseudo folders are no part of them:
        # bow.counted_shards), and the labeller's weights unless --from-scratch
        shared = [f"bow.stats_path={storage.join(str(teacher.uri), 'bow_stats.json')}",
                  *([] if args.from_scratch else [f"train.init_from={teacher.uri}"])]
        arms = {"aligned only": [], **{f"+ {r}": [f"data.train={aligned},{out / r}"] for r in rules}}
        configs = {arm: _with(config_from_args(argparse.Namespace(**{**vars(args), "set": demo + list(args.set)}),
                                               ["bow.enabled=true", f"data.train={aligned}", *shared, *extra]),
                              f"{name}-{arm.strip('+ ').replace(' ', '_')}", args.steps)
                   for arm, extra in arms.items()}
        results = train_variants(configs, verbose=args.verbose)
    except USER_ERRORS as e:
        print(f"config error: {one_line(e)}", file=sys.stderr)
        return 2
    truth = pseudo_label.true_captions(unaligned)
    for r in rules:
        results[f"+ {r}"].update(pseudo_images=summary["rules"][r].get("success", 0),
                                 **pseudo_label.word_precision(out / r, truth))
    results["aligned only"]["pseudo_images"] = 0
    print_comparison("pseudo_label (Table 7)", configs, results, ROWS, name)
    print(f"labeller: {teacher.uri}\npseudo-labelled shards: {out}/<rule>/")
    return 0


def _with(cfg, run_name: str, steps: int):
    """The config with its run name and steps (warm-up at most a fifth of them), validated here — not first in
    the workers."""
    t = dataclasses.replace(cfg.train, run_name=run_name, max_steps=steps,
                            warmup_steps=min(cfg.train.warmup_steps, steps // 5))
    out = dataclasses.replace(cfg, train=t)
    validate(out)
    return out


if __name__ == "__main__":
    sys.exit(main())
