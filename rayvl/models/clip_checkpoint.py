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
    """An OpenAI / open_clip CLIP state dict (its image transformer's class embedding under ``visual.``, or
    ``module.visual.`` as open_clip's distributed training saves it)."""
    return "visual.class_embedding" in state or "module.visual.class_embedding" in state


def unwrapped(state: dict) -> dict:
    """The state without the ``module.`` prefix a DistributedDataParallel model's keys carry."""
    return {k.removeprefix("module."): v for k, v in state.items()} if "module.visual.class_embedding" in state \
        else state


def projection_shape(state: dict) -> tuple[int, int] | None:
    """(image width, embedding width) of CLIP's image projection, None when the state has none."""
    proj = unwrapped(state).get(PROJECTION)
    return None if proj is None else tuple(proj.shape)


def converted(state: dict, backbone: torch.nn.Module) -> dict:
    """CLIP's image transformer renamed for the timm ``backbone`` (timm's converter; CLIP's projection as
    ``head.weight``: [embed, width])."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    out = checkpoint_filter_fn({k: v for k, v in unwrapped(state).items() if k.startswith("visual.")}, backbone)
    out.pop("head.bias", None)  # zeros timm adds; CLIP's projection has none
    return out


def mismatch(timm_state: dict, backbone: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(the timm backbone's keys the converted state lacks, the converted state's keys it has no place for — or
    a place of another shape); CLIP's projection, rayvl's vision_proj, is not the backbone's."""
    expected = {k: tuple(v.shape) for k, v in backbone.state_dict().items() if not k.startswith("head.")}
    mine = {k: v for k, v in timm_state.items() if k != "head.weight"}
    wrong = [f"{k} {tuple(v.shape)} ≠ {expected[k]}" for k, v in mine.items()
             if k in expected and tuple(v.shape) != expected[k]]
    return sorted(set(expected) - set(mine)), sorted(set(mine) - set(expected)) + wrong


def convert(state: dict, backbone: torch.nn.Module, source: str, whole: bool = False) -> tuple[dict, torch.Tensor | None]:
    """(the timm backbone's state dict, CLIP's projection as a ``nn.Linear(width, embed)`` weight — or None), with
    a line saying what was loaded, mapped and left (``whole``: the text keys load into the text tower,
    rayvl.models.whole_clip, which says so itself)."""
    timm_state = converted(state, backbone)
    missing, unexpected = mismatch(timm_state, backbone)
    line = summary(state, timm_state, missing, unexpected, "head.weight" in timm_state, source)
    weight = timm_state.pop("head.weight", None)
    if whole:
        if missing or unexpected:
            raise ValueError(f"the CLIP's image transformer does not fit its timm ViT: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        return timm_state, weight
    log.info(line)
    return timm_state, weight


def summary(state: dict, timm_state: dict, missing: list[str], unexpected: list[str], projected: bool,
            source: str) -> str:
    """The line saying what of a CLIP checkpoint the image tower loads: keys mapped, missing, unexpected, left."""
    visual = sum(k.startswith("visual.") for k in unwrapped(state))
    mapped = len(timm_state) - ("head.weight" in timm_state)
    return (f"model.vision_checkpoint {source}: a CLIP checkpoint — {visual} image-transformer keys mapped to "
            f"{mapped} timm keys (missing {len(missing)}{': ' + ', '.join(missing[:5]) if missing else ''}; "
            f"unexpected {len(unexpected)}{': ' + ', '.join(unexpected[:5]) if unexpected else ''}), "
            f"{PROJECTION} → vision_proj{'' if projected else ' (absent)'}, {len(state) - visual} text keys left "
            f"(model.init_from_clip loads them too)")
