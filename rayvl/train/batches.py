"""Endless per-worker batches from a Ray Data shard, with the time spent waiting and starvation detection.

Ray Data inside Ray Train can starve silently (operators stay "pending" when workers hold every CPU). A producer
thread iterates the shard epoch after epoch; the training thread waits at most ``data.stall_timeout_s`` for a
batch and then fails with an error that says what to change, instead of hanging. On a GPU the batches arrive on
the worker's own device (rayvl.train.devices), copied from pinned host memory without blocking.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Iterator

import torch

from rayvl.config import RayvlConfig
from rayvl.data.report import DataPlaneError
from rayvl.data.seeding import shuffle_seed
from rayvl.data.tonics import BucketSampler, SamplerTotals
from rayvl.train import devices

TRAIN_COLUMNS = ["image", "input_ids", "attention_mask", "label"]
ROW = "row"  # the row id of the data position (data/position.py); training shards carry it, image-label data not
_END = object()


CPU = torch.device("cpu")


def batch_stream(shard, cfg: RayvlConfig, size: int | None = None, begin=None, rank: int = 0,
                 stream: int = 0, device: torch.device = CPU) -> Iterator[tuple[dict, float]]:
    """(micro-batch of torch tensors on ``device``, seconds waited for it), endlessly. ``begin(n)`` is called
    before the n-th further execution of the dataset (``_epochs``); the shuffle buffer is seeded per (rank,
    ``stream``, execution). ``device`` carries its index: Ray Data moves batches in threads of its own, where a
    bare "cuda" would mean GPU 0."""
    t = cfg.train
    seeds = _shuffle_seeds(cfg, rank, stream)

    def batches():
        for batch in _epochs(lambda: shard.iter_torch_batches(
                batch_size=t.micro_batch_size if size is None else size, drop_last=True,
                prefetch_batches=cfg.data.prefetch_batches, local_shuffle_seed=next(seeds),
                local_shuffle_buffer_size=cfg.data.local_shuffle_buffer or None, device=device,
                pin_memory=device.type == "cuda"), begin):
            yield {k: batch[k] for k in TRAIN_COLUMNS + [ROW] if k in batch}

    return _prefetched(batches, cfg, device)


def mixed_stream(text_shard, label_shard, cfg: RayvlConfig, begin=None, rank: int = 0,
                 device: torch.device = CPU) -> Iterator[tuple[dict, float]]:
    """UniCL's balanced sampling ([UniCL] App. B.2): every micro-batch takes round(weight × size) rows from
    the image-label stream and the rest from the image-text stream — an exact ratio per batch; each stream is its
    own Ray Data pipeline and runs through its epochs at its own pace (the smaller set repeats more often)."""
    n_label = label_rows(cfg)
    labels = batch_stream(label_shard, cfg, n_label, rank=rank, stream=1, device=device)  # both start now
    texts = batch_stream(text_shard, cfg, cfg.train.micro_batch_size - n_label, begin, rank=rank, device=device)
    return _mixed(labels, texts)


def _shuffle_seeds(cfg: RayvlConfig, rank: int, stream: int = 0) -> Iterator[int]:
    """The local shuffle seed of each next execution of one of this rank's streams: ``_epochs`` calls its iterator
    factory once per execution, which takes the next one."""
    return (shuffle_seed(cfg.train.seed, rank, execution, stream) for execution in itertools.count())


def label_rows(cfg: RayvlConfig) -> int:
    """Image-label rows in each micro-batch of a mixed run ([UniCL] App. B.2); 0 without image-label data."""
    return round(cfg.train.micro_batch_size * cfg.image_label.weight) if cfg.image_label.data else 0


def _mixed(labels, texts) -> Iterator[tuple[dict, float]]:
    while True:
        (a, wait_a), (b, wait_b) = next(labels), next(texts)
        batch = {k: torch.cat([a[k], b[k]]) for k in TRAIN_COLUMNS}
        if ROW in b:  # image-label rows are not position-tracked (row −1)
            batch[ROW] = torch.cat([torch.full_like(a["label"], -1), b[ROW]])
        yield batch, wait_a + wait_b


class TonicsBatches:
    """TOnICS micro-batches (rayvl.data.tonics.BucketSampler) over this rank's stream of rows with an "object"
    column, as torch tensors, with the time spent waiting for the stream."""

    def __init__(self, shard, cfg: RayvlConfig, rank: int, begin=None, device: torch.device = CPU):
        t, x = cfg.train, cfg.tonics
        self.device = device
        self.waited = 0.0
        self.totals = SamplerTotals()  # the counts of self.sampler, over ranks and resumes (a train-state part)
        seeds = _shuffle_seeds(cfg, rank)
        rows = _prefetched(lambda: _epochs(lambda: shard.iter_batches(
            batch_size=t.micro_batch_size, batch_format="numpy", prefetch_batches=cfg.data.prefetch_batches,
            local_shuffle_buffer_size=cfg.data.local_shuffle_buffer or None, local_shuffle_seed=next(seeds)),
            begin), cfg, device)
        self.sampler = BucketSampler(self._timed(rows), TRAIN_COLUMNS + ["object", ROW], t.micro_batch_size,
                                     x.buffer_rows, x.max_wait_rows, t.seed, rank)

    def _timed(self, rows):
        for item, waited in rows:
            self.waited += waited
            yield item

    def next(self, node: int, step: int, micro: int) -> tuple[dict, float]:
        before = self.waited
        batch = self.sampler.batch(node, step, micro)
        return {k: to_device(torch.from_numpy(v), self.device) for k, v in batch.items()}, self.waited - before


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: to a GPU through pinned memory and a copy that does not block the host."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _epochs(iterate, begin=None) -> Iterator:
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


def _prefetched(make, cfg: RayvlConfig, device: torch.device = CPU) -> Iterator[tuple[object, float]]:
    """Items of ``make()`` produced by a thread started now, bound to ``device`` — the Ray Data execution starts
    while the caller builds the model and the DeepSpeed engine, instead of at the first step; the consumer waits
    at most data.stall_timeout_s for each item."""
    q: queue.Queue = queue.Queue(maxsize=max(1, cfg.data.prefetch_batches))
    failure: list[BaseException] = []

    def produce():
        try:
            devices.bind(device)  # a new thread's CUDA device is GPU 0, whatever its worker's is
            for item in make():
                q.put(item)
        except BaseException as e:  # handed to the training thread, which raises it
            failure.append(e)
            q.put(_END)

    threading.Thread(target=produce, name="rayvl-batches", daemon=True).start()
    return _consume(q, failure, cfg.data.stall_timeout_s)


def _consume(q: queue.Queue, failure: list, stall_timeout_s: float) -> Iterator[tuple[object, float]]:
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
        yield item, time.perf_counter() - started


class TrainedRows:
    """The row ids (and TOnICS objects) of the micro-batches trained since the last checkpoint, left where they
    are until the data position needs them: a copy to the host per micro-step would wait for the GPU each time."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def add(self, batch: dict) -> None:
        if ROW in batch:
            self.parts.append(tuple(batch[k] for k in (ROW, "object") if k in batch))

    def flush(self, position) -> None:
        """Hand every row since the last flush to ``position`` (rayvl.data.position.DataPosition.trained)."""
        if self.parts:
            position.trained(*(torch.cat(column).cpu().numpy() for column in zip(*self.parts)))
        self.parts = []
