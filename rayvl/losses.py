"""Contrastive losses with negatives gathered from every worker (InfoNCE, UniCL's label-aware form, SigLIP's sigmoid).

open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)`` semantics: each rank scores its own B queries
against the world's W·B keys, so the logits matrix is B × WB (not WB × WB), and the all-gather is differentiable,
so gradients of every rank's loss reach the features that produced them on their owner rank. Averaged over ranks
(as data-parallel gradient averaging does) this is exactly the full-batch CLIP loss of the global batch
(CLIP eq. / [Paraphrase] §4: symmetric InfoNCE).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_features(features: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """Concatenate every rank's features in rank order (identity outside a process group)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return features
    if with_grad:
        import torch.distributed.nn.functional as dist_nn

        with warnings.catch_warnings():  # torch 2.13 deprecates it for an internal API; it is still the public one
            warnings.simplefilter("ignore", FutureWarning)
            return torch.cat(dist_nn.all_gather(features), dim=0)
    gathered = [torch.empty_like(features) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, features.contiguous())
    # without grad flowing back, keep this rank's own slice differentiable
    gathered[dist.get_rank()] = features
    return torch.cat(gathered, dim=0)


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
              gather_with_grad: bool = True) -> torch.Tensor:
    """Symmetric InfoNCE of this rank's pairs against all gathered pairs."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    all_images = gather_features(image_features, gather_with_grad)
    all_texts = gather_features(text_features, gather_with_grad)
    logits_per_image = logit_scale * image_features @ all_texts.T
    logits_per_text = logit_scale * text_features @ all_images.T
    b = image_features.shape[0]
    targets = torch.arange(b, device=image_features.device) + rank * b  # positives sit at this rank's offset
    return (F.cross_entropy(logits_per_image, targets) + F.cross_entropy(logits_per_text, targets)) / 2


def label_aware_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                     labels: torch.Tensor, gather_with_grad: bool = True, image_keys: torch.Tensor | None = None,
                     text_keys: torch.Tensor | None = None, key_labels: torch.Tensor | None = None) -> torch.Tensor:
    """UniCL's bidirectional label-aware contrastive loss ([UniCL] eq. (1)–(3), Algorithm 1 TargetM).

    Every sample carries a label (image-text pairs a unique one, image-label samples their class id); the
    positives of a query are all keys with its label, across the gathered batch and the optional extra keys (a
    memory bank's queue, with its labels), and its loss is soft-target cross-entropy normalised by the number of
    positives, 1/|P(i)| Σ_{k∈P(i)} −log softmax. With all labels unique it is exactly ``clip_loss``.
    Keys default to the gathered online features; ``image_keys``/``text_keys`` (e.g. EMA features of the global
    batch followed by the queue, [BoW] eq. (1)–(3)) replace them.
    """
    all_labels = gather_features(labels, with_grad=False)
    if image_keys is None:
        image_keys = gather_features(image_features, gather_with_grad)
        text_keys = gather_features(text_features, gather_with_grad)
        key_labels = all_labels
    elif key_labels is None:
        raise ValueError("key_labels are needed with explicit keys")
    positives = (labels[:, None] == key_labels[None, :]).to(image_features.dtype)  # [B, N]
    targets = positives / positives.sum(1, keepdim=True)  # every query has ≥ 1 positive: its own key
    logits_per_image = logit_scale * image_features @ text_keys.T
    logits_per_text = logit_scale * text_features @ image_keys.T
    return (F.cross_entropy(logits_per_image, targets) + F.cross_entropy(logits_per_text, targets)) / 2


def siglip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor, labels: torch.Tensor, gather_with_grad: bool = True) -> torch.Tensor:
    """SigLIP's sigmoid loss (Zhai et al. 2023, arXiv:2303.15343, Algorithm 1): every image-text pair of the global
    batch is a binary term −log σ(z_ij (t·x_i·y_j + b)), z_ij = +1 for a positive and −1 for every other pair,
    summed and divided by the batch size. A pair is positive where its rows' labels agree: the pair's own row alone
    for image-text data (unique labels), also the other rows of the same pair where a method makes several (TOnICS's
    one row per object). This rank scores its B images against the world's W·B texts, gathered with gradients
    flowing back to their owners as in ``clip_loss``: averaged over ranks (data-parallel gradient averaging), it is
    the paper's −1/|global batch| Σ_i Σ_j over the global batch — all-gather instead of the paper's chunked
    exchange between neighbours, the same sum."""
    all_texts = gather_features(text_features, gather_with_grad)
    all_labels = gather_features(labels, with_grad=False)
    logits = logit_scale * image_features @ all_texts.T + logit_bias
    signs = 2.0 * (labels[:, None] == all_labels[None, :]).to(logits.dtype) - 1.0
    return -F.logsigmoid(signs * logits).sum() / image_features.shape[0]
