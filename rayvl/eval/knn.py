"""Inner-product nearest neighbours with faiss (faiss-gpu when CUDA is present, faiss-cpu otherwise — same code).

Exact search (``IndexFlatIP``) for evaluation galleries and small caption pools; above a size an approximate index
— IVF (k-means cells, ``nprobe`` of them searched) or HNSW (a graph) — with its recall against exact search
measured on real queries (``recall``), since an approximate index's recall depends on the queries' distribution.
Vectors are L2-normalised embeddings, so inner product is cosine similarity.
"""
from __future__ import annotations

import math

import numpy as np

KINDS = ("auto", "flat", "ivf", "hnsw")


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _gpus() -> int:
    import faiss

    return getattr(faiss, "get_num_gpus", lambda: 0)()


def build_index(vectors: np.ndarray, kind: str = "flat", *, exact_max: int = 100_000, nlist: int = 0,
                nprobe: int = 16, hnsw_m: int = 32, seed: int = 0):
    """A faiss index holding ``vectors`` (row i = id i). ``auto``: exact up to ``exact_max`` vectors, IVF above;
    IVF with ``nlist`` cells (0: 4·√n, faiss's rule of thumb), trained on at most 256 vectors per cell."""
    import faiss

    vectors = _f32(vectors)
    n, d = vectors.shape
    kind = ("flat" if n <= exact_max else "ivf") if kind == "auto" else kind
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "ivf":
        nlist = nlist or max(1, min(n // 39, int(4 * math.sqrt(n))))  # faiss warns below 39 points per cell
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(seed).permutation(n)[:256 * nlist]
        index.train(vectors[np.sort(sample)])
        index.nprobe = min(nprobe, nlist)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    else:
        raise ValueError(f"unknown index kind {kind!r}; one of {', '.join(KINDS)}")
    index.add(vectors)
    return index


def on_device(index):
    """The index on every GPU when there are any (flat and IVF; faiss has no GPU HNSW), else itself."""
    import faiss

    if _gpus() > 0 and not isinstance(index, faiss.IndexHNSWFlat):
        return faiss.index_cpu_to_all_gpus(index)
    return index


def search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of the k best rows per query, best first (HNSW's search depth raised to at least k)."""
    import faiss

    if isinstance(index, faiss.IndexHNSWFlat):
        index.hnsw.efSearch = max(index.hnsw.efSearch, 2 * k)
    return index.search(_f32(queries), min(k, index.ntotal))


def recall(index, vectors: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Share of the exact top-k (brute force over ``vectors``) that ``index`` returns, averaged over queries."""
    _, exact = top_k(vectors, queries, k)
    _, found = search(index, queries, k)
    return float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(exact, found)]))


def top_k(gallery: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, indices) of the k gallery rows with the highest inner product, best first, per query (exact)."""
    return search(on_device(build_index(gallery, "flat")), queries, k)
