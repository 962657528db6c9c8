"""[Paraphrase]'s config constraints: the text strategies' settings (torch-free; ``rayvl.config`` runs it)."""
from __future__ import annotations

from rayvl.errors import ConfigError


def check(cfg) -> None:
    """model.alignment_layers and model.adapter_reduction, each error naming the key."""
    m = cfg.model
    if m.alignment_layers < 0:  # 0 with frozen_alignment is [Paraphrase] Table 1(c)'s m = 0: the frozen LM alone
        raise ConfigError(f"model.alignment_layers: must be ≥ 0, got {m.alignment_layers}")
    if m.adapter_reduction < 1:  # bottleneck d → d / r → d, [Paraphrase] §4
        raise ConfigError(f"model.adapter_reduction: must be ≥ 1, got {m.adapter_reduction}")
