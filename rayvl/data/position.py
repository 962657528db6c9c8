"""Where a run is in its data: which training rows it has trained on, so that a resumed run (after a lost worker
or a restarted driver) trains on every row of an interrupted pass exactly once.

Granularity: one training row — an image-text sample, or with TOnICS one (sample, aligned class) row ([TOnICS]
App. A.1). Every row carries an int64 id, ``pass << 47 | shard << 20 | row-in-shard`` (``shard`` indexes the
run's sorted shard list), stamped by the read task that produced it. Each rank records the ids it trained on;
at every checkpoint rank 0 gathers them (train/loop.py) into this train-state component:

    complete   passes every shard of which has been trained on
    finished   per pass: shards whose every produced row has been trained on (a shard's row count is known once
               its read task reached its end — the data report records it)
    partial    per (pass, shard) still being read: the (row id, TOnICS object) pairs trained on

Rows travel and are kept as runs of consecutive rows (``RowSet``), not one id per row: a read task emits a shard
in order, in blocks of consecutive rows, and Ray hands out whole blocks, so what a rank trained on between two
checkpoints is a few runs per block it was handed (a dropped sample or a shuffle buffer's edge splits a run). What
that saves at LAION scale, and what it costs, is measured in docs/scale.md.

Rows prefetched, shuffle-buffered or waiting in a TOnICS bucket when the checkpoint was written are not in it:
after a restore they are read again, as Ray Data re-reads them anyway. A resumed read task skips finished shards
without opening them and drops, after decoding, the rows of a partial shard already trained on.

The run's data report continues too: a finished shard's counts are settled into the position, so a resumed run
starts from the counts of every shard it will not read again and re-counts the shards it reads again.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

PASS_SHIFT, SHARD_SHIFT = 47, 20
MAX_PASSES, MAX_SHARDS, MAX_ROWS = 1 << 16, 1 << 27, 1 << 20
UNIT_PASS_SHIFT = PASS_SHIFT - SHARD_SHIFT  # a unit (pass, shard) as one int64 is its rows' ids >> SHARD_SHIFT


def row_ids(pass_: int, shard: int, first: int, n: int) -> np.ndarray:
    """Ids of rows ``first … first+n-1`` of ``shard`` in pass ``pass_``."""
    if first + n > MAX_ROWS or shard >= MAX_SHARDS or pass_ >= MAX_PASSES:
        raise ValueError(f"a row id holds at most {MAX_PASSES} passes, {MAX_SHARDS} shards and {MAX_ROWS} samples "
                         f"a shard (got pass {pass_}, shard {shard}, row {first + n - 1})")
    return (np.int64(pass_) << PASS_SHIFT) | (np.int64(shard) << SHARD_SHIFT) | np.arange(first, first + n)


def unit_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pass, shard) of each id."""
    return ids >> PASS_SHIFT, (ids >> SHARD_SHIFT) & (MAX_SHARDS - 1)


def _unit(pass_: int, shard: int) -> int:
    return pass_ << UNIT_PASS_SHIFT | shard


def _pass_and_shard(unit: int) -> tuple[int, int]:
    return unit >> UNIT_PASS_SHIFT, unit & (MAX_SHARDS - 1)


class RowSet:
    """A set of training rows — (row id, TOnICS object) pairs — as runs of consecutive keys per unit (pass, shard).
    A row's key in its unit is ``(object + 1) << 20 | row-in-shard``: the rows of a shard without a TOnICS object
    (object −1) are consecutive keys, so a block of a read task is one run; a TOnICS row of an aligned noun sits
    among that noun's rows and is mostly a run of its own.

    ``spans``: (k, 3) int64 rows ``[unit, first key, end key)`` sorted by (unit, first key), no two runs of a unit
    overlapping or touching. ``repeats``: rows recorded more than once before they were folded in (they count as
    duplicates; the set keeps one)."""

    __slots__ = ("spans", "repeats")

    def __init__(self, spans: np.ndarray | None = None, repeats: int = 0):
        self.spans = np.zeros((0, 3), np.int64) if spans is None else spans
        self.repeats = repeats

    @classmethod
    def of(cls, rows, objects=None) -> RowSet:
        """The set of ``rows`` (ids, with their TOnICS ``objects``; None: −1 each), repeats counted."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return cls()
        if objects is None or not (np.asarray(objects) != -1).any():
            # without objects a row's (unit, key) order is its id order: one 1-D sort (stable: timsort uses the
            # runs of consecutive ids the blocks bring)
            ids = np.sort(rows, kind="stable")
            units, keys = ids >> SHARD_SHIFT, ids & (MAX_ROWS - 1)
        else:
            units = rows >> SHARD_SHIFT
            keys = ((np.asarray(objects, dtype=np.int64) + 1) << SHARD_SHIFT) | (rows & (MAX_ROWS - 1))
            order = np.lexsort((keys, units))
            units, keys = units[order], keys[order]
        distinct = np.r_[True, (units[1:] != units[:-1]) | (keys[1:] != keys[:-1])]
        repeats = len(keys) - int(distinct.sum())
        units, keys = units[distinct], keys[distinct]
        first = np.flatnonzero(np.r_[True, (units[1:] != units[:-1]) | (keys[1:] != keys[:-1] + 1)])
        last = np.r_[first[1:], len(keys)] - 1
        return cls(np.stack([units[first], keys[first], keys[last] + 1], 1), repeats)

    @classmethod
    def union(cls, sets: Iterable[RowSet]) -> RowSet:
        """One set of all rows of ``sets``; a row in more than one of them (or repeated in one) is a repeat."""
        sets = list(sets)
        spans = np.concatenate([s.spans for s in sets]) if sets else np.zeros((0, 3), np.int64)
        merged = _joined(spans)
        return cls(merged, sum(s.repeats for s in sets) + _length(spans) - _length(merged))

    def __len__(self) -> int:
        return _length(self.spans)

    def per_unit(self) -> tuple[np.ndarray, np.ndarray]:
        """(units, rows in each)."""
        unit = self.spans[:, 0]
        if not len(unit):
            return unit, unit
        first = np.flatnonzero(np.r_[True, unit[1:] != unit[:-1]])
        return unit[first], np.add.reduceat(self.spans[:, 2] - self.spans[:, 1], first)

    def per_pass(self) -> Counter:
        """Rows in each pass."""
        passes = self.spans[:, 0] >> UNIT_PASS_SHIFT
        if not len(passes):
            return Counter()
        first = np.flatnonzero(np.r_[True, passes[1:] != passes[:-1]])
        rows = np.add.reduceat(self.spans[:, 2] - self.spans[:, 1], first)
        return Counter(dict(zip(passes[first].tolist(), rows.tolist())))

    def split(self, units) -> tuple[RowSet, RowSet]:
        """(the rows of ``units``, the others); repeats stay behind."""
        inside = np.isin(self.spans[:, 0], np.asarray(list(units), dtype=np.int64))
        return RowSet(self.spans[inside]), RowSet(self.spans[~inside])

    def only(self, units) -> RowSet:
        """The rows of ``units``: a binary search per unit, however many runs the set holds."""
        unit = self.spans[:, 0]
        wanted = np.unique(np.asarray(list(units), dtype=np.int64))
        first, end = np.searchsorted(unit, wanted, "left"), np.searchsorted(unit, wanted, "right")
        n = end - first
        return RowSet(self.spans[np.repeat(first - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))])

    def pairs(self) -> np.ndarray:
        """Every row as a (row id, object) pair, sorted by unit and key."""
        unit, first, end = self.spans.T
        n = end - first
        keys = np.repeat(first - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        ids = np.repeat(unit, n) << SHARD_SHIFT | (keys & (MAX_ROWS - 1))
        return np.stack([ids, (keys >> SHARD_SHIFT) - 1], 1)


def _length(spans: np.ndarray) -> int:
    return int((spans[:, 2] - spans[:, 1]).sum())


def _joined(spans: np.ndarray) -> np.ndarray:
    """``spans`` sorted, with the runs of a unit that overlap or touch joined into one."""
    if not len(spans):
        return spans
    width, lowest = int(spans[:, 2].max()) + 1, int(spans[:, 0].min())
    # one int64, (unit − lowest) × width + key, orders the runs and keeps every unit's keys below the next unit's,
    # so a single running maximum of run ends finds the joins of every unit at once
    if (int(spans[:, 0].max()) - lowest + 1) * width < 1 << 62:
        # stable: timsort finds the sorted runs the ranks' sets already are
        spans = spans[np.argsort((spans[:, 0] - lowest) * width + spans[:, 1], kind="stable")]
        base = (spans[:, 0] - lowest) * width
    else:  # units far apart (several passes) with large TOnICS keys: number the units present instead
        spans = spans[np.lexsort((spans[:, 1], spans[:, 0]))]
        dense = np.cumsum(np.r_[True, spans[1:, 0] != spans[:-1, 0]]) - 1
        if (int(dense[-1]) + 1) * width >= 1 << 62:
            raise OverflowError(f"{int(dense[-1]) + 1} units of keys up to {width}: object ids too large")
        base = dense * width
    reach = np.maximum.accumulate(base + spans[:, 2])
    starts = np.flatnonzero(np.r_[True, base[1:] + spans[1:, 1] > reach[:-1]])
    return np.stack([spans[starts, 0], spans[starts, 1], np.maximum.reduceat(spans[:, 2], starts)], 1)


class DataPosition:
    """The rows trained on so far (see the module docstring); identical in every rank's checkpoint view, merged
    on rank 0. ``pending`` is this rank's (row id, object) pairs since the last checkpoint; ``partial_rows`` the
    rows trained on of the units still being read."""

    def __init__(self, n_shards: int, mix: tuple = ()):
        self.n_shards = n_shards  # shard reads a pass holds: with upsampling (data/mix.py) a shard may be several
        self.mix = tuple(tuple(m) for m in mix)  # the upsampled sources' (shards, reads a pass); () = none
        self.complete: list[int] = []
        self.finished: dict[int, list[int]] = {}
        self.partial_rows = RowSet()
        self.rows_per_pass: Counter = Counter()  # distinct rows trained on, per pass
        self.duplicates = 0  # rows trained on twice within a pass (a resume that restarted would make them)
        self.execution = 0  # the Ray Data execution a resume reads first (batches.epochs, DataReport.settle)
        self.report: dict = {"counts": {}, "bad_shards": {}}  # the settled data report
        self.pending: list[np.ndarray] = []

    @property
    def partial(self) -> dict[tuple[int, int], int]:
        """Rows trained on of each unit (pass, shard) still being read."""
        units, rows = self.partial_rows.per_unit()
        return {_pass_and_shard(u): n for u, n in zip(units.tolist(), rows.tolist())}

    def trained(self, rows, objects=None) -> None:
        """Record a micro-batch's rows (ids < 0 are image-label rows: not tracked)."""
        rows = np.asarray(rows, dtype=np.int64)
        objects = np.full_like(rows, -1) if objects is None else np.asarray(objects, dtype=np.int64)
        keep = rows >= 0
        self.pending.append(np.stack([rows[keep], objects[keep]], 1))

    def take_pending(self) -> np.ndarray:
        """This rank's rows since the last checkpoint as (row id, object) pairs, repeats included."""
        out = np.concatenate(self.pending) if self.pending else np.zeros((0, 2), np.int64)
        self.pending = []
        return out

    def take_trained(self) -> RowSet:
        """This rank's rows since the last checkpoint as runs: what it sends to rank 0."""
        pairs = self.take_pending()
        return RowSet.of(pairs[:, 0], pairs[:, 1])

    def merge(self, *parts: RowSet | np.ndarray) -> list[tuple[int, int]]:
        """Add every rank's rows since the last checkpoint (RowSets or (row id, object) pair arrays); returns the
        units (pass, shard) still being read that they touched."""
        sets = [p if isinstance(p, RowSet) else RowSet.of(p[:, 0], p[:, 1]) for p in parts]
        spans = np.concatenate([s.spans for s in sets]) if sets else np.zeros((0, 3), np.int64)
        again, touched = self._triage(spans[:, 0])
        # one join of the position's rows and the new ones: what overlaps (across ranks or with the position) is a
        # row trained twice
        both = np.concatenate([self.partial_rows.spans, spans[~again]])
        merged = _joined(both)
        self.duplicates += sum(s.repeats for s in sets) + _length(spans[again]) + _length(both) - _length(merged)
        before = self.partial_rows.per_pass()
        self.partial_rows = RowSet(merged)
        for p, n in self.partial_rows.per_pass().items():
            self.rows_per_pass[p] += n - before[p]
        return touched

    def _triage(self, units: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(which of ``units`` are finished or in a complete pass, the others as (pass, shard)): a flag per shard
        of each pass present, so no sort of the runs' units."""
        passes, shards = units >> UNIT_PASS_SHIFT, units & (MAX_SHARDS - 1)
        settled, touched = np.zeros(len(units), bool), []
        size = max(self.n_shards, int(shards.max()) + 1) if len(units) else 0
        for p in np.flatnonzero(np.bincount(passes)).tolist() if len(units) else []:
            here = passes == p
            done = np.full(size, p in self.complete)
            done[self.finished.get(p, [])] = True
            settled[here] = done[shards[here]]
            hit = np.zeros(size, bool)
            hit[shards[here]] = True
            touched += [(p, s) for s in np.flatnonzero(hit & ~done).tolist()]
        return settled, touched

    def settle(self, totals: dict) -> list[tuple[int, int]]:
        """Move the partial units whose every produced row (``totals[(pass, shard)]``) was trained on to finished,
        and passes whose every shard is finished to complete; returns the units finished now."""
        partial = self.partial
        done = [u for u, n in partial.items() if u in totals and n >= totals[u]]
        # a shard that produced no row (every sample dropped) has nothing to train on: finished once read
        done += [(p, s) for (p, s), n in totals.items() if n == 0 and (p, s) not in partial
                 and p not in self.complete and s not in self.finished.get(p, ())]
        self.partial_rows = self.partial_rows.split([_unit(p, s) for p, s in done])[1]
        for p, s in done:
            self.finished.setdefault(p, []).append(s)
        for p in [p for p, shards in self.finished.items() if len(shards) == self.n_shards]:
            del self.finished[p]
            self.complete.append(p)
        return done

    def open_pass(self) -> int:
        """The first pass not complete."""
        done = set(self.complete)
        return next(p for p in range(len(done) + 1) if p not in done)

    def left_out(self, pass_: int, shards: list[int]) -> tuple[set[int], dict[int, set[tuple[int, int]]]]:
        """What a read task of ``shards`` in pass ``pass_`` leaves out: (shards to skip, shard → trained pairs) —
        only its own shards' rows, never the whole position."""
        if pass_ in self.complete:
            return set(shards), {}
        skip = set(self.finished.get(pass_, ())) & set(shards)
        pairs = self.partial_rows.only(_unit(pass_, s) for s in shards).pairs()
        of_shard = unit_of(pairs[:, 0])[1]
        cuts = np.flatnonzero(of_shard[1:] != of_shard[:-1]) + 1
        return skip, {int(part[0, 0] >> SHARD_SHIFT) & (MAX_SHARDS - 1): set(map(tuple, part.tolist()))
                      for part in np.split(pairs, cuts) if len(part)}

    def summary(self) -> dict:
        """The metrics a report carries: rows trained on, duplicates, passes complete."""
        return {"data_rows_trained": int(sum(self.rows_per_pass.values())), "data_duplicate_rows": self.duplicates,
                "data_passes_complete": len(self.complete)}

    def state_dict(self) -> dict:
        import torch

        return {"n_shards": self.n_shards, "mix": [list(m) for m in self.mix], "complete": list(self.complete),
                "finished": {p: list(s) for p, s in self.finished.items()},
                "partial_spans": torch.from_numpy(self.partial_rows.spans.copy()),
                "rows_per_pass": dict(self.rows_per_pass), "duplicates": self.duplicates,
                "execution": self.execution, "report": self.report}

    def load_state_dict(self, state: dict) -> None:
        if state["n_shards"] != self.n_shards:
            raise ValueError(f"the checkpoint's data position is over {state['n_shards']} shard reads a pass, the "
                             f"run reads {self.n_shards}: resume with the data.train and data.upsampling_factors the "
                             f"run was started with")
        if tuple(tuple(m) for m in state.get("mix", ())) != self.mix:
            raise ValueError(f"the checkpoint's data position is over a pass of {_mix_text(state.get('mix', ()))}, "
                             f"the run reads {_mix_text(self.mix)}: resume with the data.upsampling_factors the run "
                             f"was started with")
        self.complete, self.finished = list(state["complete"]), {p: list(s) for p, s in state["finished"].items()}
        if "partial_spans" in state:
            self.partial_rows = RowSet(state["partial_spans"].numpy().astype(np.int64).reshape(-1, 3))
        else:  # written before runs: each partial unit's (row id, object) pairs
            pairs = [a.numpy().reshape(-1, 2) for a in state["partial"].values()]
            pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.int64)
            self.partial_rows = RowSet.of(pairs[:, 0], pairs[:, 1])
        self.rows_per_pass, self.duplicates = Counter(state["rows_per_pass"]), int(state["duplicates"])
        self.execution, self.report = int(state["execution"]), state["report"]
        self.pending = []


def _mix_text(mix) -> str:
    return " + ".join(f"{m} reads of {n} shards" for n, m in mix) or "every shard once"
