"""Seed unicl-image-text-label Tables 5–6 (concept coverage): do image-text pairs whose captions name the classes
the image-label data holds out give zero-shot on those classes, and does UniCL's label-aware loss beat the CLIP
loss on the same mixed data? Four arms × 3 seeds — one Ray Tune grid (rayvl.sweeps.comparison), mean ± std per
metric.

    python jobs/unicl_coverage.py [--variants all] [--seeds 3] [--name NAME [--resume]] [--report DIR]
    ray job submit --working-dir . -- python jobs/unicl_coverage.py --covered s3://…/with/ \
        --uncovered s3://…/without/ --set image_label.data=SHARDS_WITH_CLS --set image_label.classes=classes.json

Every arm trains on the same image-label data — Fashion-MNIST photos of the 7 training classes, from the first
image_label.limit = 50,000 training photos (held-out trouser, sandal, bag excluded and counted) — mixed 1:1 per
batch with image-text pairs (rayvl.methods.unicl.fashion_captions, from the last 10,000 training photos, which the labelled
set never reads):

- unicl_uncovered: pairs of the training classes only (no caption names a held-out class), UniCL loss;
- unicl_covered: as many pairs, the same number per class over all 10 classes (captions name the held-out ones);
- clip_covered: unicl_covered's data with the CLIP loss (every row its own label: two prompts of one class in a
  batch are negatives — [UniCL] Table 6's CLIP row is this loss);
- clip_uncovered: the CLIP loss on unicl_uncovered's data (with --variants all).

Each trial ends with zero-shot on the first 2,000 Fashion-MNIST test photos (80 templates averaged,
rayvl.methods.unicl.class_split): all, seen and held-out classes, each held-out class's recall among the three and the
held-out confusion matrix (final_metrics.json; the report prints each arm's mean matrix). With --covered/--uncovered
the pairs are yours (shards of captions that do and do not name the held-out classes).
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl.methods.unicl.class_split import ROWS, mean_confusion  # noqa: E402
from rayvl.sweeps.comparison import Comparison  # noqa: E402

FIRST_CAPTIONED = 50_000  # image_label.limit: the labelled set reads the photos before this index, the pairs the rest
UNICL, CLIP = ["loss.kind=unicl"], ["loss.kind=clip"]


class UniclCoverage(Comparison):
    def add_arguments(self, parser) -> None:
        parser.add_argument("--covered", default="", help="image-text shards whose captions name the held-out classes")
        parser.add_argument("--uncovered", default="", help="image-text shards whose captions do not")

    def bind(self, args) -> "UniclCoverage":
        """The arms' image-text data: --covered/--uncovered, or the captioned Fashion-MNIST pairs (written once)."""
        import dataclasses

        from rayvl.config import ConfigError, load_config
        from rayvl.methods.unicl.fashion_captions import ensure_coverage
        from rayvl.data.fashion_mnist import is_fashion_mnist

        if getattr(args, "data", None):
            raise ConfigError("--data: each arm's image-text data is --covered or --uncovered")
        cfg = load_config(args.config, self.fixed + list(args.set))
        paths = {"covered": args.covered, "uncovered": args.uncovered}
        if not all(paths.values()):
            if not is_fashion_mnist(cfg.image_label.data):
                raise ConfigError("--covered/--uncovered: give both sets of image-text pairs (captioned pairs are "
                                  "made only from Fashion-MNIST, image_label.data=fashion-mnist)")
            held = [c for c in range(10) if c not in cfg.image_label.train_classes]
            root = ensure_coverage(Path(cfg.data.demo_dir).expanduser().parent / "fashion-captions",
                                   cfg.image_label.limit, held)
            print(f"image-text pairs: {root} — " + json.dumps(json.loads((root / "DONE.json").read_text())["counts"]))
            paths = {k: v or str(root / k) for k, v in paths.items()}
        variants = {n: [o.format(**paths) for o in overrides] for n, overrides in self.variants.items()}
        return dataclasses.replace(self, variants=variants)

    def notes(self, trials: list[dict]) -> str:
        """Each arm's mean confusion among the held-out classes (each trial's matrix is in its final_metrics.json)."""
        return mean_confusion(trials)


COMPARISON = UniclCoverage(
    "unicl_coverage (UniCL Tables 5–6)", str(REPO / "configs" / "unicl.yaml"),
    {"unicl_uncovered": UNICL + ["data.train={uncovered}"], "unicl_covered": UNICL + ["data.train={covered}"],
     "clip_covered": CLIP + ["data.train={covered}"], "clip_uncovered": CLIP + ["data.train={uncovered}"]},
    ROWS + [("image-text pairs naming a held-out class %", "covered_share", ".1f")],
    fixed=[f"image_label.limit={FIRST_CAPTIONED}"],
    # one trial at a time on 2 cores (2 × 0.45 + its driver's 0.1 + Ray Data's 1); 50 steps keep 9 trials within the
    # demo's budget
    demo=["train.cpus_per_worker=0.45", "train.max_steps=50", "train.checkpoint_every=50", "train.warmup_steps=10"],
    demo_variants=("unicl_uncovered", "unicl_covered", "clip_covered"),
    after="rayvl.methods.unicl.class_split:coverage_split",
    after_metrics=tuple(key for _, key, _ in ROWS if key.startswith("zs_")) + ("covered_share",))


if __name__ == "__main__":
    sys.exit(COMPARISON.main())
