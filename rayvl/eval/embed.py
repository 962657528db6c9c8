"""How embeddings are computed — the only thing in which training-time evaluation and ``rayvl eval`` differ.

- ``ModelEmbedder``: a model in this process. Inside a process group of ``world`` ranks every rank embeds an equal
  slice (padded) and the slices are all-gathered in order, so every rank runs the same forwards — which ZeRO-3
  needs, since each forward all-gathers partitioned parameters.
- ``RayDataEmbedder``: Ray Data ``map_batches`` over an actor pool, each actor loading the checkpoint once; rows
  carry an ``index`` column so the result is put back in input order.

Both return float32 numpy arrays of L2-normalised embeddings, one row per input.
"""
from __future__ import annotations

import math
import os

import numpy as np
import ray
import torch
import torch.distributed as dist

from rayvl import assets
from rayvl.checkpoints import load_model
from rayvl.data.text import tokenize


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


class ImageEmbedder:
    """Ray Data actor: uint8 images → normalised image embeddings."""

    def __init__(self, checkpoint: str):
        self.model, _ = load_model(checkpoint)

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        emb = self.model.encode_image(torch.from_numpy(np.ascontiguousarray(batch["image"])))
        return {"index": batch["index"], "embedding": emb.float().numpy()}


class TextEmbedder:
    """Ray Data actor: strings → tokens (the tower's own fast tokenizer) → normalised text embeddings."""

    def __init__(self, checkpoint: str):
        self.model, config = load_model(checkpoint)
        self.tokenizer_path = str(assets.text_model_path(config["model"]["text"]))
        self.max_tokens = config["data"]["max_text_tokens"]

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        ids, mask = tokenize([str(t) for t in batch["text"]], self.tokenizer_path, self.max_tokens)
        emb = self.model.encode_text(torch.from_numpy(ids), torch.from_numpy(mask))
        return {"index": batch["index"], "embedding": emb.float().numpy()}


def embed(ds: ray.data.Dataset, embedder: type, checkpoint: str, *, actors: int, cpus_per_actor: float,
          batch_size: int) -> np.ndarray:
    """Embeddings of every row of ``ds`` (which has an ``index`` column 0..N-1), in index order."""
    # enough blocks that every actor of the pool gets work (an eval split is often a single shard = one block)
    result = ds.repartition(actors * 4).map_batches(
        embedder, fn_constructor_kwargs={"checkpoint": str(checkpoint)}, concurrency=actors, num_cpus=cpus_per_actor,
        batch_size=batch_size, batch_format="numpy")
    index, chunks = [], []
    for batch in result.iter_batches(batch_size=None, batch_format="numpy"):
        index.append(batch["index"])
        chunks.append(batch["embedding"])
    order = np.argsort(np.concatenate(index), kind="stable")
    return np.concatenate(chunks)[order]


class RayDataEmbedder:
    def __init__(self, checkpoint: str | os.PathLike, actors: int = 1, cpus_per_actor: float = 0.5,
                 batch_size: int = 128):
        self.kwargs = dict(checkpoint=str(checkpoint), actors=actors, cpus_per_actor=cpus_per_actor,
                           batch_size=batch_size)

    def images(self, images: ray.data.Dataset) -> np.ndarray:
        return embed(images, ImageEmbedder, **self.kwargs)

    def texts(self, texts: list[str]) -> np.ndarray:
        return embed(ray.data.from_items([{"index": i, "text": t} for i, t in enumerate(texts)]), TextEmbedder,
                     **self.kwargs)
