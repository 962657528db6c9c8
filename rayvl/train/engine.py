"""DeepSpeed engine around the dual encoder: ZeRO 0-3, AdamW, warm-up + cosine, gradient clipping.

DeepSpeed joins the process group Ray Train already created (gloo on CPU, NCCL on GPU); on CPU it runs on its
"cpu" accelerator in fp32 or bf16 (fp16 is refused there).
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch

from rayvl.checkpoints import CURRENT_DECAY_RULE
from rayvl.compat import import_without
from rayvl.config import RayvlConfig, TrainConfig, precision
from rayvl.models.dual_encoder import param_groups
from rayvl.models.precision import keep_batchnorm_fp32
from rayvl.train import syncfree


def autocast_bf16(t: TrainConfig) -> bool:
    """bf16 at ZeRO-0 is torch's autocast over fp32 weights (DeepSpeed's ``torch_autocast``), as open_clip and
    PyTorch AMP train: DeepSpeed's own bf16 at ZeRO-0 is its fp16 optimizer without loss scaling, which checks and
    norms every gradient tensor on its own and reads each check back from the GPU. ZeRO ≥ 1 keeps DeepSpeed's bf16
    weights with fp32 master copies in the optimizer's partitions."""
    return precision(t) == "bf16" and t.zero_stage == 0


def deepspeed_config(cfg: RayvlConfig, world_size: int, aligned: bool = True) -> dict:
    from rayvl.train.step import rayvl_clips  # here: the step's module brings the report window's Ray with it

    t = cfg.train
    if t.zero_stage == "auto":
        raise ValueError("train.zero_stage=auto reached the engine: rayvl.train.layout.resolve decides it before the "
                         "workers start")
    mode = precision(t)
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accumulation,
        "train_batch_size": t.micro_batch_size * t.grad_accumulation * world_size,
        "gradient_clipping": 0.0 if rayvl_clips(t) else t.grad_clip,
        "zero_optimization": zero_config(t, world_size, aligned),
        # bf16 needs no loss scaling, so no overflow check: DeepSpeed's walks every gradient and reads the GPU;
        # a step with non-finite gradients takes zero gradients instead (rayvl.train.syncfree)
        "bf16": {"enabled": mode == "bf16" and not autocast_bf16(t), "check_grad_overflow": False},
        "fp16": {"enabled": mode == "fp16"},
        # DeepSpeed's throughput timer synchronises the device twice a step; rayvl's reports time the windows
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        # buffers keep their fp32 (no data_types.buffer_dtype): BatchNorm's statistics and the image normalisation
        # constants; BatchNorm computes with fp32 weights (rayvl.models.precision)
        # a plain torch AdamW: DeepSpeed's fused CPU Adam would JIT-compile on every new machine
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if autocast_bf16(t):
        # no module listed as safe in bf16: gradients are all-reduced in fp32, as DDP under autocast does
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    return config


def zero_config(t: TrainConfig, world_size: int = 2, aligned: bool = True) -> dict:
    """DeepSpeed's zero_optimization section. Communication overlaps the backward pass on GPUs of a group of two or
    more only (on CPUs there is no second stream to overlap it on, and one GPU has nothing to communicate — the
    overlap would only add its end-of-backward synchronisation); offloaded state lives in pinned host memory.
    ``aligned``: ZeRO-1/2's flat buffers padded so that every parameter starts 16-byte aligned — unpadded, the
    1-element logit scale put every later bias 2 bytes off, and cuBLAS ran those linear layers on its alignment-1
    kernels (an H100's profile: docs/gpu.md). A checkpoint loads only into the padding it was written with, so a
    resume takes its checkpoint's (rayvl.train.resume.aligned_buffers: none recorded = unpadded)."""
    config: dict = {"stage": t.zero_stage}
    if t.zero_stage == 0:
        return config
    # DeepSpeed hooks every gradient (a Python call each on the autograd thread) at ZeRO-1 whenever overlap_comm or
    # contiguous_gradients is on, and at ZeRO-2 always: ZeRO-1 goes without both and reduces the gradients once
    # after the backward; contiguous_gradients also copies each gradient into a bucket as it is made, which costs
    # host time a step (benchmarks/host_time.py) and saves fragmentation only near the GPU's memory limit
    config.update(overlap_comm=t.zero_stage > 1 and t.use_gpu and t.zero_overlap_comm and world_size > 1,
                  contiguous_gradients=t.zero_stage == 3 or t.zero_contiguous_gradients,
                  reduce_bucket_size=t.zero_bucket_size)
    if t.zero_stage < 3:
        config["parameter_alignment"] = aligned
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


def lr_lambda(warmup: int, total: int, kind: str = "cosine", cooldown: int = 0, power: float = 1.0,
              end: float = 0.0):
    """The learning rate at a step as a share of train.lr: linear warm-up, then cosine decay to 0 ([Paraphrase]
    Table B.1: AdamW + cosine with warm-up), constant, or constant with a cooldown over the last ``cooldown`` steps,
    (1 − t)^power from 1 down to ``end`` (a share of train.lr) — open_clip's cosine_lr, const_lr and
    const_lr_cooldown, step for step."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or (kind == "constant_cooldown" and step < total - cooldown):
            return 1.0
        if kind == "constant_cooldown":
            return (1 - (step - (total - cooldown)) / cooldown) ** power * (1 - end) + end
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def schedule(t) -> Callable[[int], float]:
    """lr_lambda of the run's train section."""
    return lr_lambda(t.warmup_steps, t.max_steps, t.lr_schedule, t.cooldown_steps, t.cooldown_power,
                     t.cooldown_end_lr / t.lr)


def no_cpu_comm_op() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory communication op when its process group starts
    (``deepspeed.comm.torch.build_shm_op``; a minute on 2 cores) for its inference all-reduce (AutoTP inference),
    which training never calls: its collectives go through torch.distributed (gloo). Built at run time, the op
    depended on a writable extensions cache, on which `ninja` came first on PATH (pip's and a system one each take the
    other's build for out of date) and on a lock that a process killed mid-build leaves behind, on which every later
    run then waited with no message. rayvl marks the op incompatible in DeepSpeed's table of ops, which DeepSpeed
    keeps for such edits (``deepspeed.ops.__compatible_ops__``): no run compiles it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def use_own_ninja() -> None:
    """torch JIT-builds DeepSpeed's other CPU ops (the CPU Adam of ``train.zero_offload``) with the first `ninja` on
    PATH; this interpreter's (pip's, a DeepSpeed requirement) comes first, so that a process started without the venv
    activated does not take the build of another for out of date and build again."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if os.path.exists(os.path.join(bin_dir, "ninja")) and path[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *path])


def build_engine(model: torch.nn.Module, cfg: RayvlConfig, world_size: int, device: torch.device | None = None,
                 aligned: bool = True, decay_rule: int = CURRENT_DECAY_RULE):
    """``device``: the worker's GPU (rayvl.train.devices). DeepSpeed would otherwise put the model on
    ``cuda:LOCAL_RANK``, which Ray Train does not promise to be the GPU it gave the worker. ``aligned``: ZeRO-1/2's
    padded buffers (zero_config), kept as the engine's ``rayvl_aligned`` for the checkpoints it writes;
    ``decay_rule``: param_groups' rule (a resume's is its checkpoint's), kept as ``rayvl_decay_rule``."""
    if not cfg.train.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed's import picks its accelerator
    deepspeed = import_without("deepspeed", "mlflow")  # the worker's first import of it (rayvl.compat)
    if not cfg.train.use_gpu:
        no_cpu_comm_op()  # on GPUs DeepSpeed asks for no such op (and reading its table probes every op builder)
    use_own_ninja()

    t = cfg.train
    if precision(t) != "fp32" and not autocast_bf16(t):  # before DeepSpeed casts the weights: fp32 BatchNorm
        keep_batchnorm_fp32(model, torch.bfloat16 if precision(t) == "bf16" else torch.float16)
    deepspeed.init_distributed(dist_backend="nccl" if t.use_gpu else "gloo")
    # fused: one kernel per parameter group, where torch's default AdamW reads each step count back from the device
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay, decay_rule), lr=t.lr, betas=t.betas, eps=t.eps,
                                  fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(t))
    on = SimpleNamespace(device_rank=device.index) if device is not None and device.type == "cuda" else None
    engine, _, _, _ = deepspeed.initialize(args=on, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, world_size, aligned))
    syncfree.install(engine)
    engine.rayvl_aligned, engine.rayvl_decay_rule = aligned, decay_rule
    if t.zero_stage == 0 and world_size == 1:
        # one rank has nothing to all-reduce; DeepSpeed would still flatten and copy back every gradient
        engine.enable_backward_allreduce = False
    return engine
