"""[UniCL]'s config constraints: the image_label section and the losses over image-label data (torch-free;
``rayvl.config`` runs it)."""
from __future__ import annotations

from rayvl.errors import ConfigError


def check(cfg) -> None:
    """image_label.*, loss.kind and what a class-embedding model ([UniCL] eq. (4)) cannot do, each naming the key."""
    il, m = cfg.image_label, cfg.model
    if not 0.0 < il.weight <= 1.0:
        raise ConfigError(f"image_label.weight: must be in (0, 1], got {il.weight}")
    if (m.text_tower == "class_embedding") != (cfg.loss.kind == "ce"):
        raise ConfigError("loss.kind: ce goes with model.text_tower=class_embedding (and only with it)")
    if cfg.loss.kind == "ce" and (not il.data or il.weight < 1.0):
        raise ConfigError("loss.kind: ce trains on image-label data only: set image_label.data and "
                          "image_label.weight=1.0")
    if cfg.loss.kind == "ce" and (cfg.eval.tasks or cfg.memory_bank.size):
        raise ConfigError("eval.tasks: a class-embedding model has no text encoder; set eval.tasks=[] (and no "
                          "memory bank) — evaluate it with its class embeddings")
    if il.data and cfg.loss.kind == "siglip":
        raise ConfigError("loss.kind: siglip does not take [UniCL]'s image-label targets (a softmax over each "
                          "query's positives); train image-label data with loss.kind=unicl")
    if il.data and cfg.tonics.enabled:
        raise ConfigError("tonics.enabled: TOnICS batches come from one image-text stream; it does not combine "
                          "with image_label.data")
    _check_mix(il, cfg.train.micro_batch_size)


def _check_mix(il, b: int) -> None:
    """A mixed micro-batch takes round(weight × B) image-label rows ([UniCL] App. B.2): at least one of each kind."""
    if il.data and il.weight < 1.0 and b * il.weight < 1:
        raise ConfigError(f"image_label.weight: {il.weight} of train.micro_batch_size={b} is less than one sample")
    if il.data and il.weight < 1.0 and round(b * il.weight) >= b:
        raise ConfigError(f"image_label.weight: {il.weight} of train.micro_batch_size={b} leaves no image-text row "
                          f"(round({il.weight} × {b}) = {b}); use 1.0 for image-label data only, or at most "
                          f"{(b - 1) / b:.4g}")


def streams(cfg) -> int:
    """The image-label stream is a Ray Data pipeline of its own beside image-text data ([UniCL] App. B.2), none
    when it is the only training data (image_label.weight = 1: it is the training stream)."""
    return 1 if cfg.image_label.data and cfg.image_label.weight < 1.0 else 0
