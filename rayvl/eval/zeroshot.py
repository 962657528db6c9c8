"""Zero-shot classification: class names × prompt templates → class embeddings (template-ensemble average, CLIP)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def class_embeddings(encode_text, tokenize, classes: list[str], templates: list[str]) -> torch.Tensor:
    """[C, d]: each class's prompts embedded, averaged over templates, re-normalised."""
    rows = []
    for name in classes:
        ids, mask = tokenize([t.format(name) for t in templates])
        rows.append(F.normalize(encode_text(ids, mask).mean(0), dim=-1))
    return torch.stack(rows)


def zeroshot_metrics(image_emb: torch.Tensor, labels: torch.Tensor, class_emb: torch.Tensor) -> dict:
    """top-1, top-5 (when there are > 5 classes) and mean per-class recall, in percent."""
    logits = image_emb @ class_emb.T
    k = min(5, class_emb.shape[0])
    topk = logits.topk(k, dim=1).indices
    hit1 = topk[:, 0] == labels
    out = {"zeroshot_top1": 100.0 * hit1.float().mean().item(),
           "zeroshot_chance_top1": 100.0 / class_emb.shape[0]}
    if class_emb.shape[0] > 5:
        out["zeroshot_top5"] = 100.0 * (topk == labels[:, None]).any(1).float().mean().item()
    recalls = [hit1[labels == c].float().mean().item() for c in labels.unique()]
    out["zeroshot_mean_per_class_recall"] = 100.0 * sum(recalls) / len(recalls)
    return out
