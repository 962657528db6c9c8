"""[TOnICS]'s data: one training row per (image-text pair, aligned object class), App. A.1, and what the driver
resolves for it — the ontology (before Ray starts: a bad class is a config error) and the rows per class
|X(η_o)| (a Ray Data pass once Ray is up, reused from its artifact when that matches)."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter

from rayvl import assets, storage
from rayvl.data import clip_benchmark
from rayvl.data.artifacts import ArtifactMismatch
from rayvl.methods.tonics.ontology import UNALIGNED, Ontology, fingerprint, keep_frequent, load_or_count
from rayvl.data.parts import Contribution, DataPart, RowTransform, RunData, Sample
from rayvl.data.shards import Reading
from rayvl.errors import ConfigError

log = logging.getLogger("rayvl")


class Objects(RowTransform):
    """A pair becomes one row per aligned class (its ``object``); a pair without one is a single root-only row
    (object −1: drawn in random minibatches only), counted as tonics_unaligned_pairs."""

    columns = {"object": UNALIGNED}

    def __init__(self, ontology: Ontology):
        self.ontology = ontology

    def expand(self, text: str, sample: Sample, counts: Counter) -> list[dict[str, int]]:
        objects = self.ontology.row_objects(text, sample.meta)
        if objects == [UNALIGNED]:
            counts["tonics_unaligned_pairs"] += 1
        counts["tonics_rows"] += len(objects)
        return [{"object": o} for o in objects]


class TonicsData(DataPart):
    """The ontology, restricted to the classes with tonics.min_instances rows once they are counted; the workers'
    curriculum gets |X(η_o)| per class ("sizes")."""

    name = "tonics"

    def __init__(self, ontology: Ontology):
        self.ontology = ontology

    def build(self, run: RunData) -> Contribution:
        kept, sizes = class_counts(run.cfg, self.ontology, run.train, run.run_dir, run.train_shards)
        return Contribution(transform=Objects(kept), worker={"sizes": sizes})


def data_part(cfg, train: str, evalset: str) -> TonicsData | None:
    """TOnICS's data part when tonics.enabled: its refresh needs held-out shards, its ontology WordNet."""
    if not cfg.tonics.enabled:
        return None
    if not evalset:
        raise ConfigError("data.eval: the TOnICS curriculum refresh needs held-out shards (--eval-data)")
    try:
        benchmark = clip_benchmark.find(cfg.data.eval) if cfg.data.eval else None
    except ValueError as e:
        raise ConfigError(f"data.eval: {e}") from None
    if benchmark is not None and benchmark.kind != "retrieval":
        raise ConfigError(f"data.eval: {cfg.data.eval} is a CLIP_benchmark {benchmark.kind} set (no captions); the "
                          f"TOnICS curriculum refresh ranks held-out captions: give captioned held-out shards")
    try:
        assets.require_wordnet()  # a Debian asset a cluster fetches only when asked (cluster.yaml)
    except assets.MissingAssetError as e:
        raise ConfigError(str(e)) from None
    return TonicsData(resolve_ontology(cfg))


def resolve_ontology(cfg) -> Ontology | None:
    """The TOnICS ontology resolved against WordNet (before Ray starts: a bad class name is a config error)."""
    x = cfg.tonics
    if not x.enabled:
        return None
    try:
        return Ontology.build(x.classes, x.overrides, x.tags_field)
    except ValueError as e:
        raise ConfigError(f"tonics.classes{e}" if str(e).startswith("[") else f"tonics.{e}") from None


def counts_path(run_dir: str, made_from: dict) -> str:
    """Where a run without tonics.counts_path keeps the counts: beside its run, under the storage path, named by
    what they were counted from — every run, sweep trial and comparison arm over the same shards and ontology
    reads them instead of counting again (a Ray Data pass before the first step)."""
    digest = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
    return storage.join(storage.parent(run_dir.rstrip("/")), "artifacts", f"tonics_counts-{digest}.json")


def class_counts(cfg, ontology: Ontology, train: str, run_dir: str,
                 shards: tuple[str, ...] = ()) -> tuple[Ontology, list[int]]:
    """|X(η_o)| per class over the shards of ``train`` (``shards``: as the run's plan listed them; a Ray Data pass,
    reused from the artifact when it matches); rare classes dropped."""
    x = cfg.tonics
    made_from = fingerprint(shards or train, ontology)
    path = x.counts_path or counts_path(run_dir, made_from)
    log.info(f"TOnICS rows per class: reading {path} or a Ray Data pass over {train}")
    start = time.perf_counter()
    try:
        counts, reused = load_or_count(shards or train, path, ontology, Reading.of(cfg, None), made_from)
    except ArtifactMismatch as e:
        raise ConfigError(str(e)) from None
    kept, sizes = keep_frequent(ontology, counts, x.min_instances)
    log.info(f"TOnICS rows per class {'reused from' if reused else 'counted with Ray Data →'} {path} "
             f"({time.perf_counter() - start:.0f} s): "
             + ", ".join(f"{c} {counts.get(i, 0)}{'' if sizes[i] else ' (dropped)'}"
                         for i, c in enumerate(ontology.classes))
             + f"; {counts.get(-1, 0)} pairs without an aligned noun")
    if not kept.kept:
        raise ConfigError(f"tonics.min_instances: no object class has {x.min_instances} rows")
    return kept, sizes
