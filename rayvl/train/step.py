"""One optimizer step on a training worker, all of it here: the micro-batches' forward and loss, the backward, the
gradient clip and the guard against non-finite gradients, the optimizer step.

    for each of train.grad_accumulation micro-batches:
        batch  = next_batch(step, micro)                 uint8 images and token ids, already on the device
        loss   = Objective(engine, batch)                both towers (rayvl.models.dual_encoder), then the loss of
                                                         rayvl.losses the enabled methods' parts choose
        engine.backward(loss)                            DeepSpeed: gradients reduced across ranks (ZeRO: partitioned)
        clip_and_step(engine)                            DeepSpeed counts micro-steps; at the last one:
            ZeRO-0 (bf16 / fp32)   rayvl clips here: one foreach norm over the reduced gradients, one foreach
                                   scale; a non-finite norm skips the step on the device (fused AdamW's found_inf)
            ZeRO ≥ 1, or fp16      DeepSpeed clips inside engine.step(): its optimizer's norm and clip are the
                                   device-side ones rayvl.train.syncfree installs; a non-finite norm zeroes the
                                   step's gradients (fp16: DeepSpeed's loss scaler skips it)
            engine.step()          the optimizer, the learning-rate schedule

Nothing here reads the device from the host (``rayvl check census`` counts it): the loss and the gradient norm go to
the report's ``Window`` as device tensors, the rows' ids to the row ledger (rayvl.train.resume).
"""
from __future__ import annotations

import math

import torch

from rayvl.config import RayvlConfig, TrainConfig, precision
from rayvl.losses import clip_loss, label_aware_loss, siglip_loss
from rayvl.train.parts import TrainPart
from rayvl.train.window import Window


def unique_labels(batch: dict, batch_index: int) -> torch.Tensor:
    """One label per row, unique across ranks, steps and so across a memory bank's queue: every image-text row is
    its own class ([UniCL] Algorithm 1, TargetM)."""
    b = batch["label"].shape[0]
    return -1 - (batch_index * b + torch.arange(b, device=batch["label"].device))


class Objective:
    """The loss of a micro-batch, chosen once from the enabled methods' parts (open_clip's ``create_loss``): InfoNCE
    over the gathered batch; label-aware InfoNCE ([UniCL] eq. (1)–(3)) where a part gives the targets; a part's own
    loss (a memory bank's keys, UniCL's class embeddings) where one gives it; with ``siglip``, SigLIP's sigmoid
    loss, positives where the labels agree (the model then returns its logit bias too)."""

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
        return label_aware_loss(*features, labels, self.gather_with_grad)


class Step:
    """This worker's optimizer step: the engine, the objective, the row ledger, who clips and the report window its
    steps add to (the loop starts a new one after each report), held once; called with where batches come from
    and the step's number."""

    def __init__(self, engine, parts: list[TrainPart], cfg: RayvlConfig, rows, rank: int = 0, world: int = 1,
                 window: Window | None = None):
        t = cfg.train
        self.engine, self.rows, self.rank, self.world = engine, rows, rank, world
        self.window = window or Window()
        self.objective = Objective(parts, cfg.loss.gather_with_grad, cfg.loss.kind == "siglip")
        self.accumulation = t.grad_accumulation
        # the max norm where rayvl clips (0 = no clip, the non-finite guard still on); None: DeepSpeed clips
        self.grad_clip = t.grad_clip if rayvl_clips(t) else None

    def __call__(self, next_batch, step: int) -> None:
        """Optimizer step ``step``: ``next_batch(step, micro)`` → (batch on the device, seconds waited) for each
        micro-batch, forward, backward and ``clip_and_step`` (whose optimizer step happens at the last); what the
        report needs, added to ``window``."""
        window = self.window
        for micro in range(self.accumulation):
            batch, waited = next_batch(step, micro)
            self.rows.add(batch)
            index = ((step - 1) * self.accumulation + micro) * self.world + self.rank  # unique over ranks and steps
            loss = self.objective(self.engine, batch, index)
            self.engine.backward(loss)
            norm = clip_and_step(self.engine, self.grad_clip)
            window.add(loss.detach() / self.accumulation, waited, batch, self.world, grad_norm=norm)
        broadcast_buffers(self.engine.module)  # one set of BatchNorm statistics, as DDP keeps it
        window.steps += 1


def clip_and_step(engine, grad_clip: float | None) -> torch.Tensor | float | None:
    """``engine.step()`` (DeepSpeed counts micro-steps: only the last of an accumulation steps the optimizer); there,
    the global gradient norm before clipping (a device tensor where it is one: read at log steps only). Where rayvl
    clips (``grad_clip`` not None) it clips here and a step whose norm is not finite is skipped on the device: the
    fused AdamW takes it as GradScaler's ``found_inf`` (weights, moments and step count unchanged), with no read of
    the norm. Where DeepSpeed clips, its optimizer kept the norm (rayvl.train.syncfree)."""
    norm, boundary = None, engine.is_gradient_accumulation_boundary()
    if boundary and grad_clip is not None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        if params:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip or math.inf, foreach=True)
            engine.optimizer.found_inf = (~torch.isfinite(norm)).float()
    engine.step()
    if boundary:
        clamp_temperature(engine)
    if norm is None and boundary:
        norm = engine.get_global_grad_norm()
    return norm


@torch.no_grad()
def clamp_temperature(engine) -> None:
    """open_clip's clamp of the temperature after each optimizer step (open_clip_train/train.py: log(1/τ) at most
    ln 100; its lower bound, 0, is not taken: model.init_logit_scale may lie below 1), on the copy the optimizer
    steps — in place, so nothing waits: the parameter itself at ZeRO-0 under autocast, else DeepSpeed's fp32
    master of it: FP16_UnfusedOptimizer's copy (ZeRO-0 fp16), the fragment this rank holds at ZeRO-1/2 (none on the
    others), its stretch of this rank's flat partition at ZeRO-3. The forward clamps too (DualEncoder.scale), so the
    bf16 copy a step refreshed before this clamp changes nothing."""
    module = engine.module
    p = getattr(module, "logit_scale", None)
    if p is None or not p.requires_grad:
        return
    master = _master_copy(engine.optimizer, p)
    if master is not None:
        master.clamp_(max=math.log(module.cfg.max_logit_scale))


def _master_copy(optimizer, p: torch.nn.Parameter) -> torch.Tensor | None:
    """The tensor the optimizer steps for ``p`` on this rank (a view; None where another rank holds it)."""
    if hasattr(p, "ds_id"):  # ZeRO-3 (its own accessors synchronise a stream and copy: this view does neither)
        z3 = p._z3_optimizer
        group, offset, n = z3.grad_position[z3.get_param_id(p)]
        return z3.fp32_partitioned_groups_flat[group].narrow(0, offset, n)
    if hasattr(p, "_hp_mapping"):  # ZeRO-1/2 and DeepSpeed's bf16 optimizer (None where another rank holds it)
        return p._hp_mapping.get_hp_fragment() if p._hp_mapping is not None else None
    for lp_group, hp_group in zip(getattr(optimizer, "fp16_groups", ()), getattr(optimizer, "fp32_groups", ())):
        for lp, hp in zip(lp_group, hp_group):  # ZeRO-0 fp16
            if lp is p:
                return hp
    return p


def rayvl_clips(t: TrainConfig) -> bool:
    """Whether rayvl clips the gradients itself (ZeRO-0 in fp32 or autocast: one foreach norm over the all-reduced
    gradients, ``clip_and_step`` above) rather than DeepSpeed (ZeRO ≥ 1, and fp16, whose gradients are
    loss-scaled: engine.deepspeed_config then gives it the max norm)."""
    return t.zero_stage == 0 and precision(t) != "fp16"


@torch.no_grad()
def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm running statistics) to every rank, coalesced per dtype. DeepSpeed, unlike DDP
    (broadcast_buffers=True), leaves each rank's running statistics to drift with its own batches; evaluation,
    the consolidated checkpoint (rank 0's) and the memory bank's EMA copy need the one model every rank holds."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    by_dtype: dict = {}
    for b in module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    for buffers in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(buffers)
        dist.broadcast(flat, src=0)
        for b, synced in zip(buffers, torch._utils._unflatten_dense_tensors(flat, buffers)):
            b.copy_(synced)
