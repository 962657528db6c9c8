"""The interfaces a method implements: what it changes of a row in the read tasks (``RowTransform``, torch-free),
what the driver resolves for its data before and after Ray starts (``DataPart``, torch-free) and what it changes of
training on a worker (``TrainPart``). Every hook's default changes nothing."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rayvl.data.pipeline import Sample


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
    """the run's config (``rayvl.config.RayvlConfig``, as the data plan adjusted it)."""
    train: str
    """the training shards (a resolved spec)."""
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
    ``plan``; a problem is a ConfigError naming the key) and built once Ray is up (``build``)."""

    name: str = ""
    streams: dict[str, str] = {}
    """the extra streams it reads, each counted in its own data report "<the run's report>-<suffix>": {stream:
    suffix}."""

    def run_config(self, cfg):
        """The run's config as this part changes it (a value only the data gives)."""
        return cfg

    def batch_rows(self, cfg) -> int:
        """Rows of each micro-batch it fills from a stream of its own, not from the training shards."""
        return 0

    def build(self, run: RunData) -> Contribution:
        """Its transform, datasets and worker inputs (may run Ray Data passes over ``run.train``)."""
        return Contribution()


class TrainPart:
    """A method's part of the training loop on every worker (``rayvl.train.loop``)."""

    name: str = ""

    def batches(self) -> Callable[[int, int], tuple[dict, float]] | None:
        """``next_batch(step, micro) → (batch on the device, seconds waited)``, or None to leave the batch source
        to another part (one part at most provides it)."""
        return None

    def targets(self, batch: dict, batch_index: int):
        """The loss's labels for ``batch`` (a tensor), or None: another part's, else one unique label per row."""
        return None

    def loss(self, features, batch: dict, labels):
        """The loss of the step (a tensor) from ``features`` = (image, text, scale) in fp32, or None: another
        part's, else InfoNCE / label-aware InfoNCE over the gathered batch."""
        return None

    def model_built(self, model) -> None:
        """The model as built, before DeepSpeed wraps it (e.g. to copy it)."""

    def components(self) -> dict[str, Any]:
        """Train-state components by name (``state_dict`` / ``load_state_dict``), saved in every checkpoint."""
        return {}

    def after_step(self, engine, step: int) -> bool:
        """After optimizer step ``step`` (e.g. the key encoders' EMA, a curriculum refresh); True when the step
        must be reported (it did something a report should show)."""
        return False

    def metrics(self, device) -> dict:
        """What this part adds to a report (called on every rank: a part may all-reduce)."""
        return {}
