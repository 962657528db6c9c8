"""EMA memory bank ([BoW] §2.1 eq. (1)–(3), after MoCo [17]).

An exponential-moving-average copy of both towers, f' and g', encodes the keys; a queue keeps the last K image keys
and K text keys (with their labels, so UniCL finds positives in it) filled with the EMA features of the global
batch gathered from every worker. A query u_i is scored against its EMA positive v'_i and every other key:

    L_i^image = −log exp(d(u_i, v'_i)/τ) / Σ_j exp(d(u_i, v'_j)/τ)          (1)
    L_i^text  = −log exp(d(v_i, u'_i)/τ) / Σ_j exp(d(v_i, u'_j)/τ)          (2)
    L = 1/(2B) Σ_i L_i^image + L_i^text                                    (3)

with the sum over the global batch's EMA keys and the queue, τ = 0.02 (fixed by default). Every rank holds the same
EMA weights and the same queue (the same updates from the same gathered keys), so the bank adds no communication
beyond the gather. ZeRO-3 is refused at config load: the EMA update needs every full parameter on every rank at
every step, which ZeRO-3 exists to avoid (gathering them each step would undo its memory savings).
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn


class MemoryBank:
    def __init__(self, model: nn.Module, size: int, dim: int, momentum: float, autocast: torch.dtype | None = None):
        """``autocast``: the dtype the trained towers compute in (bf16 on GPUs), for the key encoders' forward."""
        self.ema = copy.deepcopy(model).eval().requires_grad_(False)
        self.momentum, self.size, self.autocast = momentum, size, autocast
        self.pairs: tuple[list, list] | None = None  # (EMA, trained) parameters that train: update()'s lists
        device = next(model.parameters()).device
        self.images = torch.zeros(size, dim, device=device)
        self.texts = torch.zeros(size, dim, device=device)
        self.labels = torch.zeros(size, dtype=torch.long, device=device)
        self.ptr, self.filled = 0, 0

    def to(self, device) -> "MemoryBank":
        """Follow the engine's device (DeepSpeed moves the trained model; this copy is not part of it)."""
        self.ema.to(device)
        self.images, self.texts, self.labels = (t.to(device) for t in (self.images, self.texts, self.labels))
        return self

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """θ' ← m·θ' + (1 − m)·θ for every trained parameter (frozen ones stay equal: their EMA is themselves);
        buffers are copied."""
        if self.pairs is None:  # once: the parameter objects stay (DeepSpeed re-points their data, not them)
            ema = dict(self.ema.named_parameters())
            trained = [(ema[name], p) for name, p in model.named_parameters() if p.requires_grad]
            self.pairs = ([e for e, _ in trained], [p for _, p in trained])
        ema, trained = self.pairs
        # foreach: a kernel per list, not one per tensor and operation (on a GPU each is a launch)
        torch._foreach_mul_(ema, self.momentum)
        torch._foreach_add_(ema, trained, alpha=1.0 - self.momentum)
        buffers = list(self.ema.buffers())
        if buffers:
            torch._foreach_copy_(buffers, list(model.buffers()))

    @torch.no_grad()
    def encode(self, images, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """EMA keys (u', v') of a local batch, computed in the precision the trained towers compute in (the copy
        keeps fp32 weights, whose fp32 forward would cost a GPU twice the trained towers' bf16 one), made fp32."""
        cast = torch.autocast(images.device.type, self.autocast) if self.autocast else contextlib.nullcontext()
        with cast:
            image, text = self.ema.encode_image(images), self.ema.encode_text(input_ids, attention_mask)
        # unit length in fp32: the queue keeps them for many steps, and where autocast normalises in bf16 (on CPUs)
        # a key's length is off by up to ~1e-3
        return nn.functional.normalize(image.float(), dim=-1), nn.functional.normalize(text.float(), dim=-1)

    def keys(self, images: torch.Tensor, texts: torch.Tensor, labels: torch.Tensor):
        """The global batch's EMA keys followed by the filled part of the queue (with labels)."""
        n = self.filled
        return (torch.cat([images, self.images[:n]]), torch.cat([texts, self.texts[:n]]),
                torch.cat([labels, self.labels[:n]]))

    @torch.no_grad()
    def enqueue(self, images: torch.Tensor, texts: torch.Tensor, labels: torch.Tensor) -> None:
        """Write the newest keys at the pointer, wrapping around; the oldest entries are overwritten first."""
        n = images.shape[0]
        if n >= self.size:  # a global batch larger than the queue: keep its newest K
            images, texts, labels, n = images[-self.size:], texts[-self.size:], labels[-self.size:], self.size
        idx = (self.ptr + torch.arange(n, device=self.images.device)) % self.size
        self.images[idx], self.texts[idx], self.labels[idx] = images.float(), texts.float(), labels
        self.ptr = (self.ptr + n) % self.size
        self.filled = min(self.size, self.filled + n)

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "images": self.images, "texts": self.texts, "labels": self.labels,
                "ptr": self.ptr, "filled": self.filled, "momentum": self.momentum}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])
        self.images.copy_(state["images"])
        self.texts.copy_(state["texts"])
        self.labels.copy_(state["labels"])
        self.ptr, self.filled = int(state["ptr"]), int(state["filled"])
