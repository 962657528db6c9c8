"""Data read on this machine without Ray: a ``torch`` DataLoader whose worker processes read and decode while the
main process runs the model — what `rayvl eval` does on one machine, where starting a Ray (its raylet, its
workers, Ray Data's read-task processes) costs more than the whole evaluation of a held-out split.

Shards are read by the same code as Ray Data's read tasks (``shard_read.raw_batches``, ``pipeline.preprocess``):
the same samples are kept, dropped and counted. The counts of each batch travel with it to the main process
(``Batches.counts``); a shard that ends early is noted as the read tasks note it (``Batches.bad_shards``).

The loader's workers split the work by shard while there are at least as many shards as workers; with fewer
shards, all of them files on this machine, the readers of one shard each parse all of it (reading a local tar is
cheap) and decode every n-th batch: a held-out split of 3 shards on a 16-CPU machine decodes on 15 cores, not 3.
Shards on object storage or behind ``pipe:`` are read once each (a split would fetch them once per reader), by
workers started from a fresh forkserver process: a process that has used an object store's client is not forked.
A batch's images leave a worker in shared memory (``SHARED_BYTES``), not pickled through its pipe, where the shared
memory has room (``shared_bytes_here``).
"""
from __future__ import annotations

import os
import shutil
from collections import Counter
from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from rayvl import storage
from rayvl.data.pipeline import Rows, preprocess_columns, row_bytes
from rayvl.data.position import row_ids
from rayvl.data.shard_read import Reading, raw_batches, transformed_ahead
from rayvl.spec_syntax import is_pipe
from rayvl.data.tar import COLUMNS
from rayvl.errors import DataPlaneError

COUNTS, BAD_SHARD, ERROR = "_counts", "_bad_shard", "_error"  # what a worker sends beside a batch's columns
IN_FLIGHT_BYTES = 512 << 20  # decoded batches the workers may hold ready: what a read holds, however large its set
# a column at least this large crosses from a loader worker as a torch tensor, in shared memory; a numpy array is
# pickled through the worker's pipe and unpickled by the main process — at 224 px, 19 MB a batch of 128 images, tens
# of ms of the main process's time a batch (benchmarks/local_read_host.py). Smaller columns (keys, labels, row ids)
# stay numpy: every shared tensor the main process keeps holds a file descriptor, and it keeps those to the end.
SHARED_BYTES = 1 << 20
SHM = "/dev/shm"  # where those tensors live (torch's sharing strategies on Linux); a container's may be 64 MB
NEVER_SHARED = 1 << 62  # a threshold no column reaches: every column pickled through the workers' pipes


def shared_bytes_here(wanted: int = SHARED_BYTES, shm: str = SHM) -> int:
    """``wanted``, or — where the shared memory cannot hold the batches in flight twice over (a container's default
    64 MB: a worker writing a tensor there would die of SIGBUS) — a threshold no column reaches: every column pickled
    through the workers' pipes, as before."""
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        free = 0
    return wanted if free >= 2 * IN_FLIGHT_BYTES else NEVER_SHARED


def this_machines_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or a job's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def loader_workers(given: int = 0) -> int:
    """``given``, or when 0: this machine's CPUs less the one the main process runs the model on (at least 1)."""
    return given or max(1, this_machines_cpus() - 1)


def share(n_shards: int, worker: int, workers: int, split: bool = True) -> list[tuple[int, int, int]]:
    """(shard, part, parts) a loader worker reads: whole shards (part 0 of 1) while there are at least as many
    shards as workers or shards may not be ``split``, else one shard, of which it decodes every ``parts``-th batch
    from its ``part``-th — the workers of a shard are ``shard``, ``shard + n_shards``, …"""
    if n_shards >= workers or not split:
        return [(s, 0, 1) for s in range(worker, n_shards, workers)]
    shard = worker % n_shards
    return [(shard, worker // n_shards, len(range(shard, workers, n_shards)))]


def on_this_machine(paths: list[str]) -> bool:
    """Whether every shard is a file here (not on object storage, not a ``pipe:`` command)."""
    return not any(storage.is_url(p) or is_pipe(p) for p in paths)


class ShardBatches(IterableDataset):
    """``transform(raw batch, counts) -> dict of columns`` of each batch of ``reading.batch_size`` samples of
    img2dataset shards (the raw ``columns`` of each sample, with the row ids and pass ``pipeline.preprocess``
    reads), each loader worker reading its ``share``; every output carries its batch's counts. An I/O failure that
    ``reading.io`` does not skip ends the read with a DataPlaneError in the main process (``Batches``)."""

    def __init__(self, paths: list[str], reading: Reading, transform: Callable[[dict, Counter], dict],
                 columns: tuple[str, ...] = COLUMNS):
        self.paths, self.reading, self.transform, self.columns = list(paths), reading, transform, tuple(columns)

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        try:
            for shard, part, parts in share(len(self.paths), worker, workers, on_this_machine(self.paths)):
                yield from self._shard(shard, part, parts)
        except DataPlaneError as e:  # a worker's exception reaches the main process as a traceback's text
            yield {ERROR: str(e)}

    def _shard(self, shard: int, part: int, parts: int) -> Iterator[dict]:
        path, bad, io_counts = self.paths[shard], [], Counter()

        def transform(first: int, samples: list[dict]) -> dict:
            counts: Counter = Counter()
            batch = {c: [s.get(c) for s in samples] for c in self.columns}
            out = self.transform({**batch, "row": row_ids(0, shard, first, len(samples)), "cycle": 0}, counts)
            return {**out, COUNTS: dict(counts)}

        raw = raw_batches(path, self.reading, self.columns, bad, io_counts)
        mine = (batch for i, batch in enumerate(raw) if i % parts == part)
        yield from transformed_ahead(mine, transform, self.reading.threads)
        # a shard that ended early is counted once however many of its readers met the end (Batches); each reader's
        # I/O retries were its own
        yield {COUNTS: dict(io_counts), **({BAD_SHARD: bad[0]} if bad else {})}


class ListBatches(IterableDataset):
    """``fn`` of each batch of ``batch_size`` rows of ``columns`` (a dict of equal-length arrays), each loader
    worker making every n-th batch."""

    def __init__(self, columns: dict[str, np.ndarray], batch_size: int, fn: Callable[[dict], dict]):
        self.columns, self.batch_size, self.fn = columns, batch_size, fn

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        n = len(next(iter(self.columns.values())))
        for first in range(worker * self.batch_size, n, workers * self.batch_size):
            yield self.fn({k: v[first:first + self.batch_size] for k, v in self.columns.items()})


def _shared(item: dict, at: int = SHARED_BYTES) -> dict:
    """A batch as a loader worker hands it over: its numeric columns of at least ``at`` bytes as tensors."""
    return {k: torch.from_numpy(np.ascontiguousarray(v)) if _large_numeric(v, at) else v for k, v in item.items()}


def _large_numeric(v, at: int) -> bool:
    # native byte order and at most 8 bytes an item: what torch.from_numpy takes
    return (isinstance(v, np.ndarray) and v.nbytes >= at and v.dtype.kind in "biuf" and v.dtype.isnative
            and v.dtype.itemsize <= 8)


def _as_numpy(item: dict) -> dict:
    """A batch as the main process uses it: every column numpy (a shared tensor's view, no copy)."""
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in item.items()}


class Batches:
    """The batches a ``dataset`` (``ShardBatches``, ``ListBatches``) yields, read by ``workers`` loader processes
    (started as iteration starts, before the first batch is asked for) about ``IN_FLIGHT_BYTES`` ahead of the caller
    (``batch_bytes`` a batch; at least one batch a worker, besides the one each is making): each batch's columns,
    its counts added to ``counts`` as it arrives, a shard that ended early in ``bad_shards`` and counted once
    (``truncated_shards``, ``unreadable_shards``) whichever of its readers met the end. ``fresh``: the workers start
    from a fresh forkserver process instead of a fork of this one. ``shared_bytes``: the numeric columns of at least
    that many bytes cross from the workers in shared memory (None: ``shared_bytes_here()``)."""

    def __init__(self, dataset: IterableDataset, workers: int, batch_bytes: int, fresh: bool = False,
                 shared_bytes: int | None = None):
        self.dataset, self.workers, self.fresh = dataset, workers, fresh
        self.shared_bytes = shared_bytes_here() if shared_bytes is None else shared_bytes
        self.ahead = max(1, IN_FLIGHT_BYTES // max(1, batch_bytes * workers))
        self.counts: Counter = Counter()
        self.bad_shards: dict[str, str] = {}

    def __iter__(self) -> Iterator[dict]:
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.workers,
                            collate_fn=partial(_shared, at=self.shared_bytes), prefetch_factor=self.ahead,
                            multiprocessing_context="forkserver" if self.fresh else None)
        return self._arriving(iter(loader))  # iter() starts the workers now

    def _arriving(self, loaded: Iterator[dict]) -> Iterator[dict]:
        for item in map(_as_numpy, loaded):
            if ERROR in item:
                raise DataPlaneError(item[ERROR])
            self.counts.update(item.pop(COUNTS, {}))
            if BAD_SHARD in item:
                path, reason, why = item.pop(BAD_SHARD)
                if path not in self.bad_shards:
                    self.bad_shards[path] = why
                    self.counts[reason] += 1
            if item:
                yield item


def shard_batches(paths: list[str], rows: Rows, reading: Reading, columns: list[str], workers: int = 0) -> Batches:
    """``columns`` of the model inputs of ``paths``' samples in batches of ``reading.batch_size``, read by
    ``loader_workers(workers)`` processes."""
    workers = loader_workers(workers)
    dataset = ShardBatches(paths, reading, partial(preprocess_columns, rows=rows, columns=list(columns)))
    return Batches(dataset, workers, reading.batch_size * row_bytes(rows), not on_this_machine(paths))


def sum_over_shards(paths: list[str], columns: tuple[str, ...], fn, fn_kwargs: dict, key: str, value: str,
                    reading: Reading = Reading(), workers: int = 0) -> dict:
    """``rayvl.data.shards.sum_over_shards`` without Ray: corpus statistics as sums over ``paths``, only
    ``columns`` read, ``fn`` turning each batch into its partial sums (rows of ``key`` and ``value``) in the loader's
    workers, this process adding them up as they arrive. {key: sum}."""
    reading = Reading(io=reading.io)  # one pass, raw batches, counted nowhere
    total: Counter = Counter()
    dataset = ShardBatches(paths, reading, partial(_partial_sums, fn=fn, fn_kwargs=fn_kwargs), columns)
    for batch in Batches(dataset, loader_workers(workers), reading.batch_size * 1024, not on_this_machine(paths)):
        total.update(dict(zip(batch[key].tolist(), batch[value].tolist())))
    return dict(total)


def _partial_sums(batch: dict, counts: Counter, fn, fn_kwargs: dict) -> dict:
    return fn(batch, **fn_kwargs)
