"""[TOnICS]'s config constraints (torch-free; ``rayvl.config`` runs it)."""
from __future__ import annotations

from pathlib import Path

from rayvl.errors import ConfigError


def check(cfg) -> None:
    """The tonics section when TOnICS is on; its curriculum refresh needs the held-out evaluation ([TOnICS] §3)."""
    x = cfg.tonics
    if not x.enabled:
        return
    if not x.classes:
        raise ConfigError("tonics.classes: TOnICS needs object classes (WordNet nouns or synset ids)")
    if x.overrides and not Path(x.overrides).expanduser().is_file():
        raise ConfigError(f"tonics.overrides: {x.overrides!r} does not exist")
    if not 0.0 < x.alpha < 1.0:
        raise ConfigError(f"tonics.alpha: must be in (0, 1), got {x.alpha}")
    if not 0.0 <= x.beta <= 1.0:
        raise ConfigError(f"tonics.beta: must be in [0, 1], got {x.beta}")
    for name in ("refresh_every", "refresh_instances", "buffer_rows", "min_instances"):
        if getattr(x, name) < 1:
            raise ConfigError(f"tonics.{name}: must be ≥ 1, got {getattr(x, name)}")
    if x.buffer_rows < cfg.train.micro_batch_size:
        raise ConfigError(f"tonics.buffer_rows: {x.buffer_rows} cannot hold one micro-batch of "
                          f"train.micro_batch_size={cfg.train.micro_batch_size}")
    if x.max_wait_rows < 0:
        raise ConfigError(f"tonics.max_wait_rows: must be ≥ 0, got {x.max_wait_rows}")
    if not cfg.eval.tasks:
        raise ConfigError("eval.tasks: the TOnICS curriculum refresh needs the held-out split (eval.tasks empty)")
