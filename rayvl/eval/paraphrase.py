"""Paraphrase rank similarity ([Paraphrase] §3): do a query and its paraphrase retrieve the same images?

AO@k (eq. 1) is top-weighted average overlap of the two ranked lists; JS@k (eq. 2) is the Jaccard similarity of
their top-k sets. The query-expansion baseline (§5.2, eq. 5) replaces a query's feature by the mean of the
query's and its K expansions' features.
"""
from __future__ import annotations

import numpy as np

from rayvl.eval.knn import top_k


def average_overlap(lq, lp, k: int) -> float:
    """[Paraphrase] eq. (1): AO@k = 1/k Σ_{d=1..k} |Lq[:d] ∩ Lp[:d]| / d."""
    return sum(len(set(lq[:d]) & set(lp[:d])) / d for d in range(1, k + 1)) / k


def jaccard(lq, lp, k: int) -> float:
    """[Paraphrase] eq. (2): JS@k = |Lq[:k] ∩ Lp[:k]| / |Lq[:k] ∪ Lp[:k]|."""
    a, b = set(lq[:k]), set(lp[:k])
    return len(a & b) / len(a | b)


def paraphrase_metrics(image_emb: np.ndarray, query_emb: np.ndarray, paraphrase_emb: np.ndarray,
                       k: int = 10) -> dict:
    """Mean AO@k and JS@k over (query, paraphrase) pairs, each ranking the whole image gallery."""
    _, lq = top_k(image_emb, query_emb, k)
    _, lp = top_k(image_emb, paraphrase_emb, k)
    ao = np.mean([average_overlap(q, p, k) for q, p in zip(lq.tolist(), lp.tolist())])
    js = np.mean([jaccard(q, p, k) for q, p in zip(lq.tolist(), lp.tolist())])
    return {f"paraphrase_AO@{k}": 100.0 * float(ao), f"paraphrase_JS@{k}": 100.0 * float(js),
            "paraphrase_pairs": int(len(lq))}


def expand_queries(query_emb: np.ndarray, expansions_emb: np.ndarray) -> np.ndarray:
    """[Paraphrase] eq. (5): z_new = (T(q) + Σ_i T(q_i)) / (K+1); expansions_emb is [N, K, d]. Re-normalised, since
    retrieval ranks by cosine similarity."""
    z = (query_emb + expansions_emb.sum(1)) / (expansions_emb.shape[1] + 1)
    return z / np.linalg.norm(z, axis=1, keepdims=True)
