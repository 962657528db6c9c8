"""Image tower + text tower mapped into one L2-normalised embedding space, with CLIP's learnable temperature."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rayvl.config import ModelConfig
from rayvl.models import whole_clip
from rayvl.models.meta_init import load_into, parameters_on_meta
from rayvl.models.towers import TextTower, VisionTower, projection


class DualEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, pretrained: bool = True):
        """``pretrained=False``: the towers' architectures without their pretrained weights (a model whose
        weights are loaded next, from a checkpoint or an export)."""
        super().__init__()
        self.cfg = cfg
        # a whole CLIP (model.init_from_clip): both towers, both projections and the temperature from its weights
        whole = cfg.clip.vision_width > 0
        clip = whole_clip.read(cfg.init_from_clip) if whole and pretrained and cfg.init_from_clip else None
        self.vision = VisionTower(cfg.vision, cfg.vision_checkpoint, pretrained, cfg.vision_strategy,
                                  cfg.patch_dropout, clip=(clip, cfg.clip) if whole else None)
        # open_clip's --lock-image-unlocked-groups N: a timm tower's last N groups, its new projection training
        # apart; a whole CLIP's projection is its ViT's last group, locked with it (open_clip's lock_image_tower)
        whole_locked = whole and cfg.vision_strategy == "frozen"
        if cfg.vision_unlocked_groups - whole_locked > 0:
            self.vision.unlock_last_groups(cfg.vision_unlocked_groups - whole_locked, cfg.vision_freeze_bn_stats,
                                           counted=cfg.vision_unlocked_groups)
        self.vision_proj = projection(cfg.vision_projection, self.vision.out_dim, cfg.embed_dim)
        if self.vision.clip_projection is not None:  # a CLIP checkpoint's own (shape checked before Ray starts)
            with torch.no_grad():
                self.vision_proj.weight.copy_(self.vision.clip_projection)
        if whole_locked and not cfg.vision_unlocked_groups:
            self.vision_proj.requires_grad_(False)
        if cfg.text_tower == "class_embedding":
            # [UniCL] eq. (4): CE is the special case whose "text encoder" is a linear embedding per class
            if cfg.num_classes < 1:
                raise ValueError("model.num_classes: a class-embedding text tower needs the number of classes")
            self.class_embed = nn.Parameter(torch.randn(cfg.num_classes, cfg.embed_dim) * 0.02)
        else:
            self.text = TextTower(cfg.text, cfg.text_strategy, cfg.alignment_layers, cfg.pooling,
                                  cfg.adapter_reduction, pretrained, clip=(clip, cfg.clip) if whole else None)
            # open_clip's --lock-text-unlocked-layers N: an HF LM's last N layers, its projection training apart; a
            # whole CLIP's text projection is its transformer's last group, locked with it (lock_text_tower)
            text_locked = whole and cfg.text_strategy == "frozen"
            if cfg.text_unlocked_layers - text_locked > 0:
                self.text.unlock_last_layers(cfg.text_unlocked_layers - text_locked, counted=cfg.text_unlocked_layers)
            self.text_proj = projection(cfg.text_projection, self.text.out_dim, cfg.embed_dim)
            if clip is not None:  # CLIP's x @ text_projection is a bias-free linear layer of its transpose
                with torch.no_grad():
                    self.text_proj.weight.copy_(clip["text_projection"].t())
            if text_locked and not cfg.text_unlocked_layers:
                self.text_proj.requires_grad_(False)
        if cfg.activation_checkpointing:
            # not a BatchNorm tower: recomputing its blocks would update the running statistics twice per step
            if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.vision.modules()):
                self.vision.backbone.set_grad_checkpointing(True)
            if cfg.text_tower != "class_embedding":
                self.text.use_checkpointing()
        # CLIP keeps log(1/τ) as the parameter and clamps exp() at 100; shape [1], not a 0-dim tensor, because
        # DeepSpeed broadcasts parameters as byte views, which 0-dim tensors do not allow
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(cfg.init_logit_scale)),
                                        requires_grad=cfg.learn_logit_scale)
        if clip is not None:  # the checkpoint's own log(1/τ), bit for bit (not through exp and log)
            with torch.no_grad():
                self.logit_scale.copy_(clip["logit_scale"].reshape(1))
        if cfg.init_logit_bias is not None:  # SigLIP's learnable bias b (Zhai et al. 2023, Algorithm 1)
            self.logit_bias = nn.Parameter(torch.full((1,), float(cfg.init_logit_bias)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.vision_proj(self.vision(images)), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text_proj(self.text(input_ids, attention_mask)), dim=-1)

    def scale(self) -> torch.Tensor:
        return capped_exp(self.logit_scale, self.cfg.max_logit_scale).squeeze(0)

    def encode_classes(self) -> torch.Tensor:
        return F.normalize(self.class_embed, dim=-1)

    def bias(self) -> torch.Tensor | None:
        """SigLIP's logit bias (None without one)."""
        return self.logit_bias.squeeze(0) if self.cfg.init_logit_bias is not None else None

    def forward(self, image, input_ids, attention_mask):
        """(image features, text features — or the class embeddings of a CE model —, logit scale[, logit bias])."""
        if self.cfg.text_tower == "class_embedding":
            return self.encode_image(image), self.encode_classes(), self.scale()
        out = self.encode_image(image), self.encode_text(input_ids, attention_mask), self.scale()
        return out if self.cfg.init_logit_bias is None else (*out, self.bias())


class _CappedExp(torch.autograd.Function):
    """exp(s) clamped at ``cap`` in the forward, with exp(s)'s own gradient: open_clip's temperature. open_clip uses
    exp(s) as it is and clamps the parameter to ln(cap) after each optimizer step, so a gradient that lowers s
    always acts; a clamp in the forward alone would give s no gradient once exp(s) ≥ cap, and a released CLIP
    stores s = ln(100) (in fp16 a hair above it): its temperature could then never fall. Here the trainer clamps s
    after each step as open_clip does (rayvl.train.step.clamp_temperature, on the optimizer's fp32 copy), and the
    forward's clamp only covers the bf16 copy a ZeRO step refreshed from it before that clamp."""

    @staticmethod
    def forward(ctx, s: torch.Tensor, cap: float) -> torch.Tensor:
        value = s.exp().clamp(max=cap)
        ctx.save_for_backward(value)
        return value

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (value,) = ctx.saved_tensors
        return grad * value, None  # d exp(s)/ds = exp(s), at s ≤ ln(cap)


def capped_exp(s: torch.Tensor, cap: float) -> torch.Tensor:
    """CLIP's logit scale exp(s), at most ``cap`` (model.max_logit_scale), with open_clip's gradient (_CappedExp)."""
    return _CappedExp.apply(s, cap)


def meta_model(cfg: ModelConfig) -> DualEncoder:
    """The dual encoder on the meta device, for counting its parameters: nothing allocated, no weights read (a
    class-embedding tower whose classes its data will give gets one)."""
    import dataclasses

    with torch.device("meta"):
        return DualEncoder(dataclasses.replace(cfg, num_classes=max(1, cfg.num_classes)), pretrained=False)


def build_model(cfg: ModelConfig, seed: int = 0, state: dict | None = None) -> DualEncoder:
    """The dual encoder: its towers' pretrained weights and random layers of ``seed`` — or, given a whole model's
    ``state`` (a checkpoint, an export), the architecture with those weights and no init before them."""
    if state is not None:
        with parameters_on_meta():
            model = DualEncoder(cfg, pretrained=False)
        return load_into(model, state)
    torch.manual_seed(seed)  # every rank builds identical random layers; DeepSpeed also broadcasts rank 0's
    return DualEncoder(cfg)


def param_groups(model: nn.Module, weight_decay: float, rule: int = 2) -> list[dict]:
    """Trainable parameters only (frozen LM weights never reach the optimizer or its ZeRO state); no decay on
    biases, norms, the logit scale and bias, and a ViT's class token (CLIP / open_clip convention: what is not a
    matrix; timm holds the class token as (1, 1, width), OpenAI's CLIP and open_clip as a vector). ``rule`` 1: the
    class token decayed, as rayvl did before — a checkpoint of then resumes with its optimizer's groups
    (rayvl.train.resume.decay_rule)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        vector = p.ndim < 2 or "logit_scale" in name or (rule >= 2 and name.endswith("cls_token"))
        (no_decay if vector else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
