"""Streaming read of img2dataset shards with Ray Data: one read task per group of shards parses the tars and turns
the samples into model inputs, every pass of a run in one Ray Data execution.

Why not ``ray.data.read_webdataset``: with its decoder it fails the whole dataset on one undecodable JPEG, and a
shard truncated mid-member fails the read (both seen on these machines; LAION shards contain both). Here a damaged
shard stops at its last complete sample and is named in the run's data report; bad samples are dropped and counted
in ``pipeline.preprocess``.

Why one operator: as separate Ray Data operators, read → map_batches(preprocess) → select_columns ran as three
task pools (Ray does not fuse a read, scheduled SPREAD, with a map, nor a map of 0.5 CPU with the 1-CPU ``Project``
that select_columns adds). Every row then crossed the object store three times, and on a node with less than one
free CPU the Project operator was never scheduled. ``benchmarks/data_pipeline.py`` measures the difference.

Why several passes in one execution: Ray Train splits a dataset per epoch, and each new epoch started a new
execution — its first batches came seconds later, a stall at every epoch boundary. A run's dataset lists the read
tasks of every pass it will need (each pass its own shard order, drawn from the seed and the pass number), so the
next pass's shards are read while the current one ends.
"""
from __future__ import annotations

import json
import os
import tarfile
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import ray
from ray.data.block import BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from rayvl import storage
from rayvl.data.mix import Mix
from rayvl.data.pipeline import Rows, preprocess_columns, row_bytes  # row_bytes: imported from here too
from rayvl.data.position import row_ids
from rayvl.data.report import current_token, record, record_async, report_actor
from rayvl.data.shard_read import Reading, raw_batches, transformed_ahead  # Reading: imported from here too
from rayvl.data.specs import resolve_shards
from rayvl.data.tar import COLUMNS, member_key
from rayvl.spec_syntax import is_pipe

MAX_TASKS_PER_PASS = 200  # Ray Data's default read parallelism; LAION's 41k shards → ≈200 shards a task


class ShardStream(Datasource):
    """Samples of img2dataset / webdataset tar shards over ``reading.passes`` passes, as raw ``columns`` (bytes)
    or, with ``transform``, as its output: ``transform(raw batch, counts) -> dict of arrays`` on batches of
    ``reading.batch_size``. ``mix``: how often a pass reads each ``::`` source's shards (data/mix.py; None = each
    once): a pass is its slots, each a shard."""

    def __init__(self, paths: list[str], reading: Reading = Reading(), *, columns: tuple[str, ...] = COLUMNS,
                 transform: Callable | None = None, mix: Mix | None = None):
        super().__init__()
        self.paths, self.reading, self.columns, self.transform = list(paths), reading, tuple(columns), transform
        self.mix = mix or Mix.of((len(self.paths),))
        if sum(self.mix.sizes) != len(self.paths):
            raise ValueError(f"a mix of {sum(self.mix.sizes)} shards over {len(self.paths)}")
        self.slots = self.mix.n_slots
        self.report_name = reading.report_name
        self.positioned = reading.positioned and reading.report_name is not None
        self.parts = reading.readers_per_shard  # read tasks a shard, each transforming every parts-th batch
        if self.parts > 1 and (reading.passes > 1 or reading.positioned or self.mix.upsampled):
            raise ValueError("readers_per_shard > 1 reads one pass of a stream that is not positioned, each shard once")

    def order(self, epoch: int) -> list[int]:
        """Slots of pass ``epoch`` in reading order (without upsampling a slot is its shard): a permutation drawn
        from (seed, epoch) when shuffled."""
        if not self.reading.shuffle:
            return list(range(self.slots))
        return np.random.default_rng([self.reading.seed, epoch]).permutation(self.slots).tolist()

    def shard_of(self, pass_: int, slot: int) -> tuple[str, int]:
        """(the shard slot ``slot`` of pass ``pass_`` reads, its cycle: the pass a row's draws are seeded by)."""
        if not self.mix.upsampled:
            return self.paths[slot], pass_
        shards, cycles = self.mix.table(pass_, self.reading.seed, self.reading.shuffle)
        return self.paths[shards[slot]], int(cycles[slot])

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    @property
    def num_tasks(self) -> int:
        """Read tasks of all passes: each pass in at most MAX_TASKS_PER_PASS groups of consecutive shards — or, with
        ``readers_per_shard``, that many tasks of each shard."""
        if self.parts > 1:
            return self.slots * self.parts
        return self.reading.passes * min(self.slots, MAX_TASKS_PER_PASS)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        # ``parallelism`` is num_tasks (read() asks for it): fewer tasks than Ray's default of 200 would make Ray
        # split every block into tiny ones (SplitBlocks), each paying Ray Data's per-block costs
        if self.parts > 1:
            return [ReadTask(partial(self._read, 0, [shard], part), self._meta([shard], 0),
                             per_task_row_limit=per_task_row_limit)
                    for shard in self.order(0) for part in range(self.parts)]
        groups = min(self.slots, MAX_TASKS_PER_PASS)
        tasks = []
        for epoch in range(self.reading.passes):
            order = self.order(epoch)
            for g in range(groups):
                part = order[g * len(order) // groups:(g + 1) * len(order) // groups]
                tasks.append(ReadTask(partial(self._read, epoch, part), self._meta(part, epoch),
                                      per_task_row_limit=per_task_row_limit))
        return tasks

    def _meta(self, shards: list[int], epoch: int) -> BlockMetadata:
        return BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None,
                             input_files=[self.shard_of(epoch, i)[0] for i in shards])

    def _read(self, listed_pass: int, shards: list[int], part: int = 0) -> Iterator[pa.Table]:
        # the run's data position (data/position.py): finished shards are skipped unopened, rows of a shard
        # trained on before a restore are dropped after decoding
        token, pass_, skip, trained = ray.get(report_actor(self.report_name).read_task.remote(
            listed_pass, self.reading.passes, shards)) if self.positioned else (
            current_token(self.report_name), listed_pass, set(), {})
        for shard in shards:
            if shard not in skip:
                # a positioned stream counts per (pass, shard) read attempt (DataReport.add)
                unit = (token, uuid.uuid4().hex, pass_, shard) if self.positioned else None
                yield from self._read_shard(shard, pass_, unit, trained.get(shard), token, part)

    def _read_shard(self, shard: int, pass_: int, unit: tuple | None, trained: set | None,
                    token: str | None, part: int = 0) -> Iterator[pa.Table]:
        counts: Counter = Counter()
        io_counts: Counter = Counter()  # retries, counted by the reader as they happen
        bad: list[tuple[str, str, str]] = []  # (path, reason counted, why)
        pending, produced = None, 0
        for out, batch_counts in self._transformed_ahead(shard, pass_, bad, io_counts, part):
            counts.update(batch_counts)
            produced += _length(out)
            if pending is not None:
                # the counts so far go out before a block does: a read held back by the run's read-ahead budget,
                # then stopped with the run, has counted every sample it decoded (its shard's end never comes)
                if self.report_name:
                    record_async(self.report_name, counts + _drain(io_counts), unit and (*unit, None), token)
                    counts = Counter()
                yield pending
            pending = _block(_untrained(out, trained) if trained else out)
        counts.update(_drain(io_counts))
        bad = bad if part == 0 else []  # every reader of a shard meets its early end: the first one counts it
        counts.update(reason for _, reason, _ in bad)
        # the shard's counts (and the rows it produced) are recorded before its last block is emitted (one round
        # trip per shard, not per batch): whoever has consumed a whole pass also sees all of its counts
        if self.report_name:
            record(self.report_name, +counts, (bad[0][0], bad[0][2]) if bad else None,
                   unit=unit and (*unit, produced), token=token)
        if pending is not None:
            yield pending

    def _transformed_ahead(self, shard: int, pass_: int, bad: list, io_counts: Counter,
                           part: int = 0) -> Iterator[tuple[dict | pa.Table, Counter]]:
        """(transformed batch, its counts) in shard order, ``reading.threads`` of them made side by side
        (shard_read.transformed_ahead) — of a shard's ``parts`` readers, reader ``part`` every parts-th batch from
        its part-th —; a damaged or unreadable shard ends early, noted in ``bad``."""
        path, cycle = self.shard_of(pass_, shard)

        def transform(first: int, rows: list[dict]):
            batch_counts: Counter = Counter()
            ids = row_ids(pass_, shard, first, len(rows))
            return self._transformed(rows, ids, batch_counts, cycle), batch_counts

        raw = raw_batches(path, self.reading, self.columns, bad, io_counts)
        mine = (batch for i, batch in enumerate(raw) if i % self.parts == part)
        yield from transformed_ahead(mine, transform, self.reading.threads if self.transform else 1)

    def _transformed(self, rows: list[dict], ids: np.ndarray, counts: Counter, cycle: int) -> dict | pa.Table:
        batch = {c: [r.get(c) for r in rows] for c in self.columns}
        if self.transform is None:
            return pa.table({c: pa.array(v, pa.string() if c in ("key", "img_ext") else pa.binary())
                             for c, v in batch.items()})
        return self.transform({**batch, "row": ids, "cycle": cycle}, counts)


def _drain(counts: Counter) -> Counter:
    out = counts.copy()
    counts.clear()
    return out


def _length(out: dict | pa.Table) -> int:
    return out.num_rows if isinstance(out, pa.Table) else len(next(iter(out.values())))


def _untrained(out: dict, trained: set[tuple[int, int]]) -> dict:
    """The rows of a transform batch not trained on before the restore: (row id, object) pairs, the object −1 for
    a stream whose rows carry none (data/position.py)."""
    objects = out["object"] if "object" in out else np.full(len(out["row"]), -1)
    keep = np.array([(r, o) not in trained for r, o in zip(out["row"].tolist(), objects.tolist())], dtype=bool)
    return {k: v[keep] for k, v in out.items()}


def _block(out: dict | pa.Table):
    if isinstance(out, pa.Table):
        return out
    return BlockAccessor.batch_to_block(out) if _length(out) else None


def outside_placement_group(fn: Callable, *args):
    """``fn(*args)`` — in a CPU-less task outside the caller's placement group when the caller runs in one that
    captures its child tasks. A Tune trial's driver holds {CPU: 0.1} in such a group, where Ray Data's tasks would
    ask that bundle for CPUs it does not hold (a groupby's hash-shuffle tasks were refused there: "Cannot schedule
    _shuffle_map_task with the placement group because the resource request {'CPU': 1.0, ...} cannot fit into any
    bundles")."""
    if ray.util.get_current_placement_group() is None:
        return fn(*args)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    anywhere = PlacementGroupSchedulingStrategy(placement_group=None)
    return ray.get(ray.remote(fn).options(num_cpus=0, scheduling_strategy=anywhere, max_retries=0).remote(*args))


# partial sums this many rows long are folded into the running sums: the driver holds the distinct keys and at most
# one fold's partial rows
FOLD_ROWS = 4_000_000


def sum_over_shards(paths: list[str], columns: tuple[str, ...], fn, fn_kwargs: dict, key: str, value: str,
                    reading: Reading = Reading()) -> dict:
    """Corpus statistics as sums over resolved shard ``paths``: only ``columns`` are read (with ``reading``'s CPUs
    and I/O policy), ``fn`` turns each batch into its partial sums (rows of ``key`` and ``value``; a key may come
    again in later rows) in Ray Data's tasks, and this process adds the partials up as they stream in (pyarrow's
    ``group_by``, folded every FOLD_ROWS rows: memory bounded by the distinct keys, not by the corpus; the partial
    rows all pass through this one process, where a groupby spread them over its partitions). {key: sum}.

    Not a Ray Data ``groupby``: its hash shuffle starts aggregator actors, processes of their own that cost more
    than the sums of a few shards, and that held their CPUs into the next execution (docs/benchmarks.md). Runs
    outside the caller's placement group (``outside_placement_group``: a Tune trial's driver holds {CPU: 0.1} in a
    group that captures its child tasks)."""
    reading = Reading(read_cpus=reading.read_cpus, io=reading.io)  # one pass, raw batches, counted nowhere
    return outside_placement_group(_summed, paths, columns, fn, fn_kwargs, key, value, reading)


def _summed(paths, columns, fn, fn_kwargs, key: str, value: str, reading: Reading) -> dict:
    partials = read(ShardStream(paths, reading, columns=columns)).map_batches(
        fn, batch_format="numpy", num_cpus=reading.read_cpus, fn_kwargs=fn_kwargs)
    total, pending, rows = None, [], 0

    def fold() -> pa.Table:
        tables = ([total] if total is not None else []) + pending
        return pa.concat_tables(tables).group_by(key).aggregate([(value, "sum")]).rename_columns([key, value])

    for batch in partials.iter_batches(batch_size=None, batch_format="pyarrow"):
        if not batch.num_rows:  # an empty batch's columns have no type to concatenate with
            continue
        pending.append(batch.select([key, value]))
        rows += batch.num_rows
        if rows >= FOLD_ROWS:
            total, pending, rows = fold(), [], 0
    if total is None and not pending:
        return {}
    total = fold()
    return dict(zip(total.column(key).to_pylist(), total.column(value).to_pylist()))


# ----------------------------------------------------------------------------- datasets

def read_shards(spec: str | Sequence[str], rows: Rows, reading: Reading,
                columns: list[str] | None = None, mix: Mix | None = None) -> ray.data.Dataset:
    """The streaming Ray Dataset of model inputs for a shard spec (or the shards it resolved to): the shards read as
    ``reading`` says (a pass as ``mix`` upsamples its sources; None = each shard once), each row made what ``rows``
    says, only ``columns`` of the model inputs kept (all of them when None)."""
    source = ShardStream(resolve_shards(spec), reading, transform=partial(preprocess_columns, rows=rows, columns=columns),
                         mix=mix)
    ds = read(source)
    # Ray merges a task's output into blocks of up to 128 MiB: a 1,000-sample shard at 64 px became one block, so the
    # first batch waited for a whole shard. One transform batch of uint8 images + tokens per block reaches the
    # trainer as soon as it is made.
    ds.context.target_max_block_size = reading.batch_size * row_bytes(rows)
    return ds


def read(source: ShardStream) -> ray.data.Dataset:
    return ray.data.read_datasource(source, num_cpus=source.reading.read_cpus, override_num_blocks=source.num_tasks)


def passes_needed(samples_needed: int, samples_per_pass: int | None, n_shards: int) -> int:
    """Passes a run's dataset lists: enough for its steps plus 5% for dropped samples when img2dataset's files give
    the pass size, else as many as ≈2,000 read tasks hold. A listed pass that is never read costs nothing (the
    training stream's read-ahead is bounded by the rows the run takes: train/datasets.py read_ahead_bytes); a run
    that needs more than the listed passes starts a new execution (train/batches.py), one stall."""
    if samples_per_pass:
        return max(1, -(-samples_needed * 21 // (20 * samples_per_pass)))
    return max(2, 2000 // max(1, n_shards))


def expected_samples(spec: str) -> int | None:
    """Successful samples a pass holds according to img2dataset's files, or None if absent (pass_size)."""
    return pass_size(resolve_shards(spec))[0]


STATS_SAMPLE = 64  # remote shards whose stats file is read; the pass size is extrapolated from them


def samples_per_pass(given: int, paths: list[str], mix: Mix | None = None) -> tuple[int | None, str]:
    """(samples a pass of ``paths`` holds, how that was found): ``given`` (data.samples_per_pass) when set, else
    pass_size (img2dataset's files), else open_clip's sizes.json beside them; shards with none of them (all local or
    all on object storage), an estimate from the first shard. With a ``mix`` that upsamples, each source's count ×
    its reads a pass ÷ its shards. Without a size a run lists ≈2,000 read tasks' worth of passes, and a run longer
    than a pass cannot say how many passes it trains (rayvl data check, the dry run)."""
    if given:
        return given, "data.samples_per_pass"
    if mix is not None and mix.upsampled:
        return _upsampled_pass(paths, mix)
    found, how = pass_size(paths)
    if found is None:  # no img2dataset files: open_clip's sizes.json, where one names the shards
        sized, said = open_clip_sizes(paths)
        found, how = (sized, said) if sized is not None else (found, how)
    remote = bool(paths) and all(storage.is_url(p) for p in paths)
    local = bool(paths) and not any(storage.is_url(p) or is_pipe(p) for p in paths)
    if found is not None or not (remote or local):
        return found, how
    first, what = remote_shard_samples(paths[0]) if remote else (shard_samples(paths[0]), "holds")
    n = len(paths)
    return first * n, (f"estimated: the first shard {what} {first:,} samples, × {n:,} shard{'s' if n != 1 else ''}; "
                       f"{how.split(' — ')[0]} — data.samples_per_pass gives it exactly")


SIZES_FILE = "sizes.json"  # open_clip's: {shard file name: samples} beside the shards (get_dataset_size)


def open_clip_sizes(paths: list[str]) -> tuple[int | None, str]:
    """(samples of ``paths`` as the ``sizes.json`` of their folders says — open_clip's own source of a webdataset's
    size —, how), or (None, why not) unless every shard's folder has one naming it: one read a folder, local or on
    object storage."""
    if not paths or any(is_pipe(p) for p in paths):
        return None, "no sizes.json"
    folders: dict[str, list[str]] = {}
    for p in paths:
        folders.setdefault(storage.parent(p), []).append(p.rstrip("/").rsplit("/", 1)[-1])
    total = 0
    for folder, names in folders.items():
        path = storage.join(folder, SIZES_FILE)
        try:
            sizes = json.loads(storage.read_text(path))
            total += sum(int(sizes[name]) for name in names)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):  # absent, not JSON, a shard not in it
            return None, f"no {SIZES_FILE} naming every shard"
    where = f"{len(folders)} folders'" if len(folders) > 1 else "the shards' folder's"
    return total, f"{where} {SIZES_FILE} (open_clip's)"


def _upsampled_pass(paths: list[str], mix: Mix) -> tuple[int | None, str]:
    total, notes, first = 0, [], 0
    for i, (n, m) in enumerate(zip(mix.sizes, mix.slots)):
        found, how = samples_per_pass(0, paths[first:first + n])
        first += n
        if found is None:
            return None, f"source {i + 1} of the mix: {how}"
        total += round(found * m / n)
        notes.append(f"source {i + 1}: {found:,} × {m:,}/{n:,} ({how})")
    return total, "upsampled (data.upsampling_factors) — " + "; ".join(notes)


ESTIMATE_BYTES = 16 << 20  # of a remote shard, read in one request to estimate its samples


def remote_shard_samples(url: str) -> tuple[int, str]:
    """(samples of a shard on object storage, how): counted when it is at most ESTIMATE_BYTES, else its first
    ESTIMATE_BYTES' samples scaled to its size (one lookup and one ranged read, not the whole object)."""
    import io

    size = storage.size(url)  # None: an HTTP server that does not say
    head = storage.read_bytes(url, ESTIMATE_BYTES)
    compressed = url.split("?", 1)[0].endswith((".gz", ".tgz"))
    try:
        # r|*: a .tar.gz shard's head is read through its decompression, as the shard readers read it; its
        # members' offsets are the archive's, not the file's: the head's share of the file scales its count
        keys, complete = _keys(tarfile.open(fileobj=io.BytesIO(head), mode="r|*"),
                               within=float("inf") if compressed else len(head))
    except tarfile.TarError:  # not a tar from its first block: nothing to count
        keys, complete = 0, 0
    if compressed and keys:
        complete = len(head)
    if len(head) < ESTIMATE_BYTES or (size is not None and len(head) >= size) or not complete:
        return keys, "holds"
    if size is None:
        return keys, f"holds at least ({keys:,} in its first {complete / 2**20:.1f} MiB; the server gives no size)"
    return round(keys * size / complete), (f"holds ≈ ({keys:,} in its first {complete / 2**20:.1f} MiB of "
                                           f"{size / 2**20:.1f} MiB)")


def shard_samples(path: str) -> int:
    """Samples (keys) of a local tar shard, dropped ones included, from its member headers alone (an uncompressed
    shard's member data are skipped by seeking); a damaged tail ends the count."""
    try:
        return _keys(tarfile.open(path, "r:*"))[0]
    except (tarfile.TarError, OSError):
        return 0


def _keys(tar: tarfile.TarFile, within: float = float("inf")) -> tuple[int, int]:
    """(sample keys among a tar's members whose data end within ``within`` bytes, where the last of them ends):
    consecutive members of a key are one sample, as img2dataset writes them; a damaged tail ends the count."""
    keys, last, end = 0, None, 0
    try:
        with tar:
            for member in tar:
                if member.offset_data + member.size > within:
                    break
                stem = member_key(member.name)[0]
                if member.isreg() and stem and stem != last:  # no key (macOS's ._ files): no sample
                    keys, last = keys + 1, stem
                end = member.offset_data + member.size
    except (tarfile.TarError, EOFError, OSError):
        pass
    return keys, end


def pass_size(paths: list[str]) -> tuple[int | None, str]:
    """(successful samples a pass holds, how that was found). Local shards: pyarrow's threaded scan of the
    ``status`` column of img2dataset's parquet files on the driver (as a Ray Data job the same count is mostly task
    start-up, not reading). Object storage: the ``successes`` of img2dataset's
    ``<shard>_stats.json`` — of every shard up to STATS_SAMPLE, else of STATS_SAMPLE spread over the list,
    extrapolated (reading 41k files one by one would cost minutes before every run). None when absent."""
    local = [p for p in paths if not storage.is_url(p) and not is_pipe(p)]
    remote = [p for p in paths if storage.is_url(p)]
    if len(local) + len(remote) < len(paths):
        return None, "pipe: shards have no img2dataset files to count — data.samples_per_pass gives the size of a pass"
    total, notes, found = 0, [], []
    # the local shards' img2dataset parquet files; the shards without one (or with one that is not img2dataset's or
    # is damaged) are counted as the counted ones average, as remote shards are: a pass's size sets max_passes' steps
    parquets = [p for p in (s.rsplit(".tar", 1)[0] + ".parquet" for s in local) if os.path.exists(p)]
    counted, theirs, damaged = _successes(parquets) if parquets else (0, 0, [])
    if theirs:
        total += round(counted * len(local) / theirs)
        notes.append(f"counted in the img2dataset parquet files of {theirs} of {len(local)} local shards"
                     + ("" if theirs == len(local) else ", extrapolated"))
    if damaged:
        notes.append(f"{len(damaged)} parquet files beside the shards are unreadable (e.g. {damaged[0]}, as an "
                     f"interrupted img2dataset leaves one): not counted")
    if theirs + len(damaged) < len(parquets):
        notes.append(f"{len(parquets) - theirs - len(damaged)} parquet files beside the shards are not img2dataset's "
                     f"(no status column): not counted")
    if remote:
        n, m = len(remote), min(len(remote), STATS_SAMPLE)  # m spread evenly, the first and the last included
        sample = [remote[i] for i in sorted({round(k * (n - 1) / max(1, m - 1)) for k in range(m)})]
        with ThreadPoolExecutor(16) as pool:
            found = [n for n in pool.map(_stats_successes, sample) if n is not None]
        if found:
            total += round(sum(found) * len(remote) / len(found))
            notes.append(f"from the _stats.json of {len(found)} of {len(remote)} remote shards"
                         + ("" if len(found) == len(remote) else ", extrapolated"))
    if not theirs and not found:
        return None, "; ".join([*notes, "no img2dataset parquet or _stats.json files beside the shards — "
                                "data.samples_per_pass gives the size of a pass"])
    return total, "; ".join(notes)


def _successes(parquets: list[str]) -> tuple[int, int, list[str]]:
    """(successful samples img2dataset's parquet files list, files counted, files unreadable). img2dataset lists
    every URL with its status; other tools' parquet files (DataComp's uid, url, text) have none and list URLs whether
    or not the shard holds them: they count for nothing (a scan of several files would read their missing status as
    null). img2dataset writes a parquet at its final path, so an interrupted job leaves one without its footer."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    def schema(path: str):
        try:
            return pq.read_schema(path)
        except (pa.ArrowException, OSError):
            return None

    with ThreadPoolExecutor(16) as pool:  # a footer read each
        schemas = list(pool.map(schema, parquets))
    damaged = [p for p, s in zip(parquets, schemas) if s is None]
    mine = [p for p, s in zip(parquets, schemas) if s is not None and "status" in s.names]
    if not mine:
        return 0, 0, damaged
    return (pads.dataset(mine, format="parquet").count_rows(filter=pc.field("status") == "success"), len(mine),
            damaged)


def _stats_successes(shard: str) -> int | None:
    import json

    path = shard.rsplit(".tar", 1)[0] + "_stats.json"
    try:
        return int(json.loads(storage.read_text(path))["successes"])
    except (OSError, KeyError, ValueError):
        return None
