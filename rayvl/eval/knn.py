"""Exact inner-product search with faiss (faiss-gpu when CUDA is present, faiss-cpu otherwise — same code)."""
from __future__ import annotations

import numpy as np


def top_k(gallery: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, indices) of the k gallery rows with the highest inner product, best first, per query."""
    import faiss

    gallery = np.ascontiguousarray(gallery, dtype=np.float32)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    index = faiss.IndexFlatIP(gallery.shape[1])
    if getattr(faiss, "get_num_gpus", lambda: 0)() > 0:
        index = faiss.index_cpu_to_all_gpus(index)
    index.add(gallery)
    return index.search(queries, min(k, gallery.shape[0]))
