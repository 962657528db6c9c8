"""Which engine layout a run trains in: ``train.zero_stage=auto`` resolved once, before the workers start.

ZeRO partitions the weights, gradients and optimizer state over the ranks to save memory, and pays for it in every
step: at ZeRO-1/2 DeepSpeed hooks every gradient (a Python call each, on the autograd thread) and copies each into a
bucket and then into its partition; at ZeRO-3 the weights are gathered before every layer. A model whose state fits
the GPU beside its activations trains fastest with none of that — stage 0, torch autocast over fp32 weights and one
fused optimizer, as a hand-written PyTorch loop does. So ``auto`` takes the first layout, in the order of their cost
per step, whose state fits: stage 0, ZeRO-1 (its gradients reduced once after the backward, no hooks), ZeRO-2,
ZeRO-3, then the optimizer state offloaded to host memory (ZeRO-2, then ZeRO-3), then the parameters too — and on
CPU workers stage 0, since host memory is not what ZeRO is for. A layout the config's own checks refuse (a memory
bank needs its weights whole: no ZeRO-3) is skipped.

GPU memory: this machine's (nvidia-smi) where the run starts its own Ray; a cluster's from the accelerator types Ray
reports once connected. A resume keeps its checkpoint's stage and offload: DeepSpeed's files hold the partitions of
the layout they were written in.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from dataclasses import dataclass

from rayvl.config import ConfigError, RayvlConfig, precision, validate

STATE_SHARE = 0.5
"""the share of a GPU's memory the state may take: the rest is the batch's activations, the allocator's slack and
the communication buckets (a per-GPU batch is chosen for the memory that leaves)."""
UNKNOWN_GPU_GIB = 16.0
"""what a GPU holds when neither this machine nor Ray's accelerator type says: the smallest training GPU in use."""
GPU_GIB = {"H200": 141.0, "B200": 180.0, "H100": 80.0, "H800": 80.0, "GH200": 96.0, "A100-80G": 80.0,
           "A100-40G": 40.0, "A100": 40.0, "L40S": 48.0, "L40": 48.0, "A40": 48.0, "A10G": 24.0, "A10": 24.0,
           "L4": 24.0, "V100": 16.0, "T4": 16.0}
"""memory of the GPUs Ray names in its ``accelerator_type:<name>`` resources (vendor figures), for a driver that has
no GPU of its own to ask."""
CANDIDATES = ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer"),
              (3, "optimizer_and_params"))
"""(stage, offload) in the order auto tries them: by cost per step, then by what they hold."""


@dataclass(frozen=True)
class Layout:
    stage: int
    offload: str
    why: str

    def line(self) -> str:
        offload = f", {self.offload} offloaded" if self.offload != "none" else ""
        return f"DeepSpeed ZeRO-{self.stage}{offload} (train.zero_stage=auto: {self.why})"


@dataclass(frozen=True)
class Params:
    total: int
    trainable: int


def state_bytes(stage: int, offload: str, params: Params, ranks: int, mode: str) -> int:
    """Bytes of weights, gradients and AdamW state one rank holds on its GPU. Stage 0: fp32 weights (torch autocast
    computes in bf16) and fp32 gradients; ZeRO ≥ 1: DeepSpeed's weights and gradients in the training precision, fp32
    master weights beside AdamW's two moments in the optimizer's partitions."""
    p, t = params.total, params.trainable
    if stage == 0:
        if mode == "fp16":  # DeepSpeed's fp16 optimizer: half weights and gradients, fp32 master + moments
            return 2 * p + 2 * t + 12 * t
        return 4 * p + 4 * t + 8 * t
    width = 4 if mode == "fp32" else 2
    weights = width * p / (ranks if stage == 3 else 1)
    grads = width * t / (ranks if stage >= 2 else 1)
    optimizer = 0 if offload != "none" else 12 * t / ranks
    if offload == "optimizer_and_params":
        weights = 0
    return int(weights + grads + optimizer)


def choose(cfg: RayvlConfig, params: Params, gpu_gib: float | None, gpu_from: str) -> Layout:
    """The layout of ``cfg`` (train.zero_stage=auto) for ``params`` on GPUs of ``gpu_gib`` (None: CPU workers)."""
    t = cfg.train
    if not t.use_gpu:
        return Layout(0, "none", "CPU workers: ZeRO partitions state to save GPU memory and costs host time every "
                                 "step, so stage 0")
    mode, budget = precision(t), STATE_SHARE * gpu_gib * 2**30
    least, refused = None, []
    for stage, offload in CANDIDATES:
        if t.zero_offload != "none" and offload != t.zero_offload:
            continue  # an offload the user asked for narrows the choice to the layouts that have it
        try:
            validate(_with(cfg, stage, offload))
        except ConfigError as e:
            refused.append(f"ZeRO-{stage}/{offload}: {e}")
            continue
        least = (stage, offload, state_bytes(stage, offload, params, t.num_workers, mode))
        if least[2] <= budget:
            return Layout(stage, offload, _why(stage, least[2], params, gpu_gib, gpu_from))
    if least is None:
        raise ConfigError("train.zero_stage: auto found no layout this config accepts (" + "; ".join(refused)
                          + "); set the stage")
    stage, offload, need = least
    return Layout(stage, offload, f"{_gib(need)} of state a rank does not fit {STATE_SHARE:.0%} of "
                                  f"{gpu_gib:.3g} GiB ({gpu_from}) in any layout — the least it can be; add GPUs")


def _why(stage: int, need: int, params: Params, gpu_gib: float, gpu_from: str) -> str:
    held = (f"{params.total / 1e6:,.0f}M parameters ({params.trainable / 1e6:,.0f}M trained) hold {_gib(need)} a "
            f"rank in this layout, within {STATE_SHARE:.0%} of {gpu_gib:.3g} GiB ({gpu_from})")
    return held + ("" if stage == 0 else "; the layouts before it do not fit")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _with(cfg: RayvlConfig, stage: int, offload: str) -> RayvlConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, zero_stage=stage, zero_offload=offload))


def count_params(cfg: RayvlConfig) -> Params:
    """The dual encoder's parameters, counted on the meta device: nothing allocated, no weights read."""
    from rayvl.models.dual_encoder import meta_model

    model = meta_model(cfg.model)
    return Params(sum(p.numel() for p in model.parameters()),
                  sum(p.numel() for p in model.parameters() if p.requires_grad))


def local_gpu_gib() -> float | None:
    """The smallest GPU of this machine in GiB, from nvidia-smi (asking torch would open a CUDA context in the
    driver, on the GPU a worker then trains on); None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        sizes = [float(line) / 1024 for line in out.split() if line.strip()]  # MiB
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return min(sizes) if sizes else None


def cluster_gpu_gib(resources: dict[str, float]) -> tuple[float | None, str]:
    """The smallest GPU Ray's accelerator types name in ``resources`` (a cluster's), and which it was."""
    known = [(GPU_GIB[name.split(":", 1)[1]], name.split(":", 1)[1]) for name in resources
             if name.startswith("accelerator_type:") and name.split(":", 1)[1] in GPU_GIB]
    if not known:
        return None, ""
    gib, name = min(known)
    return gib, f"Ray's accelerator type {name}"


def resolve(cfg: RayvlConfig, checkpoint: tuple | None = None,
            cluster: dict[str, float] | None = None) -> tuple[RayvlConfig, Layout | None]:
    """``cfg`` with train.zero_stage=auto replaced by the chosen stage (and offload), and the layout; (``cfg``, None)
    when the stage was set, or when the GPUs are a cluster's not yet asked: ``cluster`` (the cluster's resources,
    once Ray is connected) is needed then. ``checkpoint``: the (stage, offload) of the checkpoint a resume
    continues, which it keeps."""
    t = cfg.train
    if t.zero_stage != "auto":
        return cfg, None
    if checkpoint is not None and isinstance(checkpoint[0], int):
        layout = Layout(checkpoint[0], checkpoint[1], "the layout of the checkpoint this run resumes")
    elif not t.use_gpu:
        layout = choose(cfg, Params(0, 0), None, "")
    else:
        gib, source = (local_gpu_gib(), "this machine's GPU") if not on_cluster(cfg) else (None, "")
        if gib is None:
            if cluster is None:
                return cfg, None
            gib, source = cluster_gpu_gib(cluster)
        if gib is None:
            gib, source = UNKNOWN_GPU_GIB, "assumed: no accelerator type Ray names"
        layout = choose(cfg, count_params(cfg), gib, source)
    resolved = _with(cfg, layout.stage, layout.offload)
    validate(resolved)
    return resolved, layout


def on_cluster(cfg: RayvlConfig) -> bool:
    """Whether the run joins a Ray cluster (whose GPUs this machine's need not be) rather than start its own."""
    import os

    import ray

    return bool(cfg.ray_address or os.environ.get("RAY_ADDRESS") or ray.is_initialized())
