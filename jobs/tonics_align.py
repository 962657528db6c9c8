"""Seed tonics-curriculum Table 1: random minibatches vs TOnICS minibatches, same data, seed and steps.

    python jobs/tonics_align.py [--data SHARDS --eval-data IN_DISTRIBUTION_SHARDS] [--heldout HELD_OUT_SHARDS]
    ray job submit --working-dir . -- python jobs/tonics_align.py --data s3://bucket/coco-cc/{00000..00300}.tar ...

Trains twice (tonics.enabled=false, then true), evaluates retrieval on the in-distribution split during training
(data.eval, whose first tonics.refresh_instances also drive the curriculum refresh) and on a held-out split with
`rayvl eval`'s retrieval, and prints both side by side. With no --data it uses the embedded demo: 3 training
shards of multi-object scenes, the 4th as in-distribution split, the single-object held-out split as held-out.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl.recipes import run_comparison  # noqa: E402

ROWS = [(f"{split} {label} R@{k} %", f"{prefix}{d}_R@{k}", ".1f")
        for split, prefix in (("in-distribution", ""), ("held-out", "heldout_"))
        for label, d in (("text→image", "t2i"), ("image→text", "i2t")) for k in (1, 5, 10)]
ROWS += [("TOnICS refreshes", "tonics_refreshes", "d"), ("final P_S(root)", "tonics_p_root", ".2f"),
         ("final training loss", "loss", ".3f")]


def main() -> int:
    heldout = ""
    argv = sys.argv[1:]
    if "--heldout" in argv:
        i = argv.index("--heldout")
        heldout, argv = argv[i + 1], argv[:i] + argv[i + 2:]

    def demo_split(args) -> list[str]:
        nonlocal heldout
        if args.data:
            return []
        from rayvl.config import load_config
        from rayvl.data.demo import ensure_demo

        d = load_config(args.config).data
        root = ensure_demo(d.demo_dir, d.demo_samples, d.demo_eval_samples, seed=0)
        tars = sorted(str(p) for p in (root / "train").glob("*.tar"))
        heldout = heldout or str(root / "eval")
        return [f"data.train={','.join(tars[:-1])}", f"data.eval={tars[-1]}"]

    def heldout_retrieval(result) -> dict:
        if not heldout:
            return {}
        from rayvl import storage
        from rayvl.eval.runner import Sources, run_eval

        out = run_eval(result.checkpoint_dir, ["retrieval"], Sources(heldout, "shards"),
                       out=storage.join(result.uri, "eval-heldout"))
        return {f"heldout_{k}": v for k, v in out["retrieval"].items()}

    return run_comparison(str(REPO / "configs" / "tonics.yaml"),
                          {"random": ["tonics.enabled=false"], "tonics": ["tonics.enabled=true"]}, ROWS, argv,
                          defaults=demo_split, after=heldout_retrieval)


if __name__ == "__main__":
    sys.exit(main())
