"""[TOnICS]'s section of the config tree, ``tonics``; registered with the method (rayvl/methods/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rayvl.local_paths import FilePath


@dataclass
class TonicsConfig:
    """TOnICS ontology-bucketed curriculum minibatches ([TOnICS] §3, App. A)."""

    enabled: bool = False
    """draw each step's minibatch from the root (random) or from one object node ([TOnICS] §3)."""
    classes: list[str] = field(default_factory=list)
    """object classes: WordNet nouns ("dog": its first noun sense that is a physical entity), synset ids
    ("dog.n.01") or a name for a synset ("diamond=rhombus.n.01")."""
    overrides: FilePath = ""
    """JSON file {noun: class} applied before WordNet (the paper corrects its noun→object mapping by hand)."""
    tags_field: str = "objects"
    """JSON metadata field with detector tags (strings, [label, ...] lists or {label|name|class: ...}): the objects
    in the image. A caption noun makes a TOnICS row only for a class the tags hold; without tags, every caption noun
    that maps to a class makes one."""
    min_instances: int = 5000
    """object classes with fewer training rows are dropped (paper: 5000 of 5.8M triplets)."""
    buffer_rows: int = 2048
    """rows each worker keeps in its bucket buffers at least (the buffer grows until it holds about a micro-batch of
    each object: docs/tonics.md)."""
    max_wait_rows: int = 4096
    """rows a worker may read past its buffer looking for an object's rows before the fallback applies: the rest of
    the micro-batch is filled with random rows, counted in tonics_fallback_rows."""
    refresh_every: int = 5000
    """steps between curriculum refreshes (paper: 5K)."""
    refresh_instances: int = 100
    """held-out instances (the first of the eval split) whose image retrieval decides a refresh (paper: 100)."""
    threshold: float = 90.0
    """refresh when held-out text→image R@1 (%) is at least this (paper: 90)."""
    curriculum: bool = True
    """False = the control arm of a comparison: the same triplet rows, sampler and refresh evaluations (logged as
    tonics_last_refresh_accuracy, the learning curve a threshold is read from), but P_S never leaves the root."""
    alpha: float = 0.9
    """P_S(root) ← α·P_S(root) at a refresh (paper: 0.9)."""
    beta: float = 0.2
    """floor of P_S(root) (paper: 0.2)."""
    counts_path: FilePath = ""
    """per-class row counts |X(η_o)| (JSON artifact, summed over a Ray Data pass); reused when its fingerprint matches
    ('' = <storage path>/artifacts/tonics_counts-<hash of the shards' sizes and the ontology>.json: counted once per
    data set, for every run over it)."""
