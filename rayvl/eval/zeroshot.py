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


def average_precision(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[N, C] scores and [N, C] 0/1 targets → [C] average precisions: each class's images ranked by its score, the
    precision at the rank of each of its positives averaged over them, 0 for a class without one — CLIP_benchmark's
    multilabel metric (its ``average_precision_per_class``, torchnet's APMeter). In float64; tied scores keep the
    images' order (CLIP_benchmark's ``torch.sort`` leaves ties in no fixed order)."""
    order = np.argsort(-np.asarray(scores, np.float64), axis=0, kind="stable")
    truth = np.take_along_axis(np.asarray(targets, np.float64), order, axis=0)
    precision = truth.cumsum(0) / np.arange(1, len(truth) + 1, dtype=np.float64)[:, None]
    return (precision * truth).sum(0) / np.maximum(truth.sum(0), 1.0)


def multilabel_metrics(image_emb: np.ndarray, targets: np.ndarray, class_emb: np.ndarray) -> dict:
    """Mean average precision over the classes, in percent: a multilabel set's zero-shot score (CLIP_benchmark's
    ``mean_average_precision``), the images ranked for each class by their similarity to its embedding."""
    scores = np.asarray(image_emb, np.float64) @ np.asarray(class_emb, np.float64).T
    return {"zeroshot_mean_average_precision": 100.0 * float(average_precision(scores, targets).mean())}
