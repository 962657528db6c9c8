"""DeepSpeed's ZeRO-1/2 optimizer step without reading the GPU from the host.

A GPU runs ahead of the host only while the host never waits for it: one scalar read (``bool(tensor)``,
``.item()``) per step stops the host until every kernel launched so far has finished, and the launch overhead
of the next step then adds to the GPU's time instead of hiding under it. DeepSpeed 0.19's ZeRO-1/2 step reads
the gradient norm back twice to decide how to clip, and computes it with one norm kernel per parameter. The two
methods below replace those of the engine's optimizer (instance attributes, nothing of DeepSpeed's classes is
changed) with the same arithmetic kept on the device:

- ``get_grad_norm_direct``: the L2 norm of this rank's gradients in fp64, from one ``_foreach_norm`` over the
  tensors instead of a norm per parameter; non-finite becomes DeepSpeed's -1 sentinel, as before;
- ``unscale_and_clip_grads``: the clip coefficient min(1, clip / (norm + 1e-6)) computed as a tensor, an invalid
  norm (non-finite or the -1 sentinel) treated as infinite, as DeepSpeed's own does — but without ``bool()`` —
  and the gradients of such a step set to 0 (non-finite entries included).

bf16 needs no loss scaling, so rayvl turns DeepSpeed's bf16 overflow check off (it reads the GPU every step);
without it a step whose gradients are not finite is not skipped but takes zero gradients: AdamW then moves the
weights by its momentum and weight decay only, and the report's loss and grad_norm show the step.

The rest of DeepSpeed's step is unchanged. ``install`` says which were installed; a DeepSpeed whose optimizer
lacks them (another version) keeps its own step.
"""
from __future__ import annotations

import math
import types

import torch


def install(engine) -> list[str]:
    """Give ``engine``'s ZeRO-1/2 optimizer the device-side norm and clip (nothing for ZeRO-0 and ZeRO-3, whose
    steps are other code); the names of the methods replaced."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if type(optimizer) is not DeepSpeedZeroOptimizer or optimizer.cpu_offload:
        return []  # offloaded ZeRO keeps its state on the host: its norm is a host computation anyway
    replaced = []
    for name, method in (("get_grad_norm_direct", _grad_norm), ("unscale_and_clip_grads", _unscale_and_clip)):
        if callable(getattr(optimizer, name, None)):
            setattr(optimizer, name, types.MethodType(method, optimizer))
            replaced.append(name)
    return replaced


def _grad_norm(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct for the L2 norm, on the device: ‖g‖ over this rank's partition
    of the gradients (padding excluded), summed over the data-parallel group, non-finite → -1."""
    import deepspeed.comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0 or self.model_parallel_rank != 0:  # what rayvl never configures: DeepSpeed's own
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    grads = [g for g in gradients if g is not None and not getattr(g, "_zero_padding", False)]
    if grads:
        norms = torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())
        total = torch.stack(norms).pow(2).sum().float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total


def _unscale_and_clip(self, grad_groups_flat, total_norm):
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads with the clip coefficient kept a device tensor."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    combined = self.loss_scale
    if self.clip_grad > 0.0:
        norm = torch.as_tensor(total_norm, dtype=torch.float32)
        # DeepSpeed's rule: an invalid norm (non-finite, or the -1 sentinel) clips as if it were infinite
        norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.full_like(norm, math.inf))
        clip = torch.clamp(((norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
        combined = clip * self.loss_scale
    inverse = 1.0 / combined
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(inverse)
            if self.clip_grad > 0.0:  # an invalid norm scaled by 0: non-finite entries become 0 too
                g.data.nan_to_num_(0.0, 0.0, 0.0)
