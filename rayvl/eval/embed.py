"""Embedding of image and text sets with Ray Data: ``map_batches`` over an actor pool, each actor holding the
trained model loaded once. Rows carry an ``index`` column so the result can be put back in input order; the
arrays are written to disk (``.npy``) for the metrics and for reuse."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import ray
import torch

from rayvl import assets
from rayvl.config import from_dict
from rayvl.data.text import tokenize
from rayvl.models.dual_encoder import DualEncoder
from rayvl.train.checkpoint import META_FILE, MODEL_FILE, TAG, latest_checkpoint_dir


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    path = Path(path).expanduser()
    if (path / META_FILE).exists():
        return path
    latest = latest_checkpoint_dir(path)
    if latest is None:
        raise FileNotFoundError(f"{path}: neither a rayvl checkpoint nor a run directory with one")
    return latest


def load_model(checkpoint: str | Path) -> tuple[DualEncoder, dict]:
    """The model of a checkpoint in eval mode, with its config. Final checkpoints carry consolidated weights
    (model.pt); intermediate ones are consolidated here from the DeepSpeed shards (ZeRO 1-3 via DeepSpeed's own
    zero_to_fp32, stage 0 from rank 0's module state)."""
    ckpt = resolve_checkpoint(checkpoint)
    meta = json.loads((ckpt / META_FILE).read_text())
    cfg = from_dict(meta["config"])
    model = DualEncoder(cfg.model)
    if (ckpt / MODEL_FILE).exists():
        state = torch.load(ckpt / MODEL_FILE, map_location="cpu")
    elif cfg.train.zero_stage == 0:
        state = torch.load(ckpt / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=TAG)
    model.load_state_dict(state, strict=True)
    return model.eval(), meta["config"]


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
          batch_size: int, out: Path | None = None) -> np.ndarray:
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
    emb = np.concatenate(chunks)[order]
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        np.save(out, emb)
    return emb


@torch.no_grad()
def embed_local(model: DualEncoder, images: np.ndarray | None = None, input_ids: np.ndarray | None = None,
                attention_mask: np.ndarray | None = None, batch_size: int = 128) -> np.ndarray:
    """The same embeddings in this process (the reference the Ray Data path is tested against)."""
    out = []
    n = len(images) if images is not None else len(input_ids)
    for i in range(0, n, batch_size):
        if images is not None:
            out.append(model.encode_image(torch.from_numpy(images[i:i + batch_size])))
        else:
            out.append(model.encode_text(torch.from_numpy(input_ids[i:i + batch_size]),
                                         torch.from_numpy(attention_mask[i:i + batch_size])))
    return torch.cat(out).float().numpy()
