"""What a run's steady steps do on the device, watched from the workers' environment (rayvl/checks/gpu.py sets
both). Without the variables nothing is imported or recorded.

- ``RAYVL_PROFILE=<dir>:<first step>:<steps>``: a torch.profiler trace. Rank 0 records steps first..first+steps-1
  with CPU and CUDA activity and writes ``<dir>/trace-rank0.json`` (chrome://tracing, Perfetto) and
  ``<dir>/ops-rank0.txt`` (the ops by host time, then by device time).
- ``RAYVL_PROFILE_STARTUP=<dir>``: rank 0's training thread under cProfile from the training function's start to
  the end of its first step (the ``setup`` to ``first_step`` phases of rayvl/train/startup.py: the model's build and
  its imports, the engine's), ``<dir>/startup-rank0.txt``: rayvl's functions by cumulative time, then all
  functions by cumulative time and by their own. What precedes the function (Ray Train's worker group, the worker's
  own imports: the ``workers`` phase) is not in it. Up to Python 3.11 cProfile sees this thread only; from 3.12 (it
  then uses ``sys.monitoring``) every thread of the process, the held-out read's and Ray's among them. Its hooks
  slow pure Python down: the phases of a profiled start are longer than an unprofiled one's.
- ``RAYVL_SYNC_DEBUG=<dir>[:<first step>]``: every step from the first (default 3) runs under
  ``torch.cuda.set_sync_debug_mode("warn")``, and each rank appends to ``<dir>/syncs-rank<r>-<pid>.jsonl`` the
  synchronisations it caught a step and the first few with their stacks (``read_syncs`` sums them). Only the step
  is watched: the loop's reports and checkpoints read the device on purpose.
"""
from __future__ import annotations

import json
import os
import re
import threading
import traceback
import warnings
from pathlib import Path

ENV = "RAYVL_PROFILE"
STARTUP_ENV = "RAYVL_PROFILE_STARTUP"
SYNC_ENV = "RAYVL_SYNC_DEBUG"
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning in the "warn" sync debug mode
SYNC_FIRST_STEP = 3  # steps 1-2 hold one-off work: cuDNN and cuBLAS choices, the allocator's first blocks


class StepProfiler:
    def __init__(self, spec: str, rank: int, sync_spec: str = ""):
        """``spec``: RAYVL_PROFILE's value ('' or another rank than 0: records nothing); ``sync_spec``:
        RAYVL_SYNC_DEBUG's."""
        out, first, steps = spec.rsplit(":", 2) if spec else ("", "0", "0")
        self.out, self.first, self.last, self.rank = Path(out), int(first), int(first) + int(steps) - 1, rank
        self.on, self.profile = bool(spec) and rank == 0, None
        self.syncs = SyncWatch(sync_spec, rank)

    @classmethod
    def from_env(cls, rank: int) -> "StepProfiler":
        return cls(os.environ.get(ENV, ""), rank, os.environ.get(SYNC_ENV, ""))

    def before(self, step: int) -> None:
        """Called before optimizer step ``step``."""
        if self.on and step == self.first and self.profile is None:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
            self.profile.__enter__()
        self.syncs.before(step)  # after the profiler's start, which is not the step's

    def after(self, step: int) -> None:
        """Called after optimizer step ``step``: the last profiled one writes the trace."""
        self.syncs.after(step)  # before the trace's own synchronisation
        if self.profile is None or step != self.last:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device's last kernels belong in the trace
        self.profile.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        self.profile.export_chrome_trace(str(self.out / f"trace-rank{self.rank}.json"))
        table = self.profile.key_averages()
        device = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        (self.out / f"ops-rank{self.rank}.txt").write_text(
            f"steps {self.first}-{self.last}\n\n" + table.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n\n" + table.table(sort_by=device, row_limit=40) + "\n")
        self.profile = None


class StartupProfile:
    """RAYVL_PROFILE_STARTUP: where rank 0's training thread spends the time before its first step, by function."""

    ROWS = 45

    def __init__(self, out: str, rank: int):
        self.out, self.rank, self.profile = Path(out) if out else None, rank, None
        if self.out is not None and rank == 0:
            import cProfile

            profile = cProfile.Profile()
            try:
                profile.enable()
            except ValueError as e:  # another profiler holds the interpreter's (3.12+: sys.monitoring's) hook
                warnings.warn(f"{STARTUP_ENV}: the start is not profiled: {e}", stacklevel=2)
                return
            self.profile = profile

    @classmethod
    def from_env(cls, rank: int) -> "StartupProfile":
        return cls(os.environ.get(STARTUP_ENV, ""), rank)

    def stop(self) -> None:
        """Called once the first step is done: writes the profile (a second call does nothing)."""
        if self.profile is None:
            return
        import io
        import pstats

        self.profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(self.profile, stream=text)
        package = re.escape(str(Path(__file__).resolve().parent.parent) + os.sep)  # not a checkout's .venv/
        stats.sort_stats("cumulative").print_stats(package, self.ROWS)  # rayvl's own phases first
        for order in ("cumulative", "tottime"):
            stats.sort_stats(order).print_stats(self.ROWS)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"startup-rank{self.rank}.txt").write_text(
            "rank 0's training thread from the training function's start to its first step's end\n" + text.getvalue())
        self.profile = None


class SyncWatch:
    """RAYVL_SYNC_DEBUG: the host synchronisations of each step from ``first`` on, one line a step appended to this
    rank's file (a whole file rewritten a step would cost the step more than a line) — a run that stops early keeps
    what it saw. A no-op where the step does not run on CUDA: the sync debug mode is CUDA's, and a CPU step's
    synchronisations are the step census's to count (rayvl/checks/census.py)."""

    SAMPLES = 5  # the stacks kept: the first few say where; the count says how often

    def __init__(self, spec: str, rank: int):
        out, _, first = spec.rpartition(":")
        if not first.isdigit():  # a folder alone (which may hold a colon itself)
            out, first = spec, str(SYNC_FIRST_STEP)
        self.out, self.first, self.rank = Path(out), int(first), rank
        self.cuda: bool | None = None if spec else False  # decided at the first watched step
        self.file, self.catching, self.shown = None, None, warnings.showwarning
        self.step, self.caught, self.samples = 0, 0, 0

    def before(self, step: int) -> None:
        if self.cuda is False or step < self.first:
            return
        import torch

        if self.cuda is None:  # CUDA already initialised by the first steps: the step runs there
            self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            if not self.cuda:
                return
        self.step, self.caught = step, 0
        self.catching = warnings.catch_warnings()  # restores the filters and showwarning in after()
        self.catching.__enter__()
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")  # setting it says so
        warnings.filterwarnings("always", message=SYNC_MESSAGE)  # every one, not once per call site
        self.shown, warnings.showwarning = warnings.showwarning, self._caught
        torch.cuda.set_sync_debug_mode("warn")

    def after(self, step: int) -> None:
        if self.catching is None:
            return
        import torch

        torch.cuda.set_sync_debug_mode(0)
        self.catching.__exit__(None, None, None)
        self.catching = None
        self._write({"step": step, "syncs": self.caught})

    def _caught(self, message, category, filename, lineno, file=None, line=None) -> None:
        """warnings.showwarning while a step runs, in whichever thread warned: a synchronisation is counted (the
        first few with their stacks), any other warning shown as it would have been."""
        if not str(message).startswith(SYNC_MESSAGE):
            self.shown(message, category, filename, lineno, file, line)
            return
        self.caught += 1
        if self.samples < self.SAMPLES:
            self.samples += 1
            self._write({"step": self.step, "thread": threading.current_thread().name,
                         "message": " ".join(str(message).split()), "stack": _stack()})

    def _write(self, record: dict) -> None:
        if self.file is None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.file = open(self.out / f"syncs-rank{self.rank}-{os.getpid()}.jsonl", "a")
            self.file.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "first_step": self.first}) + "\n")
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def _stack(frames: int = 8) -> list[str]:
    """The innermost ``frames`` frames that warned, without the warnings machinery and this module."""
    here = {__file__, warnings.__file__}
    stack = [f for f in traceback.extract_stack() if f.filename not in here]
    return [f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} {f.name}" for f in stack[-frames:]]


def read_syncs(paths: list[Path]) -> dict:
    """SyncWatch's files (one per rank and worker process) summed: the steps watched over every rank, the
    synchronisations caught, the steps that had any and the stacks kept."""
    steps, syncs, at, samples = 0, 0, set(), []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if "syncs" in record:
                steps, syncs = steps + 1, syncs + record["syncs"]
                if record["syncs"]:
                    at.add(record["step"])
            elif "stack" in record:
                samples.append(record)
    return {"steps": steps, "syncs": syncs, "steps_with_syncs": sorted(at), "samples": samples}
