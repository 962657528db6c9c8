"""DeepSpeed engine around the dual encoder: ZeRO 0-3, AdamW, warm-up + cosine, gradient clipping.

DeepSpeed joins the process group Ray Train already created (gloo on CPU, NCCL on GPU); on CPU it runs on its
"cpu" accelerator in fp32 or bf16 (fp16 is refused there).
"""
from __future__ import annotations

import math
import os

import torch

from rayvl.config import RayvlConfig
from rayvl.models.dual_encoder import param_groups


def deepspeed_config(cfg: RayvlConfig, world_size: int) -> dict:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accumulation,
        "train_batch_size": t.micro_batch_size * t.grad_accumulation * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
        # DeepSpeed casts parameters only; BatchNorm's running statistics must follow its weights (CPU and CUDA
        # batch_norm refuse bf16 weights with fp32 statistics), the image normalisation constants stay fp32
        **({"data_types": {"buffer_dtype": "bf16" if t.precision == "bf16" else "fp16",
                           "keep_in_fp32_modules": [r"^vision\.(mean|std)$"]}} if t.precision != "fp32" else {}),
        # a plain torch AdamW: DeepSpeed's fused CPU Adam would JIT-compile for ~70 s on every new machine
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def lr_lambda(warmup: int, total: int):
    """Linear warm-up then cosine decay to 0 ([Paraphrase] Table B.1: AdamW + cosine with warm-up)."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def build_engine(model: torch.nn.Module, cfg: RayvlConfig, world_size: int):
    if not cfg.train.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    t = cfg.train
    deepspeed.init_distributed(dist_backend="nccl" if t.use_gpu else "gloo")
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, eps=t.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup_steps, t.max_steps))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, world_size))
    return engine


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
