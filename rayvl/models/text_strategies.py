"""The text-encoder strategies of [Paraphrase] §4 (Fig. 3 d–e) applied to a pretrained HF encoder: bottleneck
adapters inside every frozen layer, or alignment layers appended on top (``rayvl.models.towers.TextTower`` uses
them; the finetune and frozen strategies only set which weights train)."""
from __future__ import annotations

import copy

import torch
from torch import nn


class BottleneckAdapter(nn.Module):
    """x + up(ReLU(down(x))) with hidden size d / reduction ([Paraphrase] §4 "Frozen Text Encoder with Bottleneck
    Adapter", refs [6, 28]: reduction factor 2). ``up`` starts at zero: the adapted LM starts as the pretrained one."""

    def __init__(self, dim: int, reduction: int):
        super().__init__()
        self.down = nn.Linear(dim, dim // reduction)
        self.up = nn.Linear(dim // reduction, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.relu(self.down(x)))


class _AdaptedOutput(nn.Module):
    """A layer's feed-forward output projection followed by its adapter, before the residual + LayerNorm
    (the sequential bottleneck placement of Pfeiffer et al. / AdapterHub's default)."""

    def __init__(self, dense: nn.Linear, adapter: BottleneckAdapter):
        super().__init__()
        self.dense, self.adapter = dense, adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.dense(x))


def encoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The LM's transformer layers: a BERT-style encoder's, or CLIP's text transformer's (``CLIPTextModel``)."""
    encoder = getattr(lm, "text_model", lm).encoder  # transformers < 5 nests CLIP's under text_model
    return encoder.layers if hasattr(encoder, "layers") else encoder.layer


def insert_adapters(lm: nn.Module, reduction: int) -> list[BottleneckAdapter]:
    """A bottleneck adapter after every layer's feed-forward output ([Paraphrase] §4 "Frozen Text Encoder with
    Bottleneck Adapter"); returns them (they train, the LM stays frozen). In CLIP's pre-LN layers the feed-forward
    output is ``mlp.fc2``, added to the residual directly."""
    adapters = []
    for layer in encoder_layers(lm):
        adapter = BottleneckAdapter(lm.config.hidden_size, reduction)
        if hasattr(layer, "mlp"):
            layer.mlp.fc2 = _AdaptedOutput(layer.mlp.fc2, adapter)
        else:
            layer.output.dense = _AdaptedOutput(layer.output.dense, adapter)
        adapters.append(adapter)
    return adapters


def alignment_layers_for(lm: nn.Module, n: int) -> list[nn.Module]:
    """``n`` transformer layers shaped like the LM's own, randomly initialised, to append on top of the frozen LM
    ("alignment layers", [Paraphrase] §4, Fig. 3e). CLIP's layers are pre-LN residual blocks, x + attn(LN(x)) and
    x + mlp(LN(x)): their two output projections start at zero, so each layer starts as the identity and a whole
    CLIP with alignment layers starts as the pretrained CLIP (its zero-shot accuracy at step 0), as the adapters'
    zero up-projection does."""
    layers = []
    for _ in range(n):
        layer = copy.deepcopy(encoder_layers(lm)[-1])
        layer.apply(lm._init_weights)
        if hasattr(layer, "mlp"):
            for out in (layer.self_attn.out_proj, layer.mlp.fc2):
                nn.init.zeros_(out.weight)
                nn.init.zeros_(out.bias)
        layer.requires_grad_(True)
        layers.append(layer)
    return layers
