"""BatchNorm in fp32 inside a bf16 / fp16 model.

DeepSpeed casts every parameter to the training dtype. BatchNorm's running statistics average many batches' moments,
which a bf16 buffer (8 bits of mantissa) cannot hold apart from each other; PyTorch's batch norm takes a bf16 input
with fp32 weights and fp32 statistics (the mixed form AMP uses), but refuses bf16 weights with fp32 statistics. So the
statistics stay fp32 buffers and each BatchNorm computes with an fp32 view of its bf16 weights, whose gradients flow
back to them. The forward reads the weights as attributes and never replaces them: ZeRO-3 gathers a partitioned
parameter when its module reads it.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def autocast_dtype(mode: str) -> torch.dtype | None:
    """The dtype a run of precision ``mode`` (rayvl.config.precision: bf16, fp16, fp32) computes its forwards in;
    None for fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


def keep_batchnorm_fp32(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Every BatchNorm of ``model`` (torch's and timm's BatchNormAct2d) computes with fp32 weights and keeps fp32
    running statistics whatever ``dtype`` its parameters are cast to later; a BatchNorm of another kind, whose
    forward this cannot stand in for, gets its statistics in ``dtype`` (the form torch accepts for them). Returns how
    many modules keep fp32 statistics."""
    kept = 0
    frozen = _frozen_kinds()
    for module in model.modules():
        if isinstance(module, frozen) and not getattr(module, "_rayvl_fp32", False):
            module.forward = types.MethodType(_frozen_forward, module)  # fp32 statistics, the input's dtype out
            module._rayvl_fp32 = True
            kept += 1
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or getattr(module, "_rayvl_fp32", False):
            continue
        if type(module).forward in _forwards():
            # a bound method, not a closure: a deep copy (the memory bank's key encoders) rebinds it to the copy
            module.forward = types.MethodType(_fp32_forward, module)
            module._rayvl_fp32 = True
            kept += 1
        else:
            for name in ("running_mean", "running_var"):
                if getattr(module, name) is not None:
                    setattr(module, name, getattr(module, name).to(dtype))
    return kept


def _forwards() -> tuple:
    """The forwards ``_fp32_forward`` reproduces: torch's BatchNorm{1,2,3}d and timm's BatchNormAct2d (its batch
    norm followed by its dropout and activation)."""
    from rayvl.compat import import_timm

    import_timm()  # as the towers import it: next to a CPU torch, without wandb
    from timm.layers import BatchNormAct2d

    return nn.modules.batchnorm._BatchNorm.forward, BatchNormAct2d.forward


def _frozen_kinds() -> tuple:
    """timm's frozen BatchNorms (model.vision_freeze_bn_stats): statistics as buffers, which DeepSpeed leaves fp32."""
    from timm.layers import FrozenBatchNormAct2d
    from timm.layers.norm_act import FrozenBatchNorm2d

    return FrozenBatchNorm2d, FrozenBatchNormAct2d


def _frozen_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A frozen BatchNorm's affine map in fp32, its output in the input's dtype (bf16 in, bf16 out: the next layer's
    weights are bf16)."""
    scale = module.weight.float() * (module.running_var.float() + module.eps).rsqrt()
    shift = module.bias.float() - module.running_mean.float() * scale
    y = (x.float() * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)).to(x.dtype)
    if hasattr(module, "act") and hasattr(module, "drop"):  # timm's FrozenBatchNormAct2d
        y = module.act(module.drop(y))
    return y


def _fp32_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's _BatchNorm.forward (momentum, cumulative average, eval without statistics) over fp32 weights."""
    momentum = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:  # a cumulative moving average
            momentum = 1.0 / float(module.num_batches_tracked)
    use_batch = module.training or (module.running_mean is None and module.running_var is None)
    track = not module.training or module.track_running_stats
    weight, bias = (None if p is None else p.float() for p in (module.weight, module.bias))
    y = F.batch_norm(x, module.running_mean if track else None, module.running_var if track else None,
                     weight, bias, use_batch, momentum, module.eps)
    if hasattr(module, "act") and hasattr(module, "drop"):  # timm's BatchNormAct2d
        y = module.act(module.drop(y))
    return y
