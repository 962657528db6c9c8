"""Evaluation inside the training loop, split across ranks.

Every rank embeds an equal slice of the held-out set (padded), features are all-gathered, and every rank runs
the same forwards — which ZeRO-3 requires, since each forward all-gathers partitioned parameters.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from rayvl.config import RayvlConfig
from rayvl.data.text import tokenize
from rayvl.eval.retrieval import retrieval_metrics
from rayvl.eval.zeroshot import class_embeddings, zeroshot_metrics


@dataclass
class EvalSet:
    images: np.ndarray  # uint8 [N, 3, S, S]
    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray  # class id per image, -1 when unknown
    classes: list[str]
    templates: list[str]
    tokenizer_path: str

    @classmethod
    def load(cls, shard, config: dict, cfg: RayvlConfig) -> "EvalSet":
        cols: dict[str, list] = {k: [] for k in ("image", "input_ids", "attention_mask", "cls")}
        for batch in shard.iter_batches(batch_size=256, batch_format="numpy"):
            for k in cols:
                cols[k].append(batch[k])
        classes = {"classes": [], "templates": []}
        if config.get("classes_file"):
            with open(config["classes_file"]) as f:
                classes = json.load(f)
        return cls(np.concatenate(cols["image"]), np.concatenate(cols["input_ids"]),
                   np.concatenate(cols["attention_mask"]), np.concatenate(cols["cls"]),
                   classes["classes"], classes["templates"], config["tokenizer_path"])


def _gather_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x[:n]
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)[:n]


@torch.no_grad()
def evaluate(model, data: EvalSet, cfg: RayvlConfig, rank: int, world: int) -> dict:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    n = len(data.images)
    per = math.ceil(n / world)
    index = np.minimum(np.arange(rank * per, (rank + 1) * per), n - 1)  # pad with the last row
    bs = cfg.eval.batch_size
    img, txt = [], []
    for i in range(0, per, bs):
        j = index[i:i + bs]
        img.append(model.encode_image(torch.from_numpy(data.images[j]).to(device)))
        txt.append(model.encode_text(torch.from_numpy(data.input_ids[j]).to(device),
                                     torch.from_numpy(data.attention_mask[j]).to(device)))
    image_emb = _gather_rows(torch.cat(img).float(), n).cpu()
    text_emb = _gather_rows(torch.cat(txt).float(), n).cpu()
    out: dict = {"eval_images": n}
    if "retrieval" in cfg.eval.tasks:
        out.update(retrieval_metrics(image_emb, text_emb, torch.arange(n)))
    labels = torch.from_numpy(data.labels)
    if "zeroshot" in cfg.eval.tasks and data.classes and (labels >= 0).any():
        def tok(texts):
            ids, mask = tokenize(texts, data.tokenizer_path, cfg.data.max_text_tokens)
            return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)

        class_emb = class_embeddings(model.encode_text, tok, data.classes, data.templates).float().cpu()
        known = labels >= 0
        out.update(zeroshot_metrics(image_emb[known], labels[known], class_emb))
        out["zeroshot_classes"] = len(data.classes)
    model.train(was_training)
    return out
