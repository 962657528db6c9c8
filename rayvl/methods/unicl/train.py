"""UniCL on every training worker ([UniCL] §3, App. B.2): balanced micro-batches of image-label and image-text rows,
the label-aware targets, and the cross-entropy baseline over learned class embeddings."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from rayvl.config import RayvlConfig
from rayvl.data.pipeline import TRAIN_COLUMNS
from rayvl.methods.unicl.rows import label_rows
from rayvl.train.batches import CPU, ROW, batch_stream
from rayvl.train.step import unique_labels
from rayvl.train.parts import TrainPart
from rayvl.train.worker import Worker


def mixed_stream(text_shard, label_shard, cfg: RayvlConfig, begin=None, rank: int = 0,
                 device: torch.device = CPU) -> Iterator[tuple[dict, float]]:
    """Balanced sampling ([UniCL] App. B.2): every micro-batch takes round(weight × size) rows from the image-label
    stream and the rest from the image-text stream — an exact ratio per batch; each stream is its own Ray Data
    pipeline and runs through its epochs at its own pace (the smaller set repeats more often)."""
    n_label = label_rows(cfg)
    labels = batch_stream(label_shard, cfg, n_label, rank=rank, stream=1, device=device)  # both start now
    texts = batch_stream(text_shard, cfg, cfg.train.micro_batch_size - n_label, begin, rank=rank, device=device)
    return _mixed(labels, texts)


def _mixed(labels, texts) -> Iterator[tuple[dict, float]]:
    while True:
        (a, wait_a), (b, wait_b) = next(labels), next(texts)
        batch = {k: torch.cat([a[k], b[k]]) for k in TRAIN_COLUMNS}
        if ROW in b:  # image-label rows are not position-tracked (row −1)
            batch[ROW] = torch.cat([torch.full_like(a["label"], -1), b[ROW]])
        yield batch, wait_a + wait_b


def class_labels(batch: dict, batch_index: int) -> torch.Tensor:
    """TargetM ([UniCL] Algorithm 1): image-label rows keep their class id (≥ 0), image-text rows get a label of
    their own (unique_labels)."""
    return torch.where(batch["label"] >= 0, batch["label"], unique_labels(batch, batch_index))


class UniclPart(TrainPart):
    name = "unicl"

    @staticmethod
    def enabled(cfg: RayvlConfig) -> bool:
        return bool(cfg.image_label.data) or cfg.loss.kind != "clip"

    def __init__(self, worker: Worker):
        self.worker = worker

    def batches(self):
        cfg, w = self.worker.cfg, self.worker
        if not cfg.image_label.data or cfg.image_label.weight >= 1.0:
            return None  # image-label data alone is the "train" stream
        import ray.train

        stream = mixed_stream(ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("labeled"), cfg,
                              w.begin, rank=w.rank, device=w.device)
        return lambda step, micro: next(stream)

    def targets(self, batch: dict, batch_index: int) -> torch.Tensor | None:
        # loss.kind=clip keeps one positive per query, class ids or not
        return class_labels(batch, batch_index) if self.worker.cfg.loss.kind != "clip" else None

    def loss(self, features, batch: dict, labels) -> torch.Tensor | None:
        if self.worker.cfg.loss.kind != "ce":
            return None
        image, text, scale = features  # [UniCL] eq. (4): the text side is the class-embedding matrix
        return F.cross_entropy(scale * image @ text.T, batch["label"])
