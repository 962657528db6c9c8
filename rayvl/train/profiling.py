"""A torch.profiler trace of a few steady steps of a run: ``RAYVL_PROFILE=<dir>:<first step>:<steps>`` in the
workers' environment (benchmarks/gpu_check.py ``--profile``). Rank 0 records steps first..first+steps-1 with CPU
and CUDA activity and writes ``<dir>/trace-rank0.json`` (chrome://tracing, Perfetto) and ``<dir>/ops-rank0.txt``
(the ops by host time, then by device time). Without the variable nothing is imported or recorded."""
from __future__ import annotations

import os
from pathlib import Path

ENV = "RAYVL_PROFILE"


class StepProfiler:
    def __init__(self, spec: str, rank: int):
        """``spec``: the variable's value ('' or another rank than 0: records nothing)."""
        out, first, steps = spec.rsplit(":", 2) if spec else ("", "0", "0")
        self.out, self.first, self.last, self.rank = Path(out), int(first), int(first) + int(steps) - 1, rank
        self.on, self.profile = bool(spec) and rank == 0, None

    @classmethod
    def from_env(cls, rank: int) -> "StepProfiler":
        return cls(os.environ.get(ENV, ""), rank)

    def before(self, step: int) -> None:
        """Called before optimizer step ``step``."""
        if self.on and step == self.first and self.profile is None:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
            self.profile.__enter__()

    def after(self, step: int) -> None:
        """Called after optimizer step ``step``: the last profiled one writes the trace."""
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
