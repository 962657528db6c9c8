"""DeepSpeed's ZeRO-1/2/3 optimizer step without reading the GPU from the host.

A GPU runs ahead of the host only while the host never waits for it: one scalar read (``bool(tensor)``,
``.item()``) per step stops the host until every kernel launched so far has finished, and the launch overhead
of the next step then adds to the GPU's time instead of hiding under it. DeepSpeed 0.19's ZeRO steps compute the
gradient norm with one norm kernel per parameter, make its -1 sentinel for a non-finite norm from a fresh host
tensor (a host-to-device copy that waits for the stream), and read the norm back (``is_invalid_grad_norm``: a
``bool()``) to decide whether to skip the step. The methods below replace those of the engine's optimizer
(instance attributes, nothing of DeepSpeed's classes is changed) with the same arithmetic kept on the device:

- ``get_grad_norm_direct``: the L2 norm of this rank's gradients, from one ``_foreach_norm`` over the tensors
  instead of a norm per parameter; non-finite becomes DeepSpeed's -1 sentinel, as before, made on the device;
- ``unscale_and_clip_grads``: the clip coefficient min(1, clip / (norm + 1e-6)) computed as a tensor, an invalid
  norm (non-finite or the -1 sentinel) treated as infinite, as DeepSpeed's own does — but without ``bool()`` —
  and the gradients of such a step set to 0 (non-finite entries included).

The norms these methods return are marked, and DeepSpeed's module-level ``is_invalid_grad_norm`` (with
``combine_grad_norm_groups``, which combines the groups' norms) is wrapped in the ZeRO modules so that for a
marked norm it answers "valid" without reading it: the clip above makes the step of an invalid norm one of zero
gradients, with clipping or without. Any norm not marked — another optimizer's, another caller's — is read as
before.

bf16 needs no loss scaling, so rayvl turns DeepSpeed's bf16 overflow check off (it reads the GPU every step);
without it a step whose gradients are not finite is not skipped but takes zero gradients (DeepSpeed's bf16 step
would take them as they are): AdamW then moves the weights by its momentum and weight decay only, and the report's
loss and grad_norm show the step.

The rest of DeepSpeed's step is unchanged. ``install`` says which were installed; a DeepSpeed whose optimizer
lacks them (another version) keeps its own step.
"""
from __future__ import annotations

import math
import types

import torch

MARK = "_rayvl_checked_on_device"  # a norm whose invalid case the clip handles on the device


def install(engine) -> list[str]:
    """Give ``engine``'s ZeRO-1/2/3 optimizer the device-side norm and clip (nothing for ZeRO-0, which rayvl clips
    itself, and for offloaded ZeRO, whose norm is a host computation anyway); the names of the methods replaced."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if type(optimizer) is DeepSpeedZeroOptimizer and not optimizer.cpu_offload:
        methods = (("get_grad_norm_direct", _grad_norm), ("unscale_and_clip_grads", _unscale_and_clip))
    elif type(optimizer) is DeepSpeedZeroOptimizer_Stage3 and not optimizer.offload_optimizer:
        methods = (("get_grad_norm_direct", _grad_norm_stage3), ("unscale_and_clip_grads", _unscale_and_clip_stage3))
    else:
        return []
    _wrap_validity_checks()
    replaced = []
    for name, method in methods:
        if callable(getattr(optimizer, name, None)):
            setattr(optimizer, name, types.MethodType(method, optimizer))
            replaced.append(name)
    return replaced


def _wrap_validity_checks() -> None:
    """DeepSpeed's ``is_invalid_grad_norm`` answers False for a marked norm, and ``combine_grad_norm_groups``
    marks the combination of marked norms — in the two ZeRO modules that call them, once per process."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    for module in (stage_1_and_2, stage3):
        if getattr(module.is_invalid_grad_norm, MARK, False):
            continue
        is_invalid, combine = module.is_invalid_grad_norm, module.combine_grad_norm_groups

        def is_invalid_unless_marked(norm, _original=is_invalid):
            return False if getattr(norm, MARK, False) else _original(norm)

        def combine_keeping_mark(norm_groups, *args, _original=combine, **kwargs):
            norm_groups = list(norm_groups)
            combined = _original(norm_groups, *args, **kwargs)
            return _marked(combined) if norm_groups and all(getattr(n, MARK, False) for n in norm_groups) \
                else combined

        setattr(is_invalid_unless_marked, MARK, True)
        module.is_invalid_grad_norm, module.combine_grad_norm_groups = is_invalid_unless_marked, combine_keeping_mark


def _marked(norm: torch.Tensor) -> torch.Tensor:
    setattr(norm, MARK, True)
    return norm


def _device_norm(grads: list, device, group, all_reduce_model_parallel) -> torch.Tensor:
    """√(Σ‖g‖²) over ``grads`` and the ranks of ``group`` (then the model-parallel group), on the device;
    non-finite → DeepSpeed's -1 sentinel, made with a fill on the device (DeepSpeed's
    mask_nan_or_inf_with_val_inplace makes it with torch.tensor(-1.0, device=…) — a host-to-device copy that waits
    for the stream — and fills with a tensor value: a scalar read). Marked (see above)."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if grads:
        total = torch.stack(torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())).pow(2).sum().float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if all_reduce_model_parallel is not None:
        all_reduce_model_parallel(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    return _marked(torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0)))


def _grad_norm(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct for the L2 norm, on the device: ‖g‖ over this rank's partition
    of the gradients (padding excluded), summed over the data-parallel group, non-finite → -1."""
    if float(norm_type) != 2.0 or self.model_parallel_rank != 0:  # what rayvl never configures: DeepSpeed's own
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    grads = [g for g in gradients if g is not None and not getattr(g, "_zero_padding", False)]
    return _device_norm(grads, self.device, self.dp_process_group, self._model_parallel_all_reduce)


def _grad_norm_stage3(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct for the L2 norm, on the device: ‖g‖ over this rank's
    partitions of the gradients, summed over the parameters' partition group."""
    if float(norm_type) != 2.0 or self.model_parallel_rank != 0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    if self._autoep_expert_parallel_group(params) is not None:  # expert parallelism: DeepSpeed's own
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    self._assert_same_partition_group(params)
    group = self._get_param_partition_group(params[0])
    # DeepSpeed's rule: where every rank holds a partition of its own, the model-parallel sum would count it twice
    every_rank = self._grad_norm_counts_every_rank(params, group)
    return _device_norm([g for g in gradients if g is not None], self.device, group,
                        None if every_rank else self._model_parallel_all_reduce)


def _clip_coefficient(self, total_norm) -> torch.Tensor:
    """loss scale × max(1, (‖g‖ / scale + 1e-6) / clip) as a device tensor (without clipping: the loss scale), an
    invalid norm making it infinite: such a step's gradients become 0."""
    norm = torch.as_tensor(total_norm, dtype=torch.float32)
    # DeepSpeed's rule: an invalid norm (non-finite, or the -1 sentinel) clips as if it were infinite
    valid = torch.isfinite(norm) & (norm >= 0)
    norm = torch.where(valid, norm, torch.full_like(norm, math.inf))
    if self.clip_grad <= 0.0:
        return torch.where(valid, torch.full_like(norm, self.loss_scale), norm)
    return torch.clamp(((norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0) * self.loss_scale


def _scale(self, grads, combined) -> None:
    inverse = 1.0 / combined
    for g in grads:
        g.data.mul_(inverse)
        g.data.nan_to_num_(0.0, 0.0, 0.0)  # an invalid norm scaled by 0: non-finite entries become 0 too


def _unscale_and_clip(self, grad_groups_flat, total_norm):
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads with the clip coefficient kept a device tensor."""
    if total_norm is None:  # no norm computed (zero_optimization.compute_grad_norm=false): DeepSpeed's own
        return type(self).unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    _scale(self, [g for grad in grad_groups_flat for g in (grad if isinstance(grad, list) else [grad])],
           _clip_coefficient(self, total_norm))


def _unscale_and_clip_stage3(self, sub_group_id, total_norm):
    """DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads with the clip coefficient kept a device tensor."""
    _scale(self, [self.fp32_partitioned_groups_flat[sub_group_id].grad], _clip_coefficient(self, total_norm))
