"""The model's half of a run's check before Ray starts: what a typo or a mismatch makes wrong, as a config error
naming the key — a text tower that is neither an asset nor a local HF folder, a vision tower timm does not know or
that takes another image size, options its tower cannot take, a CLIP checkpoint of another architecture, unlocked
layers beyond the towers' count. Architectures are built on the meta device: no memory, no weights."""
from __future__ import annotations

import logging

from rayvl import assets
from rayvl.compat import import_timm
from rayvl.config import ConfigError, RayvlConfig

log = logging.getLogger("rayvl")


def check_model(cfg: RayvlConfig) -> None:
    """Every check of ``cfg.model`` (with ``data.image_size``, which the vision tower must take)."""
    try:
        if cfg.model.text_tower == "lm":
            assets.text_model_path(cfg.model.text)
        if cfg.model.vision != "clip":  # a whole CLIP's image ViT is its weights' shape (checked as they loaded)
            assets.check_vision_name(cfg.model.vision)
            _check_image_size(cfg.model.vision, cfg.data.image_size)
            _check_vision_options(cfg.model)
        if cfg.model.vision_unlocked_groups or cfg.model.text_unlocked_layers:  # the towers' layer counts
            from rayvl.models.dual_encoder import meta_model

            meta_model(cfg.model)
    except assets.MissingAssetError as e:
        raise ConfigError(str(e)) from None


def _check_image_size(vision: str, size: int) -> None:
    """A timm tower that takes one image size only (a ViT's patch embedding is built for its size) gets that size,
    or the run stops here instead of at its first forward in every worker."""
    if vision in assets.VISION_ASSETS:
        return
    import torch

    timm = import_timm()  # beside a CPU torch too (rayvl.compat)

    with torch.device("meta"):  # the architecture only: no memory, no weights
        model = timm.create_model(vision, pretrained=False)
    embed = getattr(model, "patch_embed", None)
    fixed = tuple(embed.img_size) if getattr(embed, "strict_img_size", False) else None
    if fixed is not None and fixed != (size, size):
        raise ConfigError(f"data.image_size: {size} px, but model.vision={vision!r} takes {fixed[0]}×{fixed[1]} px "
                          f"images: set data.image_size={fixed[0]}")


def _check_vision_options(m) -> None:
    """Patch dropout needs a ViT's patch tokens; a locked image tower needs pretrained weights to lock; a CLIP
    checkpoint's projection needs a linear vision projection of its width."""
    if m.vision_checkpoint and m.vision not in assets.VISION_ASSETS:
        _check_clip_checkpoint(m)
    if m.vision_strategy == "frozen" and m.vision not in assets.VISION_ASSETS and not m.vision_checkpoint:
        raise ConfigError(f"model.vision_strategy: frozen locks the image tower, but model.vision={m.vision!r} starts "
                          f"from a random init: give it weights with model.vision_checkpoint (or a tower shipped "
                          f"with weights: {', '.join(assets.VISION_ASSETS)})")
    if not m.patch_dropout:
        return
    import torch

    timm = import_timm()  # beside a CPU torch too (rayvl.compat)

    with torch.device("meta"):
        model = None if m.vision in assets.VISION_ASSETS else timm.create_model(m.vision, pretrained=False)
    if not hasattr(model, "patch_drop"):
        raise ConfigError(f"model.patch_dropout: drops a ViT's patch tokens; model.vision={m.vision!r} has none "
                          f"(a ViT such as vit_base_patch32_224 has)")


def _check_clip_checkpoint(m) -> None:
    from rayvl.models import clip_checkpoint

    try:
        state = assets.vision_state_dict(m.vision, m.vision_checkpoint)  # memory-mapped reads of a file's tensors
    except Exception as e:  # noqa: BLE001 — any unreadable file is the key's problem, named
        raise ConfigError(f"model.vision_checkpoint: cannot read {m.vision_checkpoint!r} as a checkpoint (a file "
                          f"torch.save or TorchScript wrote: {type(e).__name__}: {e})") from None
    if not clip_checkpoint.is_clip(state):
        return
    import torch

    timm = import_timm()  # beside a CPU torch too (rayvl.compat)

    with torch.device("meta"):  # the architecture only: do CLIP's image transformer's keys fit it?
        backbone = timm.create_model(m.vision, pretrained=False)
        timm_state = clip_checkpoint.converted(state, backbone)
        missing, unexpected = clip_checkpoint.mismatch(timm_state, backbone)
    # on the console, before the workers (whose logs hold it too) load it
    log.info(clip_checkpoint.summary(state, timm_state, missing, unexpected, "head.weight" in timm_state,
                                     m.vision_checkpoint))
    if missing or unexpected:
        raise ConfigError(f"model.vision: {m.vision!r} is not the architecture of the CLIP checkpoint "
                          f"{m.vision_checkpoint!r} (missing {', '.join(missing[:3]) or 'none'}; unexpected "
                          f"{', '.join(unexpected[:3]) or 'none'}): set model.init_from_clip={m.vision_checkpoint} "
                          f"instead, which reads the architecture from the weights (both towers)")
    shape = clip_checkpoint.projection_shape(state)
    if shape is not None and (m.vision_projection != "linear" or m.embed_dim != shape[1]):
        raise ConfigError(f"model.embed_dim: the CLIP checkpoint {m.vision_checkpoint!r} projects images to "
                          f"{shape[1]} dimensions: set model.embed_dim={shape[1]} and model.vision_projection=linear "
                          f"(now {m.embed_dim}, {m.vision_projection}) to start from its image embedding")
