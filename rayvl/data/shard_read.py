"""One shard read into batches, with or without Ray: Ray Data's read tasks (``shards.ShardStream``) and a local
``torch`` DataLoader (``rayvl.eval.local_read``) both read a shard here, so a sample is parsed, dropped or counted
the same way on either side.

A damaged shard (truncated, bad header) stops at its last complete sample and is noted as ``truncated_shards``;
one that I/O cannot read (shard_io.py) fails the read, or under ``data.unreadable_shards=skip`` is noted as
``unreadable_shards`` — the caller counts what is noted.
"""
from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from rayvl.data.shard_io import ReadPolicy, ShardIOError, open_shard
from rayvl.data.tar import DAMAGED, iter_tar_samples

if TYPE_CHECKING:
    from rayvl.config import RayvlConfig

RAW_ROWS_PER_BLOCK = 256


@dataclass(frozen=True)
class Reading:
    """How a shard stream is read (what its rows become is ``pipeline.Rows``)."""

    read_cpus: float = 0.5
    """CPUs each read task reserves (data.read_cpus)."""
    batch_size: int = RAW_ROWS_PER_BLOCK
    """rows a read task transforms in one call, and the rows of each block it emits (data.transform_batch_size)."""
    threads: int = 1
    """batches a read task transforms side by side (data.read_threads, ``ShardStream._transformed_ahead``)."""
    io: ReadPolicy = ReadPolicy()
    """how I/O errors are met (shard_io.py)."""
    shuffle: bool = False
    """each pass reads the shards in its own order, drawn from (``seed``, pass) (data.shuffle_files)."""
    seed: int = 0
    """seed of the shard orders (train.seed)."""
    passes: int = 1
    """passes over the shards one Ray Data execution lists."""
    positioned: bool = False
    """the run's training stream: counted per shard in its report and resumed from the data position the report
    holds (data/position.py); other streams (held-out, image-label) are counted as a whole."""
    report_name: str | None = None
    """the data report the stream's counts go to (rayvl.data.report; None = not counted)."""
    readers_per_shard: int = 1
    """read tasks of each shard, each transforming every n-th batch of it (``readers_per_shard``): a held-out set of
    fewer shards than its CPUs decodes on all of them. One pass, not positioned, shards that are files only."""

    @classmethod
    def of(cls, cfg: RayvlConfig, report_name: str | None, **changes) -> Reading:
        """How ``cfg``'s data settings read a stream counted in ``report_name``; ``changes``: fields set otherwise."""
        d = cfg.data
        return replace(cls(read_cpus=d.read_cpus, batch_size=d.transform_batch_size, threads=d.read_threads,
                           io=ReadPolicy.of(d), shuffle=d.shuffle_files, seed=cfg.train.seed,
                           report_name=report_name), **changes)



MAX_READERS_PER_SHARD = 8  # each reader parses the whole tar (it decodes only its batches): a bounded repeat


def readers_per_shard(paths: list[str], read_cpus: float, cpus: float) -> int:
    """Read tasks of each of ``paths`` for one pass over them on ``cpus`` CPUs: as many as fill the CPUs with
    tasks of ``read_cpus`` where there are fewer shards than that (at most MAX_READERS_PER_SHARD), every shard a
    file — reading a file again costs a page-cache read; a shard on object storage or behind ``pipe:`` would be
    fetched once per reader —, else 1."""
    from rayvl import storage
    from rayvl.spec_syntax import is_pipe

    if not paths or any(storage.is_url(p) or is_pipe(p) for p in paths) or read_cpus <= 0:
        return 1
    return max(1, min(MAX_READERS_PER_SHARD, int(cpus / read_cpus + 1e-9) // len(paths)))


def raw_batches(path: str, reading: Reading, columns: tuple[str, ...], bad: list,
                io_counts: Counter) -> Iterator[tuple[int, list[dict]]]:
    """(index of the first row in the shard, rows of ``columns``) batches of ``reading.batch_size``; I/O retries
    counted in ``io_counts``, a shard that ends early noted in ``bad`` as (path, reason counted, why)."""
    rows: list[dict] = []
    read = 0
    try:
        with open_shard(path, reading.io, io_counts) as f:
            for sample in iter_tar_samples(f, columns):
                rows.append(sample)
                if len(rows) == reading.batch_size:
                    yield read, rows
                    read += len(rows)
                    rows = []
    except ShardIOError as e:
        # not the data's fault (shard_io.py): the read fails naming the shard, unless the user chose to skip
        if reading.io.unreadable == "fail":
            raise
        bad.append((path, "unreadable_shards", f"{e.reason}: {e.detail} after {read + len(rows)} samples"))
    except DAMAGED as e:
        # A damaged shard costs only its own bad tail (at most the one sample being read when it broke).
        bad.append((path, "truncated_shards", f"{type(e).__name__}: {e} after {read + len(rows)} samples"))
    if rows:
        yield read, rows


def transformed_ahead(raw: Iterable[tuple[int, list[dict]]], transform: Callable, threads: int) -> Iterator:
    """``transform(first, rows)`` of each raw batch, in order, up to ``threads`` batches transformed side by side
    while the one before is handed on. JPEG decode, resize and the Rust tokenizer release the GIL, so one reader
    keeps more than its one core busy and covers what Ray leaves idle around its tasks (the second task's late
    start, the gap between one task's end and the next one's start, the last task of a run); the measurement is in
    docs/benchmarks.md, "Data plane"."""
    if threads <= 1:
        yield from (transform(first, rows) for first, rows in raw)
        return
    pool, ahead = _pool(threads), deque()
    for first, rows in raw:
        ahead.append(pool.submit(transform, first, rows))
        if len(ahead) > threads:
            yield ahead.popleft().result()
    while ahead:
        yield ahead.popleft().result()


@lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    """The readers' transform threads, one pool per process (Ray reuses it for task after task)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="rayvl-transform")
