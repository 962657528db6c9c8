"""Zero-shot classification: class names × prompt templates → class embeddings (template-ensemble average, CLIP)."""
from __future__ import annotations

import numpy as np
import torch


def class_embeddings(per_template: np.ndarray) -> np.ndarray:
    """[C, T, d] prompt embeddings → [C, d]: each class's prompts averaged over templates, re-normalised."""
    mean = per_template.mean(1)
    return mean / np.linalg.norm(mean, axis=1, keepdims=True)


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
