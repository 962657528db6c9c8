"""The device a worker trains on, bound in every thread of the worker that touches it.

PyTorch keeps the current CUDA device per thread (a new thread starts on GPU 0), and Ray Train shows each worker
all of its node's GPUs; so a worker's device is the one Ray Train gave it (``ray.train.torch.get_device``, its GPU's
index among the visible ones) and every thread that allocates on it binds it first (``bind``).
"""
from __future__ import annotations

import torch


def worker_device(use_gpu: bool) -> torch.device:
    """This Ray Train worker's device: its own GPU with ``train.use_gpu``, else the CPU."""
    if not use_gpu:
        return torch.device("cpu")
    import ray.train.torch

    return ray.train.torch.get_device()


def bind(device: torch.device) -> None:
    """Make ``device`` the calling thread's device: "cuda" tensors, NCCL's object collectives and CUDA streams
    of this thread then use it rather than GPU 0."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(device)


def check_cuda(device: torch.device) -> None:
    """A worker Ray gave a GPU must have a CUDA build of torch; say so here rather than fail deep in a kernel."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"train.use_gpu: Ray gave this worker GPU {device}, but torch {torch.__version__} sees no CUDA device "
            f"(built for CUDA {torch.version.cuda or 'none'}): install rayvl's GPU stack on the node "
            f"(`make install GPU=1`, docs/gpu.md)")


def fast_math(device: torch.device, tf32: bool) -> None:
    """TF32 tensor cores for fp32 matrix products and convolutions on Ampere and later (``train.tf32``): fp32
    weights and accumulation with a 10-bit mantissa product, as PyTorch's "high" matmul precision defines it."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
