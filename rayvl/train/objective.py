"""The loss of a micro-batch, chosen once from the enabled methods' parts (open_clip's ``create_loss``): the step
never asks which loss it has."""
from __future__ import annotations

import torch

from rayvl.losses import clip_loss, siglip_loss, unicl_loss
from rayvl.train.parts import TrainPart


def unique_labels(batch: dict, batch_index: int) -> torch.Tensor:
    """One label per row, unique across ranks, steps and so across a memory bank's queue: every image-text row is
    its own class ([UniCL] Algorithm 1, TargetM)."""
    b = batch["label"].shape[0]
    return -1 - (batch_index * b + torch.arange(b, device=batch["label"].device))


class Objective:
    """InfoNCE over the gathered batch; label-aware InfoNCE ([UniCL] eq. (1)–(3)) where a part gives the targets;
    a part's own loss (a memory bank's keys, UniCL's class embeddings) where one gives it; with ``siglip``, SigLIP's
    sigmoid loss, positives where the labels agree (the model then returns its logit bias too)."""

    def __init__(self, parts: list[TrainPart], gather_with_grad: bool, siglip: bool = False):
        self.parts, self.gather_with_grad, self.siglip = parts, gather_with_grad, siglip

    def __call__(self, engine, batch: dict, batch_index: int) -> torch.Tensor:
        # the loss in fp32 whatever the towers' precision: bf16 logits lose the ranking between near keys, and a
        # memory bank's EMA keys and queue are fp32
        features = tuple(t.float() for t in engine(batch["image"], batch["input_ids"], batch["attention_mask"]))
        labels = next((y for y in (p.targets(batch, batch_index) for p in self.parts) if y is not None), None)
        given = labels is not None
        labels = labels if given else unique_labels(batch, batch_index)
        if self.siglip:  # the config refuses the parts whose own loss or targets it cannot take
            return siglip_loss(*features, labels, self.gather_with_grad)
        for part in self.parts:
            loss = part.loss(features, batch, labels)
            if loss is not None:
                return loss
        if not given:  # every row its own positive: the CLIP loss
            return clip_loss(*features, self.gather_with_grad)
        return unicl_loss(*features, labels, self.gather_with_grad)
