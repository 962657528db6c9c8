"""The BoW paper's memory bank on every training worker ([BoW] §2.1 eq. (1)–(3), after MoCo): EMA key encoders
that follow the trained towers once per optimizer step, and a queue of their keys as extra negatives."""
from __future__ import annotations

import torch

from rayvl.config import RayvlConfig, precision
from rayvl.losses import gather_features, label_aware_loss
from rayvl.methods.bow.memory_bank import MemoryBank
from rayvl.models.precision import autocast_dtype
from rayvl.train.parts import TrainPart
from rayvl.train.worker import Worker


class MemoryBankPart(TrainPart):
    name = "memory_bank"
    key_encoders = True  # [BoW] eq. (3), MoCo: the EMA towers embed every sample once more

    @staticmethod
    def enabled(cfg: RayvlConfig) -> bool:
        return cfg.memory_bank.size > 0

    def __init__(self, worker: Worker):
        self.cfg, self.device = worker.cfg, worker.device
        self.bank: MemoryBank | None = None

    def model_built(self, model) -> None:
        """The key encoders: a copy of the towers as built, before DeepSpeed casts or partitions them."""
        mb, autocast = self.cfg.memory_bank, autocast_dtype(precision(self.cfg.train))
        self.bank = MemoryBank(model, mb.size, self.cfg.model.embed_dim, mb.momentum, autocast).to(self.device)

    def components(self) -> dict:
        return {"memory_bank": self.bank}

    def after_step(self, engine, step: int) -> bool:
        self.bank.update(engine.module)  # MoCo: the key encoders follow the trained ones once per optimizer step
        return False

    def loss(self, features, batch: dict, labels) -> torch.Tensor:
        """Each query against its EMA positive and every other key: the global batch's EMA keys and the queue
        ([BoW] eq. (1)–(3)); ``labels`` find further positives in both (UniCL)."""
        image, text, scale = features
        keys = [gather_features(k, with_grad=False) for k in (*self.bank.encode(
            batch["image"], batch["input_ids"], batch["attention_mask"]), labels)]
        mb = self.cfg.memory_bank
        # a fill on the device, not a copy from the host: a pageable host-to-device copy waits for the GPU
        bank_scale = scale if mb.learn_temperature else torch.full((), 1.0 / mb.temperature, device=scale.device)
        image_keys, text_keys, key_labels = self.bank.keys(*keys)
        loss = label_aware_loss(image, text, bank_scale, labels, image_keys=image_keys, text_keys=text_keys,
                          key_labels=key_labels)
        self.bank.enqueue(*keys)
        return loss
