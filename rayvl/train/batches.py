"""Endless per-worker batches from a Ray Data shard, with the time spent waiting and starvation detection.

Ray Data inside Ray Train can starve silently (operators stay "pending" when workers hold every CPU). A producer
thread iterates the shard epoch after epoch; the training thread waits at most ``data.stall_timeout_s`` for a
batch and then fails with an error that says what to change, instead of hanging. On a GPU the batches arrive on
the worker's own device (rayvl.train.devices), copied from pinned host memory on a CUDA stream of the producer's
own, so that the copy overlaps the step (on the device's default stream, where Ray Data's own thread would copy, it
waits for the step's kernels and they for it); the training thread's stream waits for each batch's copy only.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Iterator

import torch

from rayvl.config import RayvlConfig
from rayvl.data.pipeline import TRAIN_COLUMNS
from rayvl.data.report import DataPlaneError
from rayvl.data.seeding import shuffle_seed
from rayvl.train import devices

ROW = "row"  # the row id of the data position (data/position.py); training shards carry it, image-label data not
_END = object()


CPU = torch.device("cpu")


def batch_stream(shard, cfg: RayvlConfig, size: int | None = None, begin=None, rank: int = 0,
                 stream: int = 0, device: torch.device = CPU) -> Iterator[tuple[dict, float]]:
    """(micro-batch of torch tensors on ``device``, seconds waited for it), endlessly. ``begin(n)`` is called
    before the n-th further execution of the dataset (``epochs``); the shuffle buffer is seeded per (rank,
    ``stream``, execution). ``device`` carries its index: the producer thread binds it (a bare "cuda" in a new
    thread would mean GPU 0)."""
    t = cfg.train
    seeds = shuffle_seeds(cfg, rank, stream)

    def batches():
        for batch in epochs(lambda: shard.iter_torch_batches(  # pinned host tensors: the copy is prefetched's
                batch_size=t.micro_batch_size if size is None else size, drop_last=True,
                prefetch_batches=cfg.data.prefetch_batches, local_shuffle_seed=next(seeds),
                local_shuffle_buffer_size=cfg.data.local_shuffle_buffer or None, device=CPU,
                pin_memory=device.type == "cuda"), begin):
            yield {k: batch[k] for k in TRAIN_COLUMNS + [ROW] if k in batch}

    return prefetched(batches, cfg, device, copy=True)


def shuffle_seeds(cfg: RayvlConfig, rank: int, stream: int = 0) -> Iterator[int]:
    """The local shuffle seed of each next execution of one of this rank's streams: ``epochs`` calls its iterator
    factory once per execution, which takes the next one."""
    return (shuffle_seed(cfg.train.seed, rank, execution, stream) for execution in itertools.count())


def epochs(iterate, begin=None) -> Iterator:
    """Execution after execution of a Ray Data iterator (streaming_split(equal=True) gives every rank the same
    count). A training dataset lists every pass its run needs (shards.passes_needed), so a second execution — and
    its start-up stall — happens only when dropped samples made the listed passes too few; ``begin(k)`` tells the
    read tasks of the k-th further execution to number their passes after the listed ones."""
    for execution in itertools.count():
        if execution and begin is not None:
            begin(execution)
        n = 0
        for batch in iterate():
            yield batch
            n += 1
        if n == 0:
            raise DataPlaneError("an epoch produced no full batch: every sample was dropped or there are "
                                 "fewer samples than train.micro_batch_size × train.num_workers")


def prefetched(make, cfg: RayvlConfig, device: torch.device = CPU, copy: bool = False,
               watched: bool = True) -> Iterator[tuple[object, float]]:
    """Items of ``make()`` produced by a thread started now, bound to ``device`` — the Ray Data execution starts
    while the caller builds the model and the DeepSpeed engine, instead of at the first step; the consumer waits
    at most data.stall_timeout_s for each item (``watched``; unwatched where ``make()`` reads a stream that is
    watched itself, and one item may take many of its reads). ``copy``: the items are dicts of host tensors, pinned
    where ``device`` is a GPU, which the producer copies there on a stream of its own (DeviceCopy)."""
    q: queue.Queue = queue.Queue(maxsize=max(1, cfg.data.prefetch_batches))
    failure: list[BaseException] = []
    copies = DeviceCopy(device) if copy else None

    def produce():
        try:
            devices.bind(device)  # a new thread's CUDA device is GPU 0, whatever its worker's is
            for item in make():
                q.put(copies.send(item) if copies else (item, None))
        except BaseException as e:  # handed to the training thread, which raises it
            failure.append(e)
            q.put(_END)

    threading.Thread(target=produce, name="rayvl-batches", daemon=True).start()
    return _consume(q, failure, cfg.data.stall_timeout_s if watched else None, copies)


class DeviceCopy:
    """Host-to-GPU copies of batches on a CUDA stream of their own: ``send`` (in the producer thread) queues a
    batch's non-blocking copies there and marks their end with an event; ``receive`` (in the training thread)
    makes the training stream wait for that event — on the GPU, not the host — and tells the caching allocator
    that the training stream uses the tensors (their memory came from the copy stream). On a CPU both pass the
    batch through."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None  # made in the producer thread, on its bound device

    def send(self, batch: dict) -> tuple[dict, object]:
        if self.device.type != "cuda":
            return batch, None
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            return batch, self.stream.record_event()

    def receive(self, batch: dict, copied) -> dict:
        if copied is None:
            return batch
        training = torch.cuda.current_stream(self.device)
        training.wait_event(copied)
        for v in batch.values():
            v.record_stream(training)
        return batch


def _consume(q: queue.Queue, failure: list, stall_timeout_s: float | None,
             copies: DeviceCopy | None = None) -> Iterator[tuple[object, float]]:
    while True:
        started = time.perf_counter()
        try:
            item = q.get(timeout=stall_timeout_s)
        except queue.Empty:
            raise DataPlaneError(
                f"no batch for {stall_timeout_s:.0f} s (data.stall_timeout_s): the Ray Data pipeline is starved "
                f"or stuck. Leave CPUs for it: lower train.cpus_per_worker or data.read_cpus, or add nodes."
            ) from None
        if item is _END:
            raise failure[0]
        item, copied = item
        yield (copies.receive(item, copied) if copies else item), time.perf_counter() - started
