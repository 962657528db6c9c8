"""What a report says about the steps since the previous one: loss, waiting, throughput — each over every rank."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rayvl.data.report import snapshot


@dataclass
class Window:
    """What happened since the last report on this rank: summed loss, time waited for data, samples, image-label
    rows."""

    loss: float = 0.0
    wait: float = 0.0
    samples: int = 0
    label_rows: int = 0
    steps: int = 0
    first_step: int = 1
    resumed_from: int | None = None
    grad_norm: float | None = None
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss: float, waited: float, batch: dict, world: int) -> None:
        self.loss += loss
        self.wait += waited
        self.samples += batch["image"].shape[0] * world
        self.label_rows += int((batch["label"] >= 0).sum()) * world  # image-label share of batches

    def over_ranks(self, device) -> dict:
        """The window's loss and data-wait share, each the mean over ranks: every rank computes the loss of its
        own micro-batch against the gathered features, so the run's loss is their mean, not rank 0's. A
        collective: every rank calls it at the same step."""
        import torch.distributed as dist

        elapsed = time.perf_counter() - self.start
        values = [self.loss / max(1, self.steps), self.wait / elapsed]
        if dist.is_initialized():
            summed = torch.tensor(values, dtype=torch.float64, device=device)  # a device tensor: NCCL takes no other
            dist.all_reduce(summed)
            values = (summed / dist.get_world_size()).tolist()
        return {"loss": values[0], "data_wait_share": values[1], "samples_per_s": self.samples / elapsed}

    def metrics(self, step: int, engine, report_name: str | None) -> dict:
        metrics = {
            "step": step,
            "first_step": self.first_step,
            **self.over_ranks(engine.device),
            "lr": engine.get_lr()[0],
            "logit_scale": engine.module.scale().item(),
            "grad_norm": self.grad_norm,
            "image_label_share": self.label_rows / max(1, self.samples),
        }
        if self.resumed_from is not None:
            metrics["resumed_from"] = self.resumed_from
        if report_name:  # the data report's counts so far (dropped samples by reason, truncated shards)
            metrics.update(snapshot(report_name)["counts"])
        return metrics
