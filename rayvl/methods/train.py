"""The training parts of the enabled methods, in a fixed order (the first part that gives a batch source, targets
or a loss is the one used: a memory bank's loss takes the targets TOnICS or UniCL give)."""
from __future__ import annotations

from rayvl.methods.base import TrainPart
from rayvl.methods.bow.train import MemoryBankPart
from rayvl.methods.tonics.train import TonicsPart
from rayvl.methods.unicl.train import UniclPart
from rayvl.train.worker import Worker

PARTS = (TonicsPart, UniclPart, MemoryBankPart)


def train_parts(worker: Worker) -> list[TrainPart]:
    return [part(worker) for part in PARTS if part.enabled(worker.cfg)]
