"""Starting from a CLIP checkpoint (open_clip's ``--pretrained``): an OpenAI- or open_clip-format state dict — CLIP's
``visual.*`` image transformer, ``visual.proj`` its projection, the text transformer's keys beside them — given as
``model.vision_checkpoint`` for the matching timm ViT (``vit_base_patch32_clip_224`` for open_clip's ViT-B-32,
``vit_base_patch32_clip_quickgelu_224`` for OpenAI's QuickGELU ViT-B/32; ``vit_base_patch16_clip_224``,
``vit_large_patch14_clip_224``, … likewise). timm's own converter (``checkpoint_filter_fn``) renames the image
transformer's keys; CLIP's projection becomes rayvl's linear vision projection, so the image embedding is CLIP's
(``model.embed_dim`` = its width, ``model.vision_projection=linear``). The text transformer is not loaded: rayvl's
text tower is a Hugging Face encoder, whose architecture CLIP's is not — its keys are counted as left."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("rayvl")
PROJECTION = "visual.proj"


def is_clip(state: dict) -> bool:
    """An OpenAI / open_clip CLIP state dict (its image transformer's class embedding under ``visual.``)."""
    return "visual.class_embedding" in state


def projection_shape(state: dict) -> tuple[int, int] | None:
    """(image width, embedding width) of CLIP's image projection, None when the state has none."""
    proj = state.get(PROJECTION)
    return None if proj is None else tuple(proj.shape)


def convert(state: dict, backbone: torch.nn.Module, source: str) -> tuple[dict, torch.Tensor | None]:
    """(the timm backbone's state dict, CLIP's projection as a ``nn.Linear(width, embed)`` weight — or None), with
    a line saying what was loaded, mapped and left."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    visual = {k: v for k, v in state.items() if k.startswith("visual.")}
    converted = checkpoint_filter_fn(visual, backbone)
    weight = converted.pop("head.weight", None)  # timm makes visual.proj a head of its own: [embed, width]
    converted.pop("head.bias", None)  # zeros timm adds; CLIP's projection has none
    expected = set(backbone.state_dict()) - {k for k in backbone.state_dict() if k.startswith("head.")}
    missing, unexpected = sorted(expected - set(converted)), sorted(set(converted) - expected)
    log.info(f"model.vision_checkpoint {source}: a CLIP checkpoint — {len(visual)} image-transformer keys mapped to "
             f"{len(converted)} timm keys (missing {len(missing)}{': ' + ', '.join(missing[:5]) if missing else ''}; "
             f"unexpected {len(unexpected)}{': ' + ', '.join(unexpected[:5]) if unexpected else ''}), "
             f"{PROJECTION} → vision_proj{'' if weight is not None else ' (absent)'}, {len(state) - len(visual)} text "
             f"keys left (rayvl's text tower is a Hugging Face encoder)")
    return converted, weight
