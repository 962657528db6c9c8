"""Evaluation inside the training loop, split across ranks.

Every rank embeds an equal slice of each set (padded), features are all-gathered, and every rank runs the same
forwards — which ZeRO-3 requires, since each forward all-gathers partitioned parameters.
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
from rayvl.eval.datasets import read_paraphrases
from rayvl.eval.paraphrase import paraphrase_metrics
from rayvl.eval.retrieval import retrieval_metrics
from rayvl.eval.sts import read_sts, sts_metrics
from rayvl.eval.zeroshot import class_embeddings, zeroshot_metrics

Tokens = tuple[np.ndarray, np.ndarray]


@dataclass
class EvalSet:
    images: np.ndarray  # uint8 [N, 3, S, S]
    captions: Tokens  # one caption per image
    labels: np.ndarray  # class id per image, -1 when unknown
    classes: list[str]
    templates: list[str]
    tokenizer_path: str
    paraphrase: tuple[Tokens, Tokens] | None = None  # (queries, paraphrases)
    sts: tuple[Tokens, Tokens, np.ndarray] | None = None  # (sentences 1, sentences 2, gold)

    @classmethod
    def load(cls, shard, config: dict, cfg: RayvlConfig) -> "EvalSet":
        cols: dict[str, list] = {k: [] for k in ("image", "input_ids", "attention_mask", "cls")}
        for batch in shard.iter_batches(batch_size=256, batch_format="numpy"):
            for k in cols:
                cols[k].append(batch[k])
        tok_path, max_tokens = config["tokenizer_path"], cfg.data.max_text_tokens
        tok = lambda texts: tokenize(texts, tok_path, max_tokens)  # noqa: E731
        classes = {"classes": [], "templates": []}
        if config.get("classes_file"):
            with open(config["classes_file"]) as f:
                classes = json.load(f)
        paraphrase = sts = None
        if config.get("paraphrases_file") and "paraphrase" in cfg.eval.tasks:
            pairs = read_paraphrases(config["paraphrases_file"])
            paraphrase = (tok([p["caption"] for p in pairs]), tok([p["paraphrase"] for p in pairs]))
        if config.get("sts_file") and "sts" in cfg.eval.tasks:
            s1, s2, gold = read_sts(config["sts_file"])
            sts = (tok(s1), tok(s2), gold)
        return cls(np.concatenate(cols["image"]),
                   (np.concatenate(cols["input_ids"]), np.concatenate(cols["attention_mask"])),
                   np.concatenate(cols["cls"]), classes["classes"], classes["templates"], tok_path, paraphrase, sts)


def _split_embed(encode, n: int, rank: int, world: int, bs: int) -> torch.Tensor:
    """This rank's rows (padded to an equal count with the last row), encoded in batches, gathered in order."""
    per = math.ceil(n / world)
    index = np.minimum(np.arange(rank * per, (rank + 1) * per), n - 1)
    mine = torch.cat([encode(index[i:i + bs]) for i in range(0, per, bs)]).float().contiguous()
    if not dist.is_initialized() or world == 1:
        return mine[:n].cpu()
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return torch.cat(parts)[:n].cpu()


@torch.no_grad()
def evaluate(model, data: EvalSet, cfg: RayvlConfig, rank: int, world: int) -> dict:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    bs, tasks = cfg.eval.batch_size, cfg.eval.tasks
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731

    def texts(tokens: Tokens) -> torch.Tensor:
        ids, mask = tokens
        return _split_embed(lambda j: model.encode_text(t(ids[j]), t(mask[j])), len(ids), rank, world, bs)

    n = len(data.images)
    image_emb = _split_embed(lambda j: model.encode_image(t(data.images[j])), n, rank, world, bs)
    out: dict = {"eval_images": n}
    if "retrieval" in tasks:
        out.update(retrieval_metrics(image_emb, texts(data.captions), np.arange(n)))
    labels = torch.from_numpy(data.labels)
    if "zeroshot" in tasks and data.classes and (labels >= 0).any():
        def tok(xs):
            ids, mask = tokenize(xs, data.tokenizer_path, cfg.data.max_text_tokens)
            return t(ids), t(mask)

        class_emb = class_embeddings(model.encode_text, tok, data.classes, data.templates).float().cpu()
        known = labels >= 0
        out.update(zeroshot_metrics(image_emb[known], labels[known], class_emb))
        out["zeroshot_classes"] = len(data.classes)
    if "paraphrase" in tasks and data.paraphrase is not None:
        queries, paraphrases = data.paraphrase
        out.update(paraphrase_metrics(image_emb.numpy(), texts(queries).numpy(), texts(paraphrases).numpy(),
                                      cfg.eval.paraphrase_k))
    if "sts" in tasks and data.sts is not None:
        s1, s2, gold = data.sts
        out.update(sts_metrics(texts(s1).numpy(), texts(s2).numpy(), gold))
    model.train(was_training)
    return out


@torch.no_grad()
def held_out_retrieval(model, data: EvalSet, n: int, cfg: RayvlConfig, rank: int, world: int) -> float:
    """Text→image R@1 (%) over the first n held-out instances: TOnICS' refresh signal (seed tonics §3, App. A.2:
    100 instances). Split across ranks and gathered, so every rank gets the same number."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    n, bs = min(n, len(data.images)), cfg.eval.batch_size
    ids, mask = data.captions
    image_emb = _split_embed(lambda j: model.encode_image(t(data.images[j])), n, rank, world, bs)
    text_emb = _split_embed(lambda j: model.encode_text(t(ids[j]), t(mask[j])), n, rank, world, bs)
    model.train(was_training)
    return retrieval_metrics(image_emb, text_emb, np.arange(n), ks=(1,))["t2i_R@1"]
