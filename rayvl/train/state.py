"""One train state: everything a resumed run needs beside DeepSpeed's own files (model, optimizer, ZeRO
partitions, LR scheduler), as one ``state_dict()`` / ``load_state_dict()`` object per component (torchtitan's
``Stateful``). Components: the progress (step, metric history), the data position (rayvl.data.position; every
rank's rows are merged on rank 0 before a checkpoint) and the training parts' own (a curriculum, a memory bank:
``TrainPart.components``). Each is identical on every rank or complete on rank 0, so rank 0
saves it (``rayvl.checkpoints.STATE_FILE``) and every rank loads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Progress:
    """Optimizer steps done, every metrics report so far, and the steps the run was resumed at (after a failure
    or a restart), so a finished run shows whether it ever restarted from scratch."""

    step: int = 0
    history: list[dict] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"step": self.step, "history": list(self.history), "resumed_at": list(self.resumed_at)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.history = int(state["step"]), list(state["history"])
        self.resumed_at = list(state.get("resumed_at", []))  # absent in checkpoints written before it existed


class TrainState:
    """The run's progress and its other components by name (None = the run does not have that component)."""

    def __init__(self, progress: Progress, added_later: frozenset[str] = frozenset(), **components: Stateful | None):
        """``added_later``: components that checkpoints written before them lack (a training part's
        ``added_later``): such a checkpoint resumes them from their start."""
        self.progress, self.added_later = progress, added_later
        self.components = {"progress": progress, **{name: c for name, c in components.items() if c is not None}}

    def state_dict(self) -> dict:
        return {name: c.state_dict() for name, c in self.components.items()}

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(set(self.components) - set(state) - self.added_later)
        if missing:  # e.g. resuming with a memory bank a run that trained without one
            raise ValueError(f"the checkpoint holds no state for {missing} (it has {sorted(state)}): resume with "
                             f"the settings the run was started with")
        for name, component in self.components.items():
            if name in state:
                component.load_state_dict(state[name])
