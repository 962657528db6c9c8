"""What a method changes of training on every worker (``rayvl.train.loop``): the interface the training loop
defines and a method's ``train.py`` fills (registered in ``rayvl.plugins``). Every hook's default changes nothing."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from rayvl import plugins

if TYPE_CHECKING:
    from rayvl.train.worker import Worker


class TrainPart:
    """A method's part of the training loop on every worker (``rayvl.train.loop``)."""

    name: str = ""
    added_later: frozenset[str] = frozenset()
    """its train-state components that checkpoints written before them lack: such a checkpoint resumes them from
    their start (rayvl.train.state)."""
    key_encoders: bool = False
    """whether it runs a second forward of both towers per sample (a memory bank's EMA key encoders), which the
    FLOPs of a sample count (rayvl.train.flops)."""

    @staticmethod
    def enabled(cfg) -> bool:
        """Whether the run's config switches this part on."""
        return False

    def batches(self) -> Callable[[int, int], tuple[dict, float]] | None:
        """``next_batch(step, micro) → (batch on the device, seconds waited)``, or None to leave the batch source
        to another part (one part at most provides it). Called at most once (in registration order, until a part
        returns a source), in a thread of the worker's own after the held-out set is read and beside the model's
        build (rayvl.train.loop._data_sources): a part starts its Ray Data streams here, not before."""
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


def train_parts(worker: Worker) -> list[TrainPart]:
    """The enabled methods' training parts on this worker, in registration order (rayvl.plugins)."""
    return [part(worker) for part in plugins.train_part_classes() if part.enabled(worker.cfg)]
