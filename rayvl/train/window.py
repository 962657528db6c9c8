"""What a report says about the steps since the previous one: loss, waiting, throughput — each over every rank.

The loss, the image-label rows and the gradient norm stay device tensors between reports: reading one on the host
waits for the GPU, which only a log step may do."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rayvl.data.report import snapshot
from rayvl.train.flops import mfu


@dataclass
class Window:
    """What happened since the last report on this rank: summed loss, time waited for data, samples, rows that
    carry a class label (``labelled_share``: image-label rows, [UniCL])."""

    loss: torch.Tensor | float = 0.0
    wait: float = 0.0
    samples: int = 0
    label_rows: torch.Tensor | int = 0
    steps: int = 0
    first_step: int = 1
    resumed_from: int | None = None
    grad_norm: torch.Tensor | float | None = None
    start: float = field(default_factory=time.perf_counter)
    """when the window began: where the one before it was measured, its evaluation's pause added — its report's wait
    for Ray Train's poll and its checkpoint's writing are this window's time (steps/s over wall time), its evaluation
    is not (``evaluation_s``)"""
    end: float | None = None
    """when ``over_ranks`` measured it"""
    flops_per_sample: float = 0.0
    """training FLOPs of one sample (rayvl.train.flops), 0 = unknown"""
    peak_flops: float | None = None
    """one device's peak FLOP/s at the run's precision (rayvl.train.flops), None = unknown: no MFU"""
    startup: dict[str, float] = field(default_factory=dict)
    """the start-up phases (rayvl.train.startup) when the window holds this start's first step"""

    def add(self, loss: torch.Tensor | float, waited: float, batch: dict, world: int,
            grad_norm: torch.Tensor | float | None = None) -> None:
        """One micro-batch; ``grad_norm``: the norm of an optimizer step that happened after it (None: none)."""
        if grad_norm is not None:  # not `or`: the truth of a device tensor waits for the GPU
            self.grad_norm = grad_norm
        self.loss = self.loss + loss
        self.wait += waited
        self.samples += batch["image"].shape[0] * world
        self.label_rows = self.label_rows + (batch["label"] >= 0).sum() * world  # rows that carry a class id

    def over_ranks(self, device) -> dict:
        """The window's loss and data-wait share, each the mean over ranks: every rank computes the loss of its
        own micro-batch against the gathered features, so the run's loss is their mean, not rank 0's. A
        collective: every rank calls it at the same step."""
        import torch.distributed as dist

        self.end = time.perf_counter()
        elapsed = self.end - self.start
        values = torch.stack([torch.as_tensor(self.loss, dtype=torch.float64, device=device) / max(1, self.steps),
                              torch.tensor(self.wait / elapsed, dtype=torch.float64, device=device)])
        if dist.is_initialized():
            dist.all_reduce(values)  # a device tensor: NCCL takes no other
            values = values / dist.get_world_size()
        loss, wait = values.tolist()
        out = {"loss": loss, "data_wait_share": wait, "samples_per_s": self.samples / elapsed}
        if self.flops_per_sample and self.peak_flops:
            out["mfu"] = mfu(out["samples_per_s"], self.flops_per_sample, self.peak_flops,
                             dist.get_world_size() if dist.is_initialized() else 1)
        return out

    def metrics(self, step: int, engine, report_name: str | None) -> dict:
        metrics = {
            "step": step,
            "first_step": self.first_step,
            **self.over_ranks(engine.device),
            "lr": engine.get_lr()[0],
            "logit_scale": engine.module.scale().item(),
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "labelled_share": int(self.label_rows) / max(1, self.samples),
        }
        if (bias := engine.module.bias()) is not None:  # SigLIP's (loss.kind=siglip)
            metrics["logit_bias"] = bias.item()
        if self.resumed_from is not None:
            metrics["resumed_from"] = self.resumed_from
        metrics.update(self.startup)
        if engine.device.type == "cuda":  # what a batch size needs (rank 0's peak since the start), to size it
            metrics["gpu_memory_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
        if report_name:  # the data report's counts so far (dropped samples by reason, truncated shards)
            metrics.update(snapshot(report_name)["counts"])
        return metrics
