"""Where the time before a run's first optimizer step goes, phase by phase, in the run's first report.

The driver stamps its phases from ``train()`` on and hands the stamps to the workers in their plan; rank 0 stamps its
own and reports the lot as ``startup_<phase>_s`` beside its first step's metrics. Wall-clock stamps (``time.time``):
the driver and the workers are other processes, and may be on other nodes of a cluster, whose clocks NTP keeps within
milliseconds of each other — well under the seconds the phases take.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# in the order they happen; each phase lasts from the end of the one before it
DRIVER_PHASES = ("ray", "data", "fit")
"""ray: connect to (or start) Ray and check its resources and the storage; data: plan the Ray Datasets and create the
data reports; fit: the run log, the trainer and what else precedes ``fit()``."""
WORKER_PHASES = ("workers", "setup", "model", "engine", "restore", "first_step")
"""workers: Ray Train's controller, placement group, worker processes and process group, until the training function
runs; setup: device, data position, evaluation and the methods' parts, and a thread that reads the held-out set, then
starts the batch source (Ray Data reads beside the next phases); model: the dual encoder built (and ``init_from``
loaded); engine: DeepSpeed's engine (and ``torch.compile``'s wrapper); restore: the wait for that thread, then a
checkpoint restored; first_step: the first optimizer step as the host sees it (a GPU may still be finishing it), its
batch wait included (``startup_first_batch_wait_s``: what Ray Data had not read by then) and, with
``train.compile``, the compilation."""


@dataclass
class Startup:
    """Phase end stamps since ``began``, the moment ``train()`` was called."""

    began: float = field(default_factory=time.time)
    stamps: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str, at: float | None = None) -> None:
        assert phase in DRIVER_PHASES + WORKER_PHASES, phase
        self.stamps[phase] = time.time() if at is None else at

    @classmethod
    def on_worker(cls, planned: Startup | None, entered: float, resumed: bool) -> Startup:
        """A worker's record: the driver's stamps and the worker's start — or, when the run resumes from a
        checkpoint (a restart of the worker group, whose driver stamps are those of the first start, or a new
        driver's ``train.resume``), the phases from the worker's start only. A restart before any checkpoint
        cannot be told from the first start: its ``workers`` phase holds the failed attempt too."""
        if resumed or planned is None:
            return cls(began=entered)
        mine = cls(began=planned.began, stamps=dict(planned.stamps))
        mine.mark("workers", entered)
        return mine

    def metrics(self, first_batch_wait: float) -> dict[str, float]:
        """``startup_<phase>_s`` of each stamped phase, ``startup_first_batch_wait_s`` and ``startup_total_s`` (from
        ``train()`` to the end of the first step)."""
        out, previous = {}, self.began
        for phase in DRIVER_PHASES + WORKER_PHASES:
            if phase in self.stamps:
                out[f"startup_{phase}_s"] = self.stamps[phase] - previous
                previous = self.stamps[phase]
        out["startup_first_batch_wait_s"] = first_batch_wait
        out["startup_total_s"] = previous - self.began
        return out


def summary(row: dict) -> str | None:
    """``first step after 23.1 s: ray 2.0, data 0.4, ...`` from a report's ``startup_*`` fields, None without."""
    if "startup_total_s" not in row:
        return None
    phases = [f"{p.replace('_', ' ')} {row[f'startup_{p}_s']:.1f}" for p in DRIVER_PHASES + WORKER_PHASES
              if f"startup_{p}_s" in row]
    return (f"first step after {row['startup_total_s']:.1f} s: {', '.join(phases)} "
            f"(of which waiting for the first batch {row['startup_first_batch_wait_s']:.1f})")
