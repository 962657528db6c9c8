"""Seed tonics-curriculum Table 1 with its control: three arms on the same data and steps, 3 seeds each — one Ray
Tune grid (rayvl.sweeps.comparison), mean ± std per metric.

    python jobs/tonics_align.py [--data SHARDS --eval-data IN_DISTRIBUTION_SHARDS] [--heldout HELD_OUT_SHARDS]
                                [--seeds 3] [--name NAME [--resume]] [--report DIR]
                                [--threshold-from FINISHED_COMPARISON | --set tonics.threshold=...]
    ray job submit --working-dir . -- python jobs/tonics_align.py --data 's3://bucket/coco-cc/{00000..00300}.tar' ...

- random: the paper's Random baseline, random minibatches of image-text pairs (tonics.enabled=false);
- control: the TOnICS arm's triplet rows (one per aligned caption noun) and bucket sampler with the curriculum off
  (tonics.curriculum=false): P_S stays at the root, its refresh evaluations are logged — the learning curve the
  refresh threshold is read from: --threshold-from DIR sets tonics.threshold to where the control trials of a
  finished comparison DIR saturate (within 5 points of their plateau,
  rayvl.methods.tonics.sampler.saturation_threshold);
- tonics: the same rows and sampler with the curriculum on.

Unless a threshold is given, the comparison runs in two stages: the control's seeds first (grid <name>-control), then
random and tonics (grid <name>) with tonics.threshold read from the control's curves; <name>'s report has all three.

Each trial evaluates retrieval on the in-distribution split during training (data.eval, whose first
tonics.refresh_instances also drive the curriculum refresh) and, when it ends, on a held-out split: `rayvl eval`'s
retrieval and R@1 within same-object galleries (rayvl.methods.tonics.contextual: a caption naming object o ranks only the
images holding o — the contextual alignment the paper claims). With no --data it uses the embedded demo: 3
training shards of multi-object scenes, the 4th as in-distribution split, the single-object held-out split as
held-out.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl.sweeps.comparison import Comparison, Stages  # noqa: E402

ROWS = [(f"{split} {label} R@{k} %", f"{prefix}{d}_R@{k}", ".1f")
        for split, prefix in (("in-distribution", ""), ("held-out", "heldout_"))
        for label, d in (("text→image", "t2i"), ("image→text", "i2t")) for k in (1, 5, 10)]
ROWS += [("held-out same-object text→image R@1 %", "heldout_t2i_same_object_R@1", ".1f"),
         ("held-out same-object image→text R@1 %", "heldout_i2t_same_object_R@1", ".1f"),
         ("  chance within those galleries %", "heldout_same_object_chance_R@1", ".1f"),
         ("refresh-set text→image R@1 at the last refresh %", "tonics_last_refresh_accuracy", ".1f"),
         ("TOnICS refreshes", "tonics_refreshes", ".1f"), ("final P_S(root)", "tonics_p_root", ".2f"),
         ("final training loss", "loss", ".3f")]


class TonicsAlign(Comparison):
    def add_arguments(self, parser) -> None:
        parser.add_argument("--heldout", default="", help="held-out shards, evaluated after training")
        parser.add_argument("--threshold-from", default="", metavar="DIR", help="set tonics.threshold from the "
                            "control arm's learning curves in this finished comparison")

    def defaults(self, args) -> list[str]:
        """The demo's data split (without --data) and the threshold read from a finished control
        (--threshold-from)."""
        return demo_split(args) + (threshold_from(args.threshold_from) if args.threshold_from else [])

    def after_kwargs(self, args) -> dict:
        """The held-out shards each trial evaluates when it ends (--heldout; on the demo its held-out split)."""
        return {"data": args.heldout} if args.heldout else {}

    def stages(self, args) -> Stages | None:
        """With no threshold given (--threshold-from, --set tonics.threshold), the control arm runs first and the
        other arms get tonics.threshold read from its learning curves ([TOnICS] §3: the curriculum starts once coarse
        alignment saturates) — one command, two grids."""
        given = args.threshold_from or any(s.split("=", 1)[0].strip() == "tonics.threshold" for s in args.set)
        if given or not {"control", "tonics"} <= set(self.variants):
            return None
        return Stages(["control"], threshold_from)


COMPARISON = TonicsAlign(
    "tonics_align (TOnICS Table 1)", str(REPO / "configs" / "tonics.yaml"),
    {"random": ["tonics.enabled=false"], "control": ["tonics.enabled=true", "tonics.curriculum=false"],
     "tonics": ["tonics.enabled=true"]}, ROWS,
    # one trial at a time on 2 cores (2 × 0.45 + its driver's 0.1 + Ray Data's 1); 50 steps and a refresh check every
    # 10 keep the 9 trials within the demo's budget (the recipe's 150 steps do not)
    demo=["train.cpus_per_worker=0.45", "train.max_steps=50", "train.checkpoint_every=50", "train.warmup_steps=10",
          "tonics.refresh_every=10"],
    after="rayvl.methods.tonics.contextual:tonics_heldout",
    after_metrics=tuple(key for _, key, _ in ROWS if key.startswith("heldout_")))


def threshold_from(comparison_dir: str) -> list[str]:
    """tonics.threshold from the control trials of a finished comparison (its comparison.csv names them): their
    refresh-set R@1 curves, read from the trials' metrics (rayvl.methods.tonics.sampler.saturation_threshold)."""
    import csv
    import io

    from rayvl import storage
    from rayvl.config import ConfigError
    from rayvl.methods.tonics.sampler import SATURATION_TOLERANCE, saturation_threshold
    from rayvl.plots import history

    table = storage.join(storage.normalize(comparison_dir), "comparison.csv")
    if not storage.is_file(table):
        raise ConfigError(f"--threshold-from {comparison_dir}: no comparison.csv (not a finished comparison)")
    curves = []
    for t in csv.DictReader(io.StringIO(storage.read_text(table))):
        if t["variant"] == "control" and t["status"] == "TERMINATED":
            rows = history(storage.join(comparison_dir, "runs", f"trial-{t['trial']}"))
            curve = {(r["tonics_last_refresh_step"], r["tonics_last_refresh_accuracy"])
                     for r in rows if "tonics_last_refresh_step" in r}
            curves += [sorted(curve)] if curve else []
    try:
        threshold, step = saturation_threshold(curves)
    except ValueError as e:
        raise ConfigError(f"--threshold-from {comparison_dir}: {e}") from e
    print(f"tonics.threshold = {threshold:.1f}: the control's refresh-set R@1 within {SATURATION_TOLERANCE:g} points "
          f"of its plateau "
          f"(reached at step {step:.0f} on average over {len(curves)} seeds)")
    return [f"tonics.threshold={threshold:.1f}"]


def demo_split(args) -> list[str]:
    """On the demo: its first 3 training shards to train on, the 4th as the in-distribution split, its held-out
    split as --heldout."""
    if args.data:
        return []
    from rayvl.config import load_config
    from rayvl.data.demo import DEMO_SEED, ensure_demo

    d = load_config(args.config, list(args.set)).data
    root = ensure_demo(d.demo_dir, d.demo_samples, d.demo_eval_samples, seed=DEMO_SEED)
    tars = sorted(str(p) for p in (root / "train").glob("*.tar"))
    args.heldout = args.heldout or str(root / "eval")
    return [f"data.train={','.join(tars[:-1])}", f"data.eval={tars[-1]}"]


if __name__ == "__main__":
    sys.exit(COMPARISON.main())
