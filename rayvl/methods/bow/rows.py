"""[BoW]'s data: the caption deformation of training rows (§2.2) and the base-split statistics the driver resolves
for it before the run (a Ray Data pass, reused from its artifact when that matches)."""
from __future__ import annotations

import logging
import time
from collections import Counter

from rayvl.data.artifacts import ArtifactMismatch
from rayvl.data.parts import Contribution, DataPart, RowTransform, RunData, Sample
from rayvl.data.shards import Reading
from rayvl.errors import ConfigError
from rayvl.methods.bow import deformation
from rayvl.methods.bow.check import needs_stats, parse_ops
from rayvl.methods.bow.marks import PSEUDO_FLAG

log = logging.getLogger("rayvl")


class Deform(RowTransform):
    """Each training caption through the configured cascade; a caption the cascade empties drops its sample
    (dropped_bow_empty, as the paper removes them). A pseudo-BoW caption (rayvl.methods.bow.pseudo_label, §2.3) is one
    already: trained as it is."""

    def __init__(self, deformer: deformation.Deformer):
        self.deformer = deformer

    def caption(self, text: str, sample: Sample, counts: Counter) -> tuple[str, str | None]:
        if sample.info.get(PSEUDO_FLAG) is True:
            counts["pseudo_bow_captions"] += 1
            return text, None
        counts["bow_captions_in"] += 1
        counts["bow_words_in"] += len(text.split())
        text, base = self.deformer(sample.key, text)
        counts["bow_base_captions"] += base
        return text, None if text else "dropped_bow_empty"


class BowData(DataPart):
    """The deformation of the training captions, with the statistics of their base split."""

    name = "bow"

    def build(self, run: RunData) -> Contribution:
        return Contribution(transform=Deform(deformer(run.cfg, run.train, run.run_dir, run.train_shards)))


def data_part(cfg, train: str, evalset: str) -> BowData | None:
    """BoW's data part when bow.enabled (its settings were checked with the config)."""
    return BowData() if cfg.bow.enabled else None


def deformer(cfg, train: str, run_dir: str, shards: tuple[str, ...] = ()) -> deformation.Deformer | None:
    """The configured BoW cascade with its base-split statistics (reused from the artifact when it matches) over the
    shards of ``train`` (``shards``: as the run's plan listed them); None when bow.enabled is off."""
    b = cfg.bow
    if not b.enabled:
        return None
    ops = parse_ops(b.ops)
    stats = None
    if needs_stats(ops):
        path = b.stats_path or f"{run_dir.rstrip('/')}/bow_stats.json"
        log.info(f"BoW statistics of the base split: reading {path} or a Ray Data pass over {train}")
        start = time.perf_counter()
        try:
            stats, reused = deformation.load_or_compute(shards or train, path, seed=b.seed, fraction=b.base_fraction,
                                                        reading=Reading.of(cfg, None))
        except ArtifactMismatch as e:
            raise ConfigError(str(e)) from None
        log.info(f"BoW statistics {'reused from' if reused else 'computed with Ray Data →'} {path} "
                 f"({time.perf_counter() - start:.0f} s): {stats.base_captions} base captions of {stats.captions}, "
                 f"base vocabulary {len(stats.df)} words")
    return deformation.Deformer(ops, b.seed, b.base_fraction, stats, b.top_freq_words, b.keep_base_intact)
