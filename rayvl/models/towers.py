"""Image tower (timm) and text tower (HF encoder + the text strategies of [Paraphrase] §4)."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.utils.checkpoint
from torch import nn

from rayvl import assets
from rayvl.compat import ensure_torchvision_importable, import_timm
from rayvl.config import ClipArchitecture
from rayvl.errors import ConfigError
from rayvl.models import clip_checkpoint, whole_clip
from rayvl.models.meta_init import load_into, parameters_on_meta
from rayvl.models.text_strategies import alignment_layers_for, encoder_layers, insert_adapters


class VisionTower(nn.Module):
    """A timm backbone without its classifier; takes uint8 images and normalises them on the device.

    - ``strategy``: ``finetune`` trains every weight; ``frozen`` locks the backbone (LiT, Zhai et al. 2022,
      arXiv:2111.07991: a pretrained image tower locked, the text tower learning to read it) — no gradients, no
      graph, BatchNorm statistics and dropout as at evaluation; the projection into the shared space still trains.
    - ``patch_dropout``: the share of a ViT's patch tokens dropped at random in every training forward (FLIP, Li et
      al. 2023, arXiv:2212.00794: 50–75%), through timm's own ``patch_drop_rate``; evaluation sees every patch."""

    def __init__(self, name: str, checkpoint: str = "", pretrained: bool = True, strategy: str = "finetune",
                 patch_dropout: float = 0.0, clip: tuple[dict | None, ClipArchitecture] | None = None):
        """``clip``: a whole CLIP's (weights in OpenAI's layout or None, shapes) — its image transformer as timm's
        CLIP ViT (``name`` is then ``clip``)."""
        super().__init__()
        timm = import_timm()
        extra = {"patch_drop_rate": patch_dropout} if patch_dropout else {}
        if clip is not None:
            state, arch = clip
            timm_name, args = whole_clip.timm_args(arch)
            extra.update(args)
        else:
            state = assets.vision_state_dict(name, checkpoint) if pretrained else None
            timm_name = assets.vision_timm_name(name)
        # weights to load: no random init first (meta_init); the architecture alone: timm's init
        with parameters_on_meta() if state is not None else nullcontext():
            self.backbone = timm.create_model(timm_name, pretrained=False, **extra)
        self.clip_projection = None  # CLIP's image projection, for the dual encoder's vision_proj
        if state is not None and clip_checkpoint.is_clip(state):
            state, self.clip_projection = clip_checkpoint.convert(state, self.backbone, checkpoint or "",
                                                                  whole=clip is not None)
            self.backbone.reset_classifier(0)  # CLIP's projection is no classifier: it goes to vision_proj
        if state is not None:
            load_into(self.backbone, state)
        self.backbone.reset_classifier(0)
        cfg = self.backbone.pretrained_cfg
        self.register_buffer("mean", torch.tensor(cfg.get("mean", (0.485, 0.456, 0.406))).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(cfg.get("std", (0.229, 0.224, 0.225))).view(1, 3, 1, 1) * 255)
        self.out_dim = self.backbone.num_features
        self.channels_last = False
        self.frozen = strategy == "frozen"
        if self.frozen:  # and in eval mode from the start: nothing calls train() before the first step
            self.backbone.requires_grad_(False).eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.backbone.eval()  # a locked tower is the pretrained function: fixed statistics, no dropout
        return self

    def unlock_last_groups(self, n: int, freeze_bn_stats: bool, counted: int = 0) -> None:
        """A locked tower whose last ``n`` layer groups train (timm's ``group_matcher``: the stem, each block or
        stage, the final norm — the groups open_clip's --lock-image-unlocked-groups counts for a timm tower): the
        tower runs with a graph and in training mode again, the other groups' weights without gradients and, with
        ``freeze_bn_stats``, their BatchNorm layers timm's FrozenBatchNorm2d. ``counted``: the groups as the user
        counts them (a whole CLIP's: ``n`` and its projection), for the error."""
        from timm.layers import freeze_batch_norm_2d
        from timm.models import group_modules, group_parameters

        matcher = self.backbone.group_matcher()
        groups = group_parameters(self.backbone, matcher)
        if n >= len(groups):
            extra = (counted or n) - n  # a whole CLIP's projection, the last of its groups
            raise ConfigError(f"model.vision_unlocked_groups: the image tower has {len(groups) + extra} layer groups"
                              f"{' (its projection the last)' if extra else ''}; unlocking {counted or n} unlocks it "
                              f"all (model.vision_strategy=finetune)")
        self.frozen = False
        locked = max(groups) - n  # the groups up to this one stay locked
        self.backbone.requires_grad_(True).train()
        for group, names in groups.items():
            for name in names:
                self.backbone.get_parameter(name).requires_grad_(group > locked)
        if freeze_bn_stats:
            for name, group in group_modules(self.backbone, matcher, reverse=True).items():
                parent, _, child = name.rpartition(".")
                owner = self.backbone.get_submodule(parent) if parent else self.backbone
                if group <= locked:  # a BatchNorm itself is replaced; inside a module, converted in place
                    setattr(owner, child, freeze_batch_norm_2d(getattr(owner, child)))

    def to_channels_last(self) -> "VisionTower":
        """Weights and inputs in NHWC, for inference: oneDNN's depthwise and pointwise convolutions run faster on it
        (efficientnet-lite0, 64 px, one CPU thread: 185 → 316 crops/s). Not for training: DeepSpeed's flat ZeRO
        buffers would give the weights back their contiguous layout."""
        self.backbone.to(memory_format=torch.channels_last)
        self.channels_last = True
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # normalised in fp32, then in the backbone's own dtype: under bf16 DeepSpeed holds bf16 weights, while
        # the mean/std buffers may stay fp32
        x = (images.float() - self.mean.float()) / self.std.float()
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):  # a locked tower needs no graph
            return self.backbone(x.to(next(self.backbone.parameters()).dtype))


class TextTower(nn.Module):
    """A pretrained HF encoder used by one of four strategies ([Paraphrase] §4, Fig. 3 b–e):

    - ``finetune``: every LM weight trains;
    - ``frozen``: the LM is frozen (LiT's locked text tower) — only the projection trains;
    - ``frozen_adapters``: the LM is frozen and a bottleneck adapter (reduction 2) is inserted in every layer;
    - ``frozen_alignment``: the LM is frozen and ``alignment_layers`` transformer layers shaped like the LM's own,
      randomly initialised, are appended on top ("alignment layers", [Paraphrase] Fig. 3e).
    """

    def __init__(self, name: str, strategy: str, alignment_layers: int, pooling: str, adapter_reduction: int = 2,
                 pretrained: bool = True, clip: tuple[dict | None, ClipArchitecture] | None = None):
        """``clip``: a whole CLIP's (weights in OpenAI's layout or None, shapes) — its text transformer as Hugging
        Face's ``CLIPTextModel``, causal, pooled at the end-of-text token (``pooling`` eot)."""
        super().__init__()
        from transformers import AutoConfig, AutoModel

        if clip is not None:
            ensure_torchvision_importable()  # transformers' CLIP imports its image processor's torchvision
            from transformers import CLIPTextModel

            state, arch = clip
            with parameters_on_meta() if state is not None else nullcontext():
                self.lm = CLIPTextModel(whole_clip.text_config(arch))
            if state is not None:
                load_into(self.lm, whole_clip.text_state(state, "text_model." if hasattr(self.lm, "text_model")
                                                         else ""))
        elif pretrained:
            path = str(assets.text_model_path(name))
            self.lm = AutoModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False)
        else:  # the architecture only: the weights come from a rayvl checkpoint or export
            path = str(assets.text_model_path(name))
            self.lm = AutoModel.from_config(AutoConfig.from_pretrained(path, local_files_only=True),
                                            add_pooling_layer=False)
        self.strategy, self.pooling = strategy, pooling
        self.causal = clip is not None
        self.lm_frozen = strategy != "finetune"
        if self.lm_frozen:
            self.lm.requires_grad_(False)
        # a plain list: the adapters live (once) inside the LM's layers
        self.adapters = insert_adapters(self.lm, adapter_reduction) if strategy == "frozen_adapters" else []
        self.alignment = nn.ModuleList(alignment_layers_for(self.lm, alignment_layers)
                                       if strategy == "frozen_alignment" else [])
        self.out_dim = self.lm.config.hidden_size
        self.checkpointing = False

    def unlock_last_layers(self, n: int, counted: int = 0) -> None:
        """A locked LM whose last ``n`` transformer layers train — and a CLIP's final LayerNorm after them
        (open_clip's --lock-text-unlocked-layers): its embeddings and other layers stay locked, the LM runs with a
        graph and in training mode. ``counted``: the layers as the user counts them (a whole CLIP's: ``n`` and its
        projection), for the error."""
        layers = encoder_layers(self.lm)
        if n > len(layers):
            extra = (counted or n) - n
            raise ConfigError(f"model.text_unlocked_layers: the LM has {len(layers)} layers"
                              f"{' and its projection' if extra else ''}, not {counted or n}")
        self.lm_frozen = False
        self.lm.requires_grad_(False)
        for layer in layers[len(layers) - n:]:
            layer.requires_grad_(True)
        final = getattr(getattr(self.lm, "text_model", self.lm), "final_layer_norm", None)
        if final is not None:
            final.requires_grad_(True)

    def use_checkpointing(self) -> None:
        """Recompute activations in the backward pass: the LM's layers when any of its weights train, and the
        alignment layers."""
        self.checkpointing = True
        if not self.lm_frozen or self.adapters:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def train(self, mode: bool = True):
        super().train(mode)
        if self.lm_frozen:
            self.lm.eval()  # a frozen LM is the pretrained function: no dropout (adapters have none)
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.causal:  # CLIP's text transformer
            return self.clip_forward(input_ids)
        hidden = self.aligned(input_ids, self.attention_mask(attention_mask))
        if self.pooling == "cls":
            return hidden[:, 0]
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)

    def aligned(self, input_ids: torch.Tensor, mask4d: torch.Tensor | None) -> torch.Tensor:
        """The LM's token features, then the alignment layers', each attending under ``mask4d`` (the LM's too); None:
        CLIP's causal attention, the LM's own, and a causal mask for the alignment layers."""
        # a frozen LM needs no graph — unless adapters inside it train
        with torch.set_grad_enabled(torch.is_grad_enabled() and (not self.lm_frozen or len(self.adapters) > 0)):
            hidden = self.lm(input_ids=input_ids, attention_mask=mask4d).last_hidden_state
        if mask4d is None and len(self.alignment):
            n = hidden.shape[1]
            mask4d = torch.full((n, n), float("-inf"), dtype=hidden.dtype, device=hidden.device).triu(1)[None, None]
        for layer in self.alignment:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                out = torch.utils.checkpoint.checkpoint(layer, hidden, mask4d, use_reentrant=False)
            else:
                out = layer(hidden, mask4d)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def clip_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """CLIP's text feature: causal attention (a token sees those before it, so the padding after the end-of-text
        token never reaches it: no padding mask is needed), the alignment layers causal too, then the end-of-text
        token's feature after the final LayerNorm (CLIP eq.: "the activations of the highest layer of the
        transformer at the [EOS] token"). The position is found on the device: no read-back."""
        hidden = self.aligned(input_ids, None)
        eos = self.lm.config.eos_token_id
        # Hugging Face's rule: configs written before its fix name id 2, where the end-of-text id is the largest
        position = input_ids.argmax(-1) if eos == 2 else (input_ids == eos).int().argmax(-1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), position]

    def attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The 4D attention mask of the LM's attention implementation, made once for the LM and the alignment
        layers. Always a mask: transformers' shortcut for a batch without padding (no mask at all) decides by
        reading the mask back from the GPU, which stops the host at every step."""
        from transformers.masking_utils import create_bidirectional_mask

        # the embeddings' shape and dtype are all the mask needs of them: a [B, L, 0] tensor holds no data
        shape_of_embeds = attention_mask.new_empty((*attention_mask.shape, 0), dtype=self.lm.dtype)
        return create_bidirectional_mask(config=self.lm.config, inputs_embeds=shape_of_embeds,
                                         attention_mask=attention_mask, allow_is_bidirectional_skip=False)


def projection(kind: str, in_dim: int, out_dim: int) -> nn.Module:
    """[Paraphrase] §5: linear for vision, a 2-layer MLP for text."""
    if kind == "linear":
        return nn.Linear(in_dim, out_dim, bias=False)
    return nn.Sequential(nn.Linear(in_dim, in_dim), nn.GELU(), nn.Linear(in_dim, out_dim))
