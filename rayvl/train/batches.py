"""Endless per-worker batches from a Ray Data shard, with the time spent waiting and starvation detection.

Ray Data inside Ray Train can starve silently (operators stay "pending" when workers hold every CPU). A producer
thread iterates the shard epoch after epoch; the training thread waits at most ``data.stall_timeout_s`` for a
batch and then fails with an error that says what to change, instead of hanging.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

from rayvl.config import RayvlConfig
from rayvl.data.shards import DataPlaneError

TRAIN_COLUMNS = ["image", "input_ids", "attention_mask"]
_END = object()


def batch_stream(shard, cfg: RayvlConfig) -> Iterator[tuple[dict, float]]:
    d, t = cfg.data, cfg.train
    q: queue.Queue = queue.Queue(maxsize=max(1, d.prefetch_batches))
    failure: list[BaseException] = []

    def produce():
        try:
            while True:  # epochs; streaming_split(equal=True) gives every rank the same number of batches
                n = 0
                for batch in shard.iter_torch_batches(
                        batch_size=t.micro_batch_size, drop_last=True, prefetch_batches=d.prefetch_batches,
                        local_shuffle_buffer_size=d.local_shuffle_buffer or None,
                        device="cuda" if t.use_gpu else "cpu"):
                    q.put({k: batch[k] for k in TRAIN_COLUMNS})
                    n += 1
                if n == 0:
                    raise DataPlaneError("an epoch produced no full batch: every sample was dropped or there are "
                                         "fewer samples than train.micro_batch_size × train.num_workers")
        except BaseException as e:  # handed to the training thread, which raises it
            failure.append(e)
            q.put(_END)

    threading.Thread(target=produce, name="rayvl-batches", daemon=True).start()
    while True:
        started = time.perf_counter()
        try:
            item = q.get(timeout=d.stall_timeout_s)
        except queue.Empty:
            raise DataPlaneError(
                f"no batch for {d.stall_timeout_s:.0f} s (data.stall_timeout_s): the Ray Data pipeline is starved "
                f"or stuck. Leave CPUs for it: lower train.cpus_per_worker or data.read_cpus, or add nodes."
            ) from None
        if item is _END:
            raise failure[0]
        yield item, time.perf_counter() - started
