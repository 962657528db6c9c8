"""How embeddings are computed — the only thing in which training-time evaluation and ``rayvl eval`` differ.

- ``ModelEmbedder``: a model in this process. Inside a process group of ``world`` ranks every rank embeds an equal
  slice (padded) and the slices are all-gathered in order, so every rank runs the same forwards — which ZeRO-3
  needs, since each forward all-gathers partitioned parameters.
- ``RayDataEmbedder``: Ray Data ``map_batches`` over an actor pool, each actor loading the checkpoint once; rows
  carry an ``index`` column so the result is put back in input order. Actors given GPUs (``gpus_per_actor``)
  embed on theirs, in bf16 autocast; the others on CPU in fp32, as training-time evaluation on CPU does.

Both return float32 numpy arrays of L2-normalised embeddings, one row per input.
"""
from __future__ import annotations

import logging
import math
import os
import re

import numpy as np
import ray
import torch
import torch.distributed as dist

from rayvl import assets
from rayvl.checkpoints import load_model
from rayvl.config import ConfigError
from rayvl.data.text import tokenize

log = logging.getLogger("rayvl")


class ModelEmbedder:
    def __init__(self, model, tokenizer_path: str, max_tokens: int, batch_size: int = 128, rank: int = 0,
                 world: int = 1):
        self.model, self.tokenizer_path, self.max_tokens = model, tokenizer_path, max_tokens
        self.batch_size, self.rank, self.world = batch_size, rank, world
        self.device = next(model.parameters()).device

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    @torch.no_grad()
    def images(self, images: np.ndarray) -> np.ndarray:
        return self._split(lambda j: self.model.encode_image(self._tensor(images[j])), len(images))

    @torch.no_grad()
    def texts(self, texts: list[str]) -> np.ndarray:
        ids, mask = tokenize(list(texts), self.tokenizer_path, self.max_tokens)
        return self._split(lambda j: self.model.encode_text(self._tensor(ids[j]), self._tensor(mask[j])), len(ids))

    def _split(self, encode, n: int) -> np.ndarray:
        """This rank's rows (padded to an equal count with the last row), encoded in batches, gathered in order."""
        per = math.ceil(n / self.world)
        index = np.minimum(np.arange(self.rank * per, (self.rank + 1) * per), n - 1)
        bs = self.batch_size
        mine = torch.cat([encode(index[i:i + bs]) for i in range(0, per, bs)]).float().contiguous()
        if self.world > 1 and dist.is_initialized():
            parts = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(parts, mine)
            mine = torch.cat(parts)
        return mine[:n].cpu().numpy()


class NoCudaError(RuntimeError):
    """Ray gave this process GPUs, but its torch cannot use them."""


def no_cuda_cause(error: BaseException) -> str | None:
    """The NoCudaError message behind a failed job: an actor that raised it in ``__init__`` dies, and Ray's
    ActorDiedError keeps only the text of its traceback, so the message is read from that."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = re.search(r"NoCudaError: (.+)", str(error))
        if isinstance(error, NoCudaError) or found:
            return str(error) if isinstance(error, NoCudaError) else found.group(1).strip()
        error = error.__cause__ or error.__context__
    return None


def actor_device() -> torch.device:
    """``cuda`` when Ray gave this process a GPU — it then sees only the GPUs it was given (Ray sets
    CUDA_VISIBLE_DEVICES), so ``cuda`` is its own — else ``cpu``: an actor without GPUs on a GPU node still sees
    every GPU of the node (Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone there), so CUDA being there decides nothing."""
    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    if not gpus:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU build: install a CUDA build of torch on the GPU nodes "
               f"(https://pytorch.org/get-started/locally/)" if torch.version.cuda is None else
               f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU (NVIDIA driver; "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        given = ", ".join(sorted(map(str, gpus)))
        raise NoCudaError(f"this Ray actor was given GPU {given}, but {why}; or run without GPUs (rayvl eval "
                          f"--gpus 0, pseudo_label.gpus_per_actor=0)")
    return torch.device("cuda")


def inference(device: torch.device):
    """bf16 autocast on a GPU (embeddings are returned in fp32); on CPU nothing changes, as training embeds."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


class _Actor:
    """Ray Data actor: the checkpoint's model on this actor's device (on a GPU: NHWC image tower, bf16 autocast,
    batches copied from pinned memory without blocking)."""

    def __init__(self, checkpoint: str):
        self.device = actor_device()
        self.model, self.config = load_model(checkpoint)
        if self.device.type == "cuda":
            self.model.to(self.device).vision.to_channels_last()

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    @torch.no_grad()
    def _encode(self, encode, *arrays: np.ndarray) -> np.ndarray:
        with inference(self.device):
            return encode(*map(self._tensor, arrays)).float().cpu().numpy()


class ImageEmbedder(_Actor):
    """uint8 images → normalised image embeddings."""

    def __call__(self, batch: dict) -> dict:
        return {"index": batch["index"], "embedding": self._encode(self.model.encode_image, batch["image"])}


class TextEmbedder(_Actor):
    """strings → tokens (the tower's own fast tokenizer) → normalised text embeddings."""

    def __init__(self, checkpoint: str):
        super().__init__(checkpoint)
        self.tokenizer_path = str(assets.text_model_path(self.config["model"]["text"]))
        self.max_tokens = self.config["data"]["max_text_tokens"]

    def __call__(self, batch: dict) -> dict:
        ids, mask = tokenize([str(t) for t in batch["text"]], self.tokenizer_path, self.max_tokens)
        return {"index": batch["index"], "embedding": self._encode(self.model.encode_text, ids, mask)}


def gpu_shortfall(gpus_per_actor: float, node_gpus: list[float], largest: dict, autoscaled: bool) -> str:
    """Why an actor of ``gpus_per_actor`` GPUs can never be placed ('' when it can): with an autoscaler config,
    more than the cluster can grow to; without, more than its largest node has."""
    most = largest.get("GPU", 0.0) if autoscaled else max(node_gpus, default=0.0)
    if gpus_per_actor <= 0 or most >= gpus_per_actor - 1e-9:
        return ""
    if autoscaled:
        return f"the cluster can grow to {most:g} GPUs (its autoscaler config)"
    return f"no node has more than {most:g} GPUs" if most else "the cluster has no GPUs"


def check_gpus(gpus_per_actor: float, setting: str, off: str, fixed_size: bool) -> None:
    """Actors asking for GPUs the cluster will never have would wait forever: an error on a Ray of fixed size
    (``fixed_size``: started by this driver) or whose autoscaler config cannot add them, a warning on a cluster
    with no autoscaler config on this node (one may run elsewhere, as KubeRay's does)."""
    if gpus_per_actor <= 0:
        return
    from rayvl import session

    largest, autoscaled = session.largest_cluster()
    nodes = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]]
    why = gpu_shortfall(gpus_per_actor, nodes, largest, autoscaled)
    if not why:
        return
    problem = (f"{setting}: each actor asks for {gpus_per_actor:g} GPU(s), but {why}, so they would wait forever; "
               f"run on CPU ({off}) or on a cluster with GPU nodes")
    if fixed_size or autoscaled:
        raise ConfigError(problem)
    log.warning("%s (no autoscaler config on this node: waiting in case one adds GPUs)", problem)


def pool_options(actors: int, cpus_per_actor: float, gpus_per_actor: float = 0.0) -> dict:
    """map_batches' arguments for a pool of ``actors`` embedding actors, each reserving these CPUs and GPUs."""
    return {"concurrency": actors, "num_cpus": cpus_per_actor, "num_gpus": gpus_per_actor}


def embed(ds: ray.data.Dataset, embedder: type, checkpoint: str, *, actors: int, cpus_per_actor: float,
          batch_size: int, gpus_per_actor: float = 0.0) -> np.ndarray:
    """Embeddings of every row of ``ds`` (which has an ``index`` column 0..N-1), in index order."""
    # enough blocks that every actor of the pool gets work (an eval split is often a single shard = one block)
    result = ds.repartition(actors * 4).map_batches(
        embedder, fn_constructor_kwargs={"checkpoint": str(checkpoint)}, batch_size=batch_size,
        batch_format="numpy", **pool_options(actors, cpus_per_actor, gpus_per_actor))
    index, chunks = [], []
    for batch in result.iter_batches(batch_size=None, batch_format="numpy"):
        index.append(batch["index"])
        chunks.append(batch["embedding"])
    order = np.argsort(np.concatenate(index), kind="stable")
    return np.concatenate(chunks)[order]


class RayDataEmbedder:
    def __init__(self, checkpoint: str | os.PathLike, actors: int = 1, cpus_per_actor: float = 0.5,
                 batch_size: int = 128, gpus_per_actor: float = 0.0):
        self.kwargs = dict(checkpoint=str(checkpoint), actors=actors, cpus_per_actor=cpus_per_actor,
                           batch_size=batch_size, gpus_per_actor=gpus_per_actor)

    def images(self, images: ray.data.Dataset) -> np.ndarray:
        return embed(images, ImageEmbedder, **self.kwargs)

    def texts(self, texts: list[str]) -> np.ndarray:
        return embed(ray.data.from_items([{"index": i, "text": t} for i, t in enumerate(texts)]), TextEmbedder,
                     **self.kwargs)
