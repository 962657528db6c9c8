"""What a method adds to a run's data — the interfaces the core's data plane and driver define and the methods
(``rayvl.methods``, registered in ``rayvl.plugins``) fill; torch-free: they run in Ray Data's read tasks and on the
driver before Ray starts. ``RowTransform``: what a method changes of a shard row in the read tasks;
``DataPart``: what the driver resolves for its data before and after Ray starts. Every hook's default changes
nothing."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One shard sample as the row transforms see it."""

    key: str
    meta: bytes | str | None
    """its JSON metadata as read."""
    info: dict
    """that metadata parsed ({} when absent or not a JSON object)."""
    cls: int
    """its ``cls`` (−1 when absent)."""
    rng: np.random.Generator | None
    """drawn from (seed, key, pass) alone when ``Rows.draws``, else None."""


class RowTransform:
    """A method's change to a shard row inside ``rayvl.data.pipeline.preprocess`` (pickled into Ray Data's read
    tasks), its hooks called in this order for each sample. ``columns``: the int64 columns it adds to every output
    row, with the value a row it did not set gets; ``draws``: it draws from the sample's random generator even when
    the rows are not training rows (e.g. a prompt per row)."""

    columns: dict[str, int] = {}
    draws: bool = False

    def source(self, raw, sample: Sample) -> tuple[str, str | None] | None:
        """The row's caption from elsewhere than its own text ``raw`` — (caption, None) or ("", the reason the
        row is dropped, counted) — or None: its own text, validated. The first transform that sources wins."""
        return None

    def caption(self, text: str, sample: Sample, counts: Counter) -> tuple[str, str | None]:
        """(the valid caption ``text`` as this method changes it, None) or ("", the reason the row is dropped,
        counted)."""
        return text, None

    def expand(self, text: str, sample: Sample, counts: Counter) -> list[dict[str, int]]:
        """One output row per returned dict of column values (a dict per training row the sample makes)."""
        return [{}]


@dataclass(frozen=True)
class RunData:
    """What a method's data part is built for, once Ray is up."""

    cfg: Any
    """the run's config (``rayvl.config.RayvlConfig``, as the run plan resolved it)."""
    train: str
    """the training shards' spec (for messages)."""
    train_shards: tuple[str, ...]
    """its shards, resolved once by the run's plan: what a method's passes read (no listing again)."""
    run_dir: str
    """the run's directory: where artifacts such as corpus statistics are saved."""
    reports: dict[str, str]
    """the data report of each stream the run reads, by stream ("train", "eval", a part's own)."""


@dataclass(frozen=True)
class Contribution:
    """What a method's data part gives the run."""

    transform: RowTransform | None = None
    """its change to the rows of the training stream."""
    datasets: dict[str, Any] = field(default_factory=dict)
    """Ray Datasets it adds to the run's, or replaces there, by name ("labeled", "train")."""
    worker: dict = field(default_factory=dict)
    """what its ``TrainPart`` needs on every worker (``Worker.inputs(name)``)."""


class DataPart:
    """A method's part of a run's data on the driver: made from the config before Ray starts (its ``rows.py``'s
    ``data_part``; a problem is a ConfigError naming the key) and built once Ray is up (``build``)."""

    name: str = ""
    streams: dict[str, str] = {}
    """the extra streams it reads, each counted in its own data report "<the run's report>-<suffix>": {stream:
    suffix}."""

    def classes(self) -> int:
        """The classes its data gives a class-embedding text tower (one learned embedding a class), 0 for none: a
        fact of the data the driver sets ``model.num_classes`` from (rayvl.train.datasets.with_classes) — a part
        states it and never changes the config itself."""
        return 0

    def batch_rows(self, cfg) -> int:
        """Rows of each micro-batch it fills from a stream of its own, not from the training shards."""
        return 0

    def build(self, run: RunData) -> Contribution:
        """Its transform, datasets and worker inputs (may run Ray Data passes over ``run.train``)."""
        return Contribution()
