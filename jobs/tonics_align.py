"""Seed tonics-curriculum Table 1: random minibatches vs TOnICS minibatches, same data and steps, 3 seeds each —
one Ray Tune grid (rayvl.compare), mean ± std per metric.

    python jobs/tonics_align.py [--data SHARDS --eval-data IN_DISTRIBUTION_SHARDS] [--heldout HELD_OUT_SHARDS]
                                [--seeds 3] [--name NAME [--resume]] [--report DIR]
    ray job submit --working-dir . -- python jobs/tonics_align.py --data s3://bucket/coco-cc/{00000..00300}.tar ...

Each trial evaluates retrieval on the in-distribution split during training (data.eval, whose first
tonics.refresh_instances also drive the curriculum refresh) and, when it ends, on a held-out split with
`rayvl eval`'s retrieval. With no --data it uses the embedded demo: 3 training shards of multi-object scenes, the
4th as in-distribution split, the single-object held-out split as held-out.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl.compare import Comparison, main  # noqa: E402

ROWS = [(f"{split} {label} R@{k} %", f"{prefix}{d}_R@{k}", ".1f")
        for split, prefix in (("in-distribution", ""), ("held-out", "heldout_"))
        for label, d in (("text→image", "t2i"), ("image→text", "i2t")) for k in (1, 5, 10)]
ROWS += [("TOnICS refreshes", "tonics_refreshes", ".1f"), ("final P_S(root)", "tonics_p_root", ".2f"),
         ("final training loss", "loss", ".3f")]
COMPARISON = Comparison(
    "tonics_align (TOnICS Table 1)", str(REPO / "configs" / "tonics.yaml"),
    {"random": ["tonics.enabled=false"], "tonics": ["tonics.enabled=true"]}, ROWS,
    demo=["train.cpus_per_worker=0.45"],  # one trial at a time on 2 cores: 2 × 0.45 + its driver's 0.1 + Ray Data's 1
    after="rayvl.eval.runner:after_training",
    after_metrics=tuple(key for _, key, _ in ROWS if key.startswith("heldout_")))


def demo_split(args) -> list[str]:
    if args.data:
        return []
    from rayvl.config import load_config
    from rayvl.data.demo import DEMO_SEED, ensure_demo

    d = load_config(args.config).data
    root = ensure_demo(d.demo_dir, d.demo_samples, d.demo_eval_samples, seed=DEMO_SEED)
    tars = sorted(str(p) for p in (root / "train").glob("*.tar"))
    args.heldout = args.heldout or str(root / "eval")
    return [f"data.train={','.join(tars[:-1])}", f"data.eval={tars[-1]}"]


def heldout(args) -> dict:
    return {"data": args.heldout} if args.heldout else {}


if __name__ == "__main__":
    sys.exit(main(COMPARISON, defaults=demo_split, after_kwargs=heldout,
                  add_args=lambda p: p.add_argument("--heldout", default="", help="held-out shards, evaluated "
                                                                                   "after training")))
