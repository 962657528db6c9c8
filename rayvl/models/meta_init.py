"""A module whose weights are about to be loaded is built without initialising them.

A tower's random init is wasted work where weights follow (a pretrained backbone, a checkpoint, an export): timm's
ViT-B/32 spends most of its build drawing truncated normals for 88M parameters that the load then overwrites, ViT-L/14
longer still — in every training worker and every evaluation actor, before its first batch.
``parameters_on_meta`` builds with the parameters on PyTorch's meta device, where init functions are no-ops;
``load_into`` then gives them memory and copies the weights in (a copy, not an assignment: a state in another dtype —
CLIP's fp16 release — or memory-mapped from a file stays the loader's). Buffers are built for real: a non-persistent
one (BERT's position ids) is computed, not loaded, and so must exist.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn

_patching = threading.Lock()  # the patch is process-wide: one build at a time under it


@contextmanager
def parameters_on_meta():
    """Every parameter registered meanwhile lives on the meta device (no memory, its init a no-op); buffers stay
    real. Only for modules whose every parameter ``load_into`` fills next."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with _patching:
        nn.Module.register_parameter = on_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = register


def load_into(module: nn.Module, state: dict, device: str | torch.device = "cpu") -> nn.Module:
    """``module``'s meta parameters given (uninitialised) memory on ``device``, then ``state`` loaded strictly: every
    parameter is in a state dict, so none is left uninitialised — a key ``state`` lacks fails as any strict load."""
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    module.load_state_dict(state, strict=True)
    return module
