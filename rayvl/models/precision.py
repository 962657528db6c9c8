"""BatchNorm in fp32 inside a bf16 / fp16 model.

DeepSpeed casts every parameter to the training dtype. BatchNorm's running statistics average many batches' moments,
which a bf16 buffer (8 bits of mantissa) cannot hold apart from each other; PyTorch's batch norm takes a bf16 input
with fp32 weights and fp32 statistics (the mixed form AMP uses), but refuses bf16 weights with fp32 statistics. So the
statistics stay fp32 buffers and each BatchNorm computes with an fp32 view of its bf16 weights, whose gradients flow
back to them.
"""
from __future__ import annotations

import types

import torch
from torch import nn


def keep_batchnorm_fp32(model: nn.Module) -> int:
    """Every BatchNorm of ``model`` (timm's BatchNormAct2d too) computes with fp32 weights and keeps fp32 running
    statistics whatever dtype its parameters are cast to later. Returns how many modules it changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not getattr(module, "_rayvl_fp32", False):
            # a bound method, not a closure: a deep copy (the memory bank's key encoders) rebinds it to the copy
            module.forward = types.MethodType(_fp32_weights, module)
            module._rayvl_fp32 = True
            changed += 1
    return changed


def _fp32_weights(module: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    params = module._parameters
    cast = {k: p for k, p in params.items() if p is not None and p.dtype in (torch.bfloat16, torch.float16)}
    # the module's own forward (timm's adds its activation) over fp32 copies that carry the gradients back
    params.update({k: p.float() for k, p in cast.items()})
    try:
        return type(module).forward(module, x, *args, **kwargs)
    finally:
        params.update(cast)
