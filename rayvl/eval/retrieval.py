"""Image↔text retrieval recall@k with several captions per image (``text_to_image`` maps each caption to its image).

Exact search with faiss (eval/knn.py); ``retrieval_metrics_bruteforce`` is the same definition by full ranking, kept
as the reference the tests compare faiss against.
"""
from __future__ import annotations

import numpy as np
import torch

from rayvl.eval.knn import top_k


def retrieval_metrics(image_emb, text_emb, text_to_image, ks=(1, 5, 10)) -> dict:
    image_emb, text_emb = _np(image_emb), _np(text_emb)
    text_to_image = _np(text_to_image).astype(np.int64)
    n_img, kmax = image_emb.shape[0], max(ks)
    _, t2i = top_k(image_emb, text_emb, kmax)  # each caption's top images
    # each image's top captions: deep enough that every image can reach k distinct captions' worth of hits
    _, i2t = top_k(text_emb, image_emb, kmax)
    out = {}
    for k in ks:
        out[f"t2i_R@{k}"] = 100.0 * float(np.mean((t2i[:, :k] == text_to_image[:, None]).any(1)))
        owner = text_to_image[i2t[:, :k]]  # which image each retrieved caption belongs to
        out[f"i2t_R@{k}"] = 100.0 * float(np.mean((owner == np.arange(n_img)[:, None]).any(1)))
        out[f"t2i_chance_R@{k}"] = out[f"i2t_chance_R@{k}"] = 100.0 * min(1.0, k / n_img)
    out["retrieval_images"], out["retrieval_captions"] = n_img, text_emb.shape[0]
    return out


def retrieval_metrics_bruteforce(image_emb, text_emb, text_to_image, ks=(1, 5, 10)) -> dict:
    image_emb, text_emb = torch.as_tensor(_np(image_emb)), torch.as_tensor(_np(text_emb))
    text_to_image = torch.as_tensor(_np(text_to_image)).long()
    sims = image_emb @ text_emb.T  # [I, T]
    n_img = sims.shape[0]
    t2i_rank = (sims.T > sims.T.gather(1, text_to_image[:, None])).sum(1)
    owner = text_to_image[None, :] == torch.arange(n_img)[:, None]
    best = sims.masked_fill(~owner, float("-inf")).max(1).values
    i2t_rank = (sims > best[:, None]).sum(1)
    out = {}
    for k in ks:
        out[f"t2i_R@{k}"] = 100.0 * (t2i_rank < k).float().mean().item()
        out[f"i2t_R@{k}"] = 100.0 * (i2t_rank < k).float().mean().item()
    return out


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
