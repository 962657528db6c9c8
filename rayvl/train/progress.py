"""The driver's view of a run: one progress line per report, through Python ``logging`` (logger ``rayvl``).

The lines are made from the run's ``metrics.jsonl`` as the run's controller appends it (rayvl.train.run_log), by a
thread of the driver following the file — one source for the terminal, the file and the plots. Ray's own echo of
every report and the workers' output stay out of the terminal unless ``--verbose`` (rayvl.session).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from rayvl import plugins
from rayvl.eval.tasks import METRIC_PREFIXES
from rayvl.train import startup

log = logging.getLogger("rayvl")

# the evaluation numbers a progress line shows when an evaluation ran at that step (the final table has them all)
EVAL_SHOWN = ("zeroshot_top1", "zeroshot_mean_average_precision", "t2i_R@1", "i2t_R@1", "t2i_R@10", "paraphrase_AO@10",
              "sts_spearman")


def duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def progress_line(row: dict, total: int, started: float, rate: float | None, workers: int) -> str:
    """``step 150/200 (75%) | 4m12s, ETA 1m24s | loss 2.314 | lr 6.2e-04 | scale 15.3 | 3810.4 samples/s
    (1905.2/worker) | MFU 34.1% | data wait 0.3% | grad norm 1.82 | dropped 0`` (+ `` | eval ...`` when an
    evaluation ran). ``MFU`` when the report has one (``mfu``, a share: GPUs of a known peak, rayvl.train.flops).
    ``rate``: seconds per step measured so far in this invocation (None before the second report)."""
    step = int(row["step"])
    eta = f", ETA {duration(rate * (total - step))}" if rate is not None else ""
    parts = [f"step {step}/{total} ({100 * step / total:.0f}%)", f"{duration(row['time'] - started)}{eta}",
             f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}", f"scale {row['logit_scale']:.1f}"
             + (f", bias {row['logit_bias']:.2f}" if row.get("logit_bias") is not None else ""),  # SigLIP's b
             f"{row['samples_per_s']:.1f} samples/s ({row['samples_per_s'] / workers:.1f}/worker)"]
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    parts.append(f"data wait {100 * row['data_wait_share']:.1f}%")
    if row.get("grad_norm") is not None:
        parts.append(f"grad norm {row['grad_norm']:.3g}")
    parts.append(f"dropped {row.get('samples_seen', 0) - row.get('samples_kept', 0)}")
    parts += [fmt.format(row[key]) for key, fmt in plugins.progress_fields() if key in row]  # the methods' fields
    shown = [f"{k} {row[k]:.1f}" for k in EVAL_SHOWN if k in row]
    if shown or any(k.startswith(METRIC_PREFIXES) for k in row):
        parts.append("eval " + ", ".join(shown))
    return " | ".join(parts)


class ProgressPrinter(threading.Thread):
    """Follows ``metrics.jsonl`` from its current end and logs a progress line per new report."""

    def __init__(self, metrics_file: Path, total: int, workers: int, poll_s: float = 0.5):
        super().__init__(daemon=True, name="rayvl-progress")
        self.path, self.total, self.workers, self.poll_s = Path(metrics_file), total, workers, poll_s
        self.offset = self.path.stat().st_size if self.path.exists() else 0  # a resumed run's earlier rows
        self.started = time.time()
        self.first: tuple[float, int] | None = None  # (time, step) of the first report since the last (re)start
        self.last = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.drain()
            self.done.wait(self.poll_s)
        self.drain()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)

    def drain(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line being written is read on the next poll
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            self.show(json.loads(line))

    def show(self, row: dict) -> None:
        if self.first is None or row["step"] <= self.last:  # the first report, or a restart from a checkpoint
            self.first = (row["time"], row["step"])
        self.last = row["step"]
        rate = (row["time"] - self.first[0]) / (row["step"] - self.first[1]) if row["step"] > self.first[1] else None
        if row.get("resumed_from") is not None:
            log.info(f"resumed from the checkpoint of step {row['resumed_from']}")
        if (first := startup.summary(row)) is not None:
            log.info(first)
        log.info(progress_line(row, self.total, self.started, rate, self.workers))
