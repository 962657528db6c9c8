"""Model FLOPs utilisation (MFU): the model FLOPs a run's samples/s stand for, over the devices' dense peak.

Convention (PaLM, Chowdhery et al. 2022, App. B): model FLOPs are the matrix-multiply and convolution FLOPs (2 per
multiply-add) of one training step's forward and backward pass, without rematerialisation, whatever the hardware
ran. They are counted, not estimated as 6·N per token: torch's ``FlopCounterMode`` follows the forward and the
backward that autograd runs for a sample, so a trained layer counts ≈3× its forward (input and weight gradients),
a frozen layer that gradients pass through ≈2×, and a frozen tower that nothing before it trains 1× (rayvl runs it
without a graph: [Paraphrase]'s frozen LM).
"""
from __future__ import annotations

import os
import re
from math import prod

import torch
from torch import nn

PEAK_ENV = "RAYVL_PEAK_TFLOPS"
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")

# Dense (no 2:4 sparsity) peak TFLOP/s from NVIDIA's datasheets: bf16 / fp16 / tf32 on tensor cores, fp32 on the CUDA
# cores. Matched on the words of torch.cuda.get_device_name(), first match wins: a variant before its family.
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("b200",), {"bf16": 2250.0, "fp16": 2250.0}),
    (("gh200",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("h200", "nvl"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("h200",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("h100", "nvl"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("h100", "pcie"), {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (("h100",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM: "NVIDIA H100 80GB HBM3"
    (("a100",), {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # SXM and PCIe alike
    (("a30",), {"bf16": 165.0, "fp16": 165.0, "tf32": 82.0, "fp32": 10.3}),
    (("a40",), {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    # NVIDIA publishes no A10G datasheet; AWS's A10G is listed with the A10's numbers (set RAYVL_PEAK_TFLOPS to differ)
    (("a10g",), {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("a10",), {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("l40s",), {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (("l40",), {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (("l4",), {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # Volta and Turing have fp16 tensor cores only: no bf16, no tf32
    (("v100s",), {"fp16": 130.0, "fp32": 16.4}),
    (("v100", "pcie"), {"fp16": 112.0, "fp32": 14.0}),
    (("v100",), {"fp16": 125.0, "fp32": 15.7}),  # SXM2
    (("t4",), {"fp16": 65.0, "fp32": 8.1}),
)


def table_precision(t, on_gpu: bool) -> str:
    """The peak table's precision of a run with train settings ``t``: its precision (``auto`` resolved), fp32
    products on TF32 tensor cores where ``train.tf32`` turns them on (a GPU's; PyTorch's own default is fp32)."""
    from rayvl.config import precision

    mode = precision(t)
    return "tf32" if mode == "fp32" and on_gpu and t.tf32 else mode


def peak_flops(device_name: str, precision: str) -> float | None:
    """One device's dense peak FLOP/s at ``precision`` (bf16, fp16, tf32 or fp32 — fp32 is PyTorch's default for
    fp32 matrix products; pass tf32 when ``torch.backends.cuda.matmul.allow_tf32`` is on), from the device name
    ``torch.cuda.get_device_name()`` gives; None for a device or precision the table does not know (no MFU then).
    ``RAYVL_PEAK_TFLOPS`` (TFLOP/s) overrides the table, for any device."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    override = os.environ.get(PEAK_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"{PEAK_ENV}={override!r}: a device's peak in TFLOP/s, a number > 0 (e.g. 989.4)")
        return value * 1e12
    words = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    for names, peaks in PEAK_TFLOPS:
        if words.issuperset(names):
            return peaks[precision] * 1e12 if precision in peaks else None
    return None


def mfu(samples_per_s: float, flops_per_sample: float, peak_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation, a share (0.341 = 34.1%): the model FLOP/s the samples stand for over the peak of
    all ``devices`` (PaLM App. B)."""
    return samples_per_s * flops_per_sample / (peak_per_device * devices)


def model_flops_per_sample(model: nn.Module, image_size: int, text_tokens: int, *,
                           key_encoders: bool = False) -> float:
    """Training FLOPs of one (image, caption) sample through the dual encoder ``model`` (rayvl.models.dual_encoder)
    at ``image_size`` px and ``text_tokens`` tokens (the padded length: padding is computed too), counted on a
    batch of 2. Call it on the built model before DeepSpeed wraps it (ZeRO-3 partitions the weights away); the
    model is left as it was — modes, gradients, BatchNorm statistics and the random state. ``key_encoders``: add
    a training part's EMA key encoders, one more forward of both towers per sample (MoCo's momentum encoder), with
    every patch token: the EMA copy runs as at evaluation, where a ViT's patch dropout keeps them all. The contrastive
    loss's similarity matrix is not counted: it grows with the global batch, not with the model."""
    device = next(model.parameters()).device
    batch = 2
    image = torch.zeros(batch, 3, image_size, image_size, dtype=torch.uint8, device=device)
    input_ids = torch.zeros(batch, text_tokens, dtype=torch.long, device=device)
    attention_mask = torch.ones(batch, text_tokens, dtype=torch.long, device=device)
    inputs = (image, input_ids, attention_mask)
    forward, total = _count(model, *inputs)
    if key_encoders and any(type(m).__name__ == "PatchDropout" for m in model.modules()):
        forward, _ = _count(model, *inputs, patch_dropout=False)
    return (total + (forward if key_encoders else 0)) / batch


def _count(model: nn.Module, *inputs: torch.Tensor, patch_dropout: bool = True) -> tuple[int, int]:
    """(forward FLOPs, forward + backward FLOPs) of ``model(*inputs)``, the model restored afterwards;
    ``patch_dropout=False``: as at evaluation, every patch token."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    modes = {m: m.training for m in model.modules()}
    grads = {p: p.grad for p in model.parameters()}
    # rematerialisation is not model FLOPs: checkpointing off (timm's flag; HF's and rayvl's act in training only)
    checkpointed = [m for m in model.modules() if getattr(m, "grad_checkpointing", False) is True]
    model.eval()  # the same products as training, without touching BatchNorm statistics or drawing dropout masks
    for m in model.modules():  # ... but a ViT's patch dropout (FLIP) as in training: the tokens it leaves are the
        if type(m).__name__ == "PatchDropout":  # products computed (its kept count is fixed, only which ones vary)
            m.training = patch_dropout
    for m in checkpointed:
        m.grad_checkpointing = False
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward})
    try:
        # attention as plain matrix products, which the counter knows on every device (it has no formula for
        # CPU's fused attention kernel)
        device = next(model.parameters()).device  # patch dropout draws there: the run's stream stays untouched
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad(), \
                sdpa_kernel(SDPBackend.MATH), counter:
            outputs = [t for t in model(*inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
            forward = counter.get_total_flops()
            if outputs:  # a surrogate loss: elementwise (not counted), its gradients reach every trained layer
                sum(t.float().sum() for t in outputs).backward()
            total = counter.get_total_flops()
    finally:
        for m, training in modes.items():
            m.training = training
        for m in checkpointed:
            m.grad_checkpointing = True
        for p, grad in grads.items():
            p.grad = grad
    return forward, total


def _conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                   _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """A convolution's backward: the input gradient and the weight gradient each take the forward's products.
    torch's own formula counts the weight gradient of a grouped convolution as if ungrouped (× the groups: ×C for a
    depthwise one, EfficientNet's)."""
    spatial = (x_shape if transposed else grad_out_shape)[2:]
    c_out, c_in_per_group, *kernel = w_shape
    forward = 2 * x_shape[0] * prod(spatial) * prod(kernel) * c_out * c_in_per_group
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def speed_fields(model: nn.Module, cfg, device: torch.device, key_encoders: bool = False) -> dict:
    """Window's MFU fields for a run: the FLOPs of a sample (``key_encoders``: with a second forward of both towers,
    a training part's EMA copy) and the device's peak at the run's precision ({} where the peak is unknown — a CPU
    unless RAYVL_PEAK_TFLOPS names one). Called before DeepSpeed: ZeRO-3 partitions the weights away."""
    peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      table_precision(cfg.train, device.type == "cuda"))
    if peak is None:
        return {}
    return {"peak_flops": peak, "flops_per_sample": model_flops_per_sample(
        model, cfg.data.image_size, cfg.data.max_text_tokens, key_encoders=key_encoders)}
