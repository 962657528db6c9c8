"""Seed unicl-image-text-label: a CE-style baseline vs UniCL, zero-shot on seen, held-out and all classes, 3 seeds
each — one Ray Tune grid (rayvl.sweeps.comparison), mean ± std per metric.

    python jobs/unicl.py [--set image_label.data=SHARDS_WITH_CLS --set image_label.classes=classes.json ...]
                         [--seeds 3] [--name NAME [--resume]] [--report DIR]
    ray job submit --working-dir . -- python jobs/unicl.py --data s3://bucket/cc3m/... --set image_label.data=...

- ce: the image tower with a learned class-embedding matrix ([UniCL] eq. (4): CE is UniCL whose text encoder
  is a linear embedding), trained on the image-label data of the 7 training classes only;
- unicl_labels: the same image tower with the text tower and UniCL's label-aware loss, on CE's data exactly (image-label
  prompts only) — the losses compared on the same data ([UniCL] Tables 2–3);
- unicl: as unicl_labels, with image-label prompts mixed 1:1 per batch with image-text pairs (the embedded demo's, or
  --data).

Each trial ends with zero-shot on the Fashion-MNIST test split (all 80 templates averaged, rayvl.methods.unicl.class_split):
over all 10 classes, over the 7 training classes, and over the 3 held-out classes, with each held-out class's recall
among the three (the whole confusion matrix is in each trial's final_metrics.json). The CE model has no text
encoder, so it can only score the classes it has embeddings for ("-" on held-out classes; its 10-class accuracy
counts them as misses).
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl.methods.unicl.class_split import ROWS, mean_confusion  # noqa: E402
from rayvl.sweeps.comparison import Comparison  # noqa: E402


class Unicl(Comparison):
    def notes(self, trials: list[dict]) -> str:
        """Each arm's mean confusion among the held-out classes (each trial's matrix is in its final_metrics.json)."""
        return mean_confusion(trials)


CE = ["model.text_tower=class_embedding", "loss.kind=ce", "image_label.weight=1.0", "eval.tasks=[]"]
COMPARISON = Unicl(
    "unicl (UniCL vs CE)", str(REPO / "configs" / "unicl.yaml"),
    # [UniCL] Tables 2–3 compare the losses on the same image-label data: unicl_labels is UniCL (text tower) on
    # exactly CE's data; unicl adds the image-text pairs (the setting of its Tables 5–6)
    {"ce": CE, "unicl_labels": ["image_label.weight=1.0"], "unicl": []}, ROWS,
    # one trial at a time on 2 cores (2 × 0.45 + its driver's 0.1 + Ray Data's 1); 50 steps keep 9 trials within the
    # demo's budget
    demo=["train.cpus_per_worker=0.45", "train.max_steps=50", "train.checkpoint_every=50", "train.warmup_steps=10"],
    after="rayvl.methods.unicl.class_split:fashion_mnist_split",
    after_metrics=tuple(key for _, key, _ in ROWS if key.startswith("zs_")))

if __name__ == "__main__":
    sys.exit(COMPARISON.main())
