"""Inner-product nearest neighbours with faiss (faiss-gpu when CUDA is present, faiss-cpu otherwise — same code).

Which GPUs an index goes to is one choice per process (``use_gpus``): every GPU the process sees where one process
owns the node (the `rayvl eval` driver, a GPU actor, which sees only the GPUs Ray gave it), one GPU per Ray Train
rank (its model's: ``device_gpus``), none on CPU workers — a rank on a GPU node sees every GPU of the node.

Exact search (``IndexFlatIP``) for evaluation galleries and small caption pools; above a size an approximate index
— IVF (k-means cells, ``nprobe`` of them searched) or HNSW (a graph) — with its recall against exact search
measured on real queries (``recall``), since an approximate index's recall depends on the queries' distribution.
Vectors are L2-normalised embeddings, so inner product is cosine similarity.

A GPU pseudo-labeller searches an exact index without faiss (``DeviceIndex``: the vectors as one tensor on its GPU,
matmuls and top-k's there), and merges each image's crops' results there (``merged``).
"""
from __future__ import annotations

import math

import numpy as np

KINDS = ("auto", "flat", "ivf", "hnsw")
_CHOICE: list[int] | None = None  # use_gpus: None = every visible GPU


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _gpus() -> int:
    import faiss

    return getattr(faiss, "get_num_gpus", lambda: 0)()


def use_gpus(ids: list[int] | None) -> None:
    """This process's faiss GPUs from now on: None every GPU it sees (the default), [] none (CPU), [k, ...] those
    (indices among the visible GPUs, as torch's ``cuda:k``)."""
    global _CHOICE
    _CHOICE = None if ids is None else [int(i) for i in ids]


def device_gpus(device) -> list[int]:
    """The faiss GPUs of a rank whose model is on ``device`` (a torch.device): ``cuda:3`` → [3], ``cpu`` → []."""
    if device.type != "cuda":
        return []
    if device.index is None:  # plain "cuda": the current device, which torch keeps per thread
        import torch

        return [torch.cuda.current_device()]
    return [device.index]


def target_gpus(choice: list[int] | None, visible: int) -> list[int]:
    """The GPUs an index goes to under ``use_gpus(choice)`` when faiss sees ``visible`` GPUs (0 with faiss-cpu,
    which searches on CPU whatever the choice)."""
    if choice is None or visible == 0:
        return list(range(visible))
    outside = [i for i in choice if not 0 <= i < visible]
    if outside:  # faiss and torch see the same CUDA_VISIBLE_DEVICES, so this is a wrong index, not a setup
        raise ValueError(f"faiss GPUs {outside} requested, but this process sees {visible} GPU(s)")
    return list(choice)


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
    """The index replicated on this process's faiss GPUs (``use_gpus``; flat and IVF — faiss has no GPU HNSW), or
    itself when there are none."""
    import faiss

    if isinstance(index, faiss.IndexHNSWFlat) or _CHOICE == []:  # [] never asks faiss (faiss-gpu would init CUDA)
        return index
    ids = target_gpus(_CHOICE, _gpus())
    if not ids:
        return index
    # resources per copy, not cached: the GPU index keeps them alive, and their scratch memory goes back (to a
    # training rank's torch) with the index
    resources = [faiss.StandardGpuResources() for _ in ids]
    return faiss.index_cpu_to_gpu_multiple_py(resources, index, None, ids)  # one GPU: a plain GpuIndex


def search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of the k best rows per query, best first (HNSW's search depth raised to at least k)."""
    import faiss

    if isinstance(index, faiss.IndexHNSWFlat):
        index.hnsw.efSearch = max(index.hnsw.efSearch, 2 * k)
    return index.search(_f32(queries), min(k, index.ntotal))


DEVICE_INDEX_BYTES = 2 << 30  # an exact index whose vectors are more stays with faiss (which tiles its search)
SCORES_BYTES = 256 << 20  # query × pool scores a DeviceIndex computes at once


class DeviceIndex:
    """An exact index's vectors (``IndexFlatIP``'s, up to ``DEVICE_INDEX_BYTES``) as one float32 tensor on a torch
    device: a search is matmuls and top-k's there, over blocks of the pool of ``SCORES_BYTES`` of scores, its
    results staying there. On a GPU the queries never leave it and nothing is searched on the CPU — where faiss-gpu
    has no kernels (compute capability 9.0+) faiss-cpu searches on the CPUs that feed the GPU. Its results are the
    flat index's: the same scores up to float rounding (fp32 products, never TF32), equal scores possibly in another
    order."""

    def __init__(self, vectors: np.ndarray, device):
        import torch

        self.vectors = torch.from_numpy(_f32(vectors)).to(device)
        self.ntotal = len(vectors)

    @classmethod
    def of(cls, index, device) -> "DeviceIndex | None":
        """``index``'s vectors on ``device`` when it is exact (a flat inner-product index), else None."""
        import faiss

        if not isinstance(index, faiss.IndexFlatIP) or index.ntotal * index.d * 4 > DEVICE_INDEX_BYTES:
            return None
        return cls(index.reconstruct_n(0, index.ntotal), device)

    def search(self, queries, k: int):
        """(scores, ids) of the k best rows per query (a tensor on any device), best first, tensors on the index's
        device."""
        import torch

        device, precision = self.vectors.device, torch.get_float32_matmul_precision()
        k, block = min(k, self.ntotal), max(1, SCORES_BYTES // (4 * max(1, len(queries))))
        torch.set_float32_matmul_precision("highest")  # IEEE fp32, as faiss computes
        try:
            with torch.autocast(device.type, enabled=False):  # nor a caller's bf16
                queries = queries.to(device, torch.float32)
                best = (torch.zeros((len(queries), 0), device=device),
                        torch.zeros((len(queries), 0), dtype=torch.long, device=device))
                for first in range(0, self.ntotal, block):
                    part = self.vectors[first:first + block]
                    scores, ids = (queries @ part.T).topk(min(k, len(part)), dim=1)
                    if first:  # the best k of the blocks before and this one
                        scores = torch.cat([best[0], scores], 1)
                        scores, order = scores.topk(min(k, scores.shape[1]), dim=1)
                        ids = torch.cat([best[1], ids + first], 1).gather(1, order)
                    best = scores, ids
        finally:
            torch.set_float32_matmul_precision(precision)
        return best


def merged(scores, ids, groups: int):
    """Each run of ``groups`` consecutive queries' results merged into one row, by score, best first (tensors;
    (n·groups, k) → (n, groups·k) each): ties keep the queries' order, then their ranks'. Ids of −1 (faiss's
    padding where it found fewer than k) sort last with their lowest scores."""
    n = scores.shape[0] // groups
    merged_scores, order = scores.reshape(n, -1).sort(dim=1, descending=True, stable=True)
    return merged_scores, ids.reshape(n, -1).gather(1, order)


def recall(index, vectors: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Share of the exact top-k (brute force over ``vectors``) that ``index`` returns, averaged over queries."""
    _, exact = top_k(vectors, queries, k)
    _, found = search(index, queries, k)
    return float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(exact, found)]))


def top_k(gallery: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, indices) of the k gallery rows with the highest inner product, best first, per query (exact)."""
    return search(on_device(build_index(gallery, "flat")), queries, k)
