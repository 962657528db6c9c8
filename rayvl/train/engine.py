"""DeepSpeed engine around the dual encoder: ZeRO 0-3, AdamW, warm-up + cosine, gradient clipping.

DeepSpeed joins the process group Ray Train already created (gloo on CPU, NCCL on GPU); on CPU it runs on its
"cpu" accelerator in fp32 or bf16 (fp16 is refused there).
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import torch

from rayvl.config import RayvlConfig, TrainConfig, precision
from rayvl.models.dual_encoder import param_groups
from rayvl.models.precision import keep_batchnorm_fp32


def deepspeed_config(cfg: RayvlConfig, world_size: int) -> dict:
    t = cfg.train
    mode = precision(t)
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accumulation,
        "train_batch_size": t.micro_batch_size * t.grad_accumulation * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero_config(t),
        "bf16": {"enabled": mode == "bf16"},
        "fp16": {"enabled": mode == "fp16"},
        # buffers keep their fp32 (no data_types.buffer_dtype): BatchNorm's statistics and the image normalisation
        # constants; BatchNorm computes with fp32 weights (rayvl.models.precision)
        # a plain torch AdamW: DeepSpeed's fused CPU Adam would JIT-compile on every new machine
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def zero_config(t: TrainConfig) -> dict:
    """DeepSpeed's zero_optimization section. Communication overlaps the backward pass on GPUs only (on CPUs
    there is no second stream to overlap it on); offloaded state lives in pinned host memory."""
    config: dict = {"stage": t.zero_stage}
    if t.zero_stage == 0:
        return config
    config.update(overlap_comm=t.use_gpu and t.zero_overlap_comm, contiguous_gradients=True,
                  reduce_bucket_size=t.zero_bucket_size)
    if t.zero_stage < 3:
        config["allgather_bucket_size"] = t.zero_bucket_size
    else:
        config["stage3_prefetch_bucket_size"] = t.zero_bucket_size
    offload = {"device": "cpu", "pin_memory": t.use_gpu}
    if t.zero_offload != "none":
        config["offload_optimizer"] = offload
    if t.zero_offload == "optimizer_and_params":
        config["offload_param"] = offload
    return config


def lr_lambda(warmup: int, total: int):
    """Linear warm-up then cosine decay to 0 ([Paraphrase] Table B.1: AdamW + cosine with warm-up)."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def build_engine(model: torch.nn.Module, cfg: RayvlConfig, world_size: int, device: torch.device | None = None):
    """``device``: the worker's GPU (rayvl.train.devices). DeepSpeed would otherwise put the model on
    ``cuda:LOCAL_RANK``, which Ray Train does not promise to be the GPU it gave the worker."""
    if not cfg.train.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    t = cfg.train
    if precision(t) != "fp32":  # before DeepSpeed casts the parameters: BatchNorm keeps fp32 statistics
        keep_batchnorm_fp32(model, torch.bfloat16 if precision(t) == "bf16" else torch.float16)
    deepspeed.init_distributed(dist_backend="nccl" if t.use_gpu else "gloo")
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, eps=t.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup_steps, t.max_steps))
    on = SimpleNamespace(device_rank=device.index) if device is not None and device.type == "cuda" else None
    engine, _, _, _ = deepspeed.initialize(args=on, model=model, optimizer=optimizer, lr_scheduler=scheduler,
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
