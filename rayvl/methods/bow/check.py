"""[BoW]'s config constraints and the grammar of its settings (torch-free; ``rayvl.config`` runs ``check``): the
``bow.ops`` cascade of caption deformations (§2.2), the memory bank of negatives (§2.1) and the pseudo-label rules
(§2.3)."""
from __future__ import annotations

from dataclasses import dataclass

from rayvl.errors import ConfigError

# the word-ranking rules of a pseudo-BoW caption, [BoW] §2.3 (rayvl.methods.bow.word_rank)
RULES = ("max_count", "rm_top_max_count", "rm_top_rand", "weighted_count")


@dataclass(frozen=True)
class BowOp:
    """One operator of the ``bow.ops`` cascade ([BoW] §2.2), its argument t or n where it takes one."""

    name: str
    arg: int | None = None


_TAKES_ARG = {"shuffle": False, "rm_stop_nalpha": False, "limit_to_base_vocab": False, "rm_top_freq": True,
              "keep": True}


def parse_ops(spec: list) -> list[BowOp]:
    """``[shuffle, rm_stop_nalpha, {rm_top_freq: 1000}, {keep: 4}]`` → BowOps. Errors are ValueError("[i]: ...")."""
    ops = [_op(i, item) for i, item in enumerate(spec)]
    names = [op.name for op in ops]
    if "keep" in names and (names.count("keep") > 1 or names[-1] != "keep"):
        raise ValueError(f"[{names.index('keep')}]: keep must come once and last — Keep(n) is always applied after "
                         f"all other operations ([BoW] §2.2)")
    return ops


def _op(i: int, item) -> BowOp:
    if isinstance(item, str):
        name, arg = item, None
    elif isinstance(item, dict) and len(item) == 1:
        name, arg = next(iter(item.items()))
    else:
        raise ValueError(f"[{i}]: expected an operator name or {{name: value}}, got {item!r}")
    if name not in _TAKES_ARG:
        raise ValueError(f"[{i}]: unknown operator {name!r} (known: {', '.join(_TAKES_ARG)})")
    if _TAKES_ARG[name]:
        if isinstance(arg, bool) or not isinstance(arg, int) or arg < (1 if name == "keep" else 0):
            raise ValueError(f"[{i}]: {name} needs a whole number{' ≥ 1' if name == 'keep' else ' ≥ 0'}, "
                             f"e.g. {{{name}: 4}}; got {arg!r}")
    elif arg is not None:
        raise ValueError(f"[{i}]: {name} takes no value, got {arg!r}")
    return BowOp(name, arg)


def needs_stats(ops: list[BowOp]) -> bool:
    """LimitToBaseVocab and RmTopFreq read the base split's statistics (a Ray Data pass before training)."""
    return any(op.name in ("limit_to_base_vocab", "rm_top_freq") for op in ops)


def negatives(cfg) -> tuple[int, str]:
    """The memory bank's queue: K keys a query is scored against beside the gathered batch ([BoW] eq. (1)–(2))."""
    return cfg.memory_bank.size, "the EMA memory bank"


def check(cfg) -> None:
    """The bow, memory_bank and pseudo_label sections, each error naming the key."""
    _check_ops(cfg.bow)
    _check_memory_bank(cfg.memory_bank, cfg.train)
    if cfg.memory_bank.size and cfg.loss.kind == "siglip":
        raise ConfigError("memory_bank.size: the EMA memory bank's loss is InfoNCE over its queue ([BoW] eq. (1)–(2)), "
                          "not SigLIP's sigmoid terms: set memory_bank.size=0 or loss.kind=clip (or unicl)")
    _check_pseudo_label(cfg.pseudo_label)


def _check_ops(b) -> None:
    try:
        ops = parse_ops(b.ops)
    except ValueError as e:
        raise ConfigError(f"bow.ops{e}") from None
    if not 0.0 <= b.base_fraction < 1.0:
        raise ConfigError(f"bow.base_fraction: must be in [0, 1), got {b.base_fraction}")
    if b.base_fraction == 0.0 and needs_stats(ops):
        raise ConfigError("bow.base_fraction: limit_to_base_vocab / rm_top_freq need a base split (> 0)")


def _check_memory_bank(mb, t) -> None:
    """[BoW] §2.1 eq. (1)–(3): an EMA key encoder and a queue of K keys at a fixed temperature τ."""
    if mb.size < 0:
        raise ConfigError(f"memory_bank.size: must be ≥ 0, got {mb.size}")
    if mb.size and t.zero_stage == 3:
        raise ConfigError("memory_bank.size: the EMA memory bank needs every full parameter on every rank at every "
                          "step, which ZeRO-3 partitions away; use train.zero_stage ≤ 2 with a memory bank")
    if mb.size and not 0.0 <= mb.momentum < 1.0:
        raise ConfigError(f"memory_bank.momentum: must be in [0, 1), got {mb.momentum}")
    if mb.size and mb.temperature <= 0:
        raise ConfigError(f"memory_bank.temperature: must be > 0, got {mb.temperature}")


def _check_pseudo_label(x) -> None:
    for i, rule in enumerate(x.rules):
        if rule not in RULES:
            raise ConfigError(f"pseudo_label.rules[{i}]: unknown rule {rule!r} (known: {', '.join(RULES)})")
    if len(set(x.rules)) != len(x.rules):
        raise ConfigError(f"pseudo_label.rules: a rule is listed twice: {x.rules}")
    for name in ("crops", "k", "words", "index_nprobe", "shard_size", "batch_size"):
        if getattr(x, name) < 1:
            raise ConfigError(f"pseudo_label.{name}: must be ≥ 1, got {getattr(x, name)}")
    for name in ("top_t", "index_exact_max", "index_nlist", "recall_sample", "actors"):
        if getattr(x, name) < 0:
            raise ConfigError(f"pseudo_label.{name}: must be ≥ 0, got {getattr(x, name)}")
    if not 0 < x.crop_scale_min <= 1:
        raise ConfigError(f"pseudo_label.crop_scale_min: must be in (0, 1], got {x.crop_scale_min}")
    if x.cpus_per_actor < 0 or not 0 <= x.gpus_per_actor <= 1:
        raise ConfigError(f"pseudo_label.cpus_per_actor / gpus_per_actor: must be ≥ 0 / in [0, 1] (an actor's model "
                          f"runs on one GPU), got {x.cpus_per_actor:g} / {x.gpus_per_actor:g}")
