"""The pseudo-labelled part of a finished run's training data ([BoW] §2.3, Table 7): how many pseudo-captioned
images it held and, where the unaligned shards still carry their true captions (the demo's held-back half does; the
labeller never reads them), the share of pseudo-caption words that are words of the image's true caption. A
comparison's per-trial ``after`` (jobs/pseudo_label.py)."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from rayvl.checkpoints import checkpoint_uri, read_meta
from rayvl.methods.bow.marks import PSEUDO_MARKER


def pseudo_caption_metrics(result, unaligned: str = "") -> dict:
    """{"pseudo_images": the pseudo-captioned images in the run's data.train (0 on aligned data alone), and with one
    labelled folder among them, "pseudo_word_precision": its words' precision against the true captions of
    ``unaligned``, where those are known}."""
    from rayvl.methods.bow.pseudo_label import true_captions, word_precision

    train = read_meta(checkpoint_uri(result.checkpoint_dir))["config"]["data"]["train"]
    # a `rayvl pseudo-label` output folder holds one <rule>/ folder of shards per rule, beside its marker file
    labelled = [Path(p) for p in train.split(",") if (Path(p).expanduser().parent / PSEUDO_MARKER).is_file()]
    metrics = {"pseudo_images": sum(written(folder) for folder in labelled)}
    if len(labelled) == 1 and unaligned:
        metrics.update(word_precision(labelled[0], true_captions(unaligned)))
    return metrics


def written(folder: Path) -> int:
    """The samples a labelled folder's shards hold: its parquets' rows labelled "success" (img2dataset's layout)."""
    return sum(pq.read_table(p, columns=["status"])["status"].to_pylist().count("success")
               for p in sorted(folder.expanduser().glob("*.parquet")))
