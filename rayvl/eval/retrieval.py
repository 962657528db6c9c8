"""Image↔text retrieval recall@k, with several captions per image allowed (text_to_image maps each caption)."""
from __future__ import annotations

import torch


def retrieval_metrics(image_emb: torch.Tensor, text_emb: torch.Tensor, text_to_image: torch.Tensor,
                      ks=(1, 5, 10)) -> dict:
    sims = image_emb @ text_emb.T  # [I, T]
    n_img, n_txt = sims.shape
    out = {}
    # text → image: the caption's own image within the top k
    t2i_rank = (sims.T > sims.T.gather(1, text_to_image[:, None])).sum(1)
    # image → text: any of the image's captions within the top k (best-ranked one counts)
    owner = text_to_image[None, :] == torch.arange(n_img)[:, None]
    best_pos = sims.masked_fill(~owner, float("-inf")).max(1).values
    i2t_rank = (sims > best_pos[:, None]).sum(1)
    for k in ks:
        out[f"t2i_R@{k}"] = 100.0 * (t2i_rank < k).float().mean().item()
        out[f"i2t_R@{k}"] = 100.0 * (i2t_rank < k).float().mean().item()
        out[f"t2i_chance_R@{k}"] = 100.0 * min(1.0, k / n_img)
        out[f"i2t_chance_R@{k}"] = 100.0 * min(1.0, k / n_img)
    return out
