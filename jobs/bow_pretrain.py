"""Seed bow-fistful-of-words Table 2: intact captions vs the default Bag-of-Words, same data, seed and steps.

    python jobs/bow_pretrain.py [--data SHARDS --eval-data SHARDS] [--set key=value ...]
    ray job submit --working-dir . -- python jobs/bow_pretrain.py --data s3://bucket/cc3m/{00000..00331}.tar ...

Trains twice (bow.enabled=false, then true; the base-split statistics are computed once per run with Ray Data and
saved next to it) and prints zero-shot top-1, R@k, the average caption length and the dataset-size change side by
side. With no --data it uses the embedded demo dataset.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `ray job submit --working-dir .` runs from a copy

from rayvl.recipes import run_comparison  # noqa: E402

ROWS = [
    ("zero-shot top-1 %", "zeroshot_top1", ".1f"),
    ("image→text R@1 %", "i2t_R@1", ".1f"), ("image→text R@5 %", "i2t_R@5", ".1f"),
    ("text→image R@1 %", "t2i_R@1", ".1f"), ("text→image R@5 %", "t2i_R@5", ".1f"),
    ("avg caption length (words)", "avg_caption_words", ".1f"),
    ("dataset size change %", "bow_dataset_change_pct", "+.1f"),
    ("training samples seen (all passes)", "samples_kept", "d"),
    ("final training loss", "loss", ".3f"),
]

if __name__ == "__main__":
    sys.exit(run_comparison(str(Path(__file__).resolve().parent.parent / "configs" / "bow_pretrain.yaml"),
                            {"intact": ["bow.enabled=false"], "bow": ["bow.enabled=true"]}, ROWS))
