"""Where a run is in its data: which training rows it has trained on, so that a resumed run (after a lost worker
or a restarted driver) trains on every row of an interrupted pass exactly once.

Granularity: one training row — an image-text sample, or with TOnICS one (sample, aligned noun) row ([TOnICS]
App. A.1). Every row carries an int64 id, ``pass << 47 | shard << 20 | row-in-shard`` (``shard`` indexes the
run's sorted shard list), stamped by the read task that produced it. Each rank records the ids it trained on;
at every checkpoint rank 0 gathers them (train/loop.py) into this train-state component:

    complete   passes every shard of which has been trained on
    finished   per pass: shards whose every produced row has been trained on (a shard's row count is known once
               its read task reached its end — the data report records it)
    partial    per (pass, shard) still being read: the (row id, TOnICS object) pairs trained on

Rows prefetched, shuffle-buffered or waiting in a TOnICS bucket when the checkpoint was written are not in it:
after a restore they are read again, as Ray Data re-reads them anyway. A resumed read task skips finished shards
without opening them and drops, after decoding, the rows of a partial shard already trained on.

The run's data report continues too: a finished shard's counts are settled into the position, so a resumed run
starts from the counts of every shard it will not read again and re-counts the shards it reads again.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

PASS_SHIFT, SHARD_SHIFT = 47, 20
MAX_PASSES, MAX_SHARDS, MAX_ROWS = 1 << 16, 1 << 27, 1 << 20


def row_ids(pass_: int, shard: int, first: int, n: int) -> np.ndarray:
    """Ids of rows ``first … first+n-1`` of ``shard`` in pass ``pass_``."""
    if first + n > MAX_ROWS or shard >= MAX_SHARDS or pass_ >= MAX_PASSES:
        raise ValueError(f"a row id holds at most {MAX_PASSES} passes, {MAX_SHARDS} shards and {MAX_ROWS} samples "
                         f"a shard (got pass {pass_}, shard {shard}, row {first + n - 1})")
    return (np.int64(pass_) << PASS_SHIFT) | (np.int64(shard) << SHARD_SHIFT) | np.arange(first, first + n)


def unit_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pass, shard) of each id."""
    return ids >> PASS_SHIFT, (ids >> SHARD_SHIFT) & (MAX_SHARDS - 1)


class DataPosition:
    """The rows trained on so far (see the module docstring); identical in every rank's checkpoint view, merged
    on rank 0. ``pending`` is this rank's (row id, object) pairs since the last checkpoint."""

    def __init__(self, n_shards: int):
        self.n_shards = n_shards
        self.complete: list[int] = []
        self.finished: dict[int, list[int]] = {}
        self.partial: dict[tuple[int, int], np.ndarray] = {}  # (pass, shard) → sorted unique (k, 2) pairs
        self.rows_per_pass: Counter = Counter()  # distinct rows trained on, per pass
        self.duplicates = 0  # rows trained on twice within a pass (a resume that restarted would make them)
        self.execution = 0  # Ray Data executions started before this one (batches._epochs)
        self.report: dict = {"counts": {}, "bad_shards": {}}  # the settled data report
        self.pending: list[np.ndarray] = []

    def trained(self, rows, objects=None) -> None:
        """Record a micro-batch's rows (ids < 0 are image-label rows: not tracked)."""
        rows = np.asarray(rows, dtype=np.int64)
        objects = np.full_like(rows, -1) if objects is None else np.asarray(objects, dtype=np.int64)
        keep = rows >= 0
        self.pending.append(np.stack([rows[keep], objects[keep]], 1))

    def take_pending(self) -> np.ndarray:
        out = np.concatenate(self.pending) if self.pending else np.zeros((0, 2), np.int64)
        self.pending = []
        return out

    def merge(self, pairs: np.ndarray) -> list[tuple[int, int]]:
        """Add every rank's pending pairs; returns the units (pass, shard) they touched."""
        passes, shards = unit_of(pairs[:, 0])
        touched = []
        for p, s in {(int(p), int(s)) for p, s in zip(passes.tolist(), shards.tolist())}:
            new = pairs[(passes == p) & (shards == s)]
            if p in self.complete or s in self.finished.get(p, ()):
                self.duplicates += len(new)
                continue
            old = self.partial.get((p, s), np.zeros((0, 2), np.int64))
            merged = np.unique(np.concatenate([old, new]), axis=0)
            self.duplicates += len(old) + len(new) - len(merged)
            self.rows_per_pass[p] += len(merged) - len(old)
            self.partial[(p, s)] = merged
            touched.append((p, s))
        return touched

    def settle(self, totals: dict) -> list[tuple[int, int]]:
        """Move the partial units whose every produced row (``totals[(pass, shard)]``) was trained on to finished,
        and passes whose every shard is finished to complete; returns the units finished now."""
        done = [u for u, pairs in self.partial.items() if u in totals and len(pairs) >= totals[u]]
        for p, s in done:
            del self.partial[(p, s)]
            self.finished.setdefault(p, []).append(s)
        for p in [p for p, shards in self.finished.items() if len(shards) == self.n_shards]:
            del self.finished[p]
            self.complete.append(p)
        return done

    def plan(self, pass_: int, shards: list[int]) -> tuple[set[int], dict[int, set[tuple[int, int]]]]:
        """What a read task of ``shards`` in pass ``pass_`` leaves out: (shards to skip, shard → trained pairs)."""
        if pass_ in self.complete:
            return set(shards), {}
        skip = set(self.finished.get(pass_, ())) & set(shards)
        return skip, {s: set(map(tuple, self.partial[(pass_, s)].tolist())) for s in shards
                      if (pass_, s) in self.partial}

    def summary(self) -> dict:
        """The metrics a report carries: rows trained on, duplicates, passes complete."""
        return {"data_rows_trained": int(sum(self.rows_per_pass.values())), "data_duplicate_rows": self.duplicates,
                "data_passes_complete": len(self.complete)}

    def state_dict(self) -> dict:
        import torch

        return {"n_shards": self.n_shards, "complete": list(self.complete),
                "finished": {p: list(s) for p, s in self.finished.items()},
                "partial": {u: torch.from_numpy(a.copy()) for u, a in self.partial.items()},
                "rows_per_pass": dict(self.rows_per_pass), "duplicates": self.duplicates,
                "execution": self.execution, "report": self.report}

    def load_state_dict(self, state: dict) -> None:
        if state["n_shards"] != self.n_shards:
            raise ValueError(f"the checkpoint's data position is over {state['n_shards']} shards, the run reads "
                             f"{self.n_shards}: resume with the data.train the run was started with")
        self.complete, self.finished = list(state["complete"]), {p: list(s) for p, s in state["finished"].items()}
        self.partial = {tuple(u): a.numpy() for u, a in state["partial"].items()}
        self.rows_per_pass, self.duplicates = Counter(state["rows_per_pass"]), int(state["duplicates"])
        self.execution, self.report = int(state["execution"]), state["report"]
        self.pending = []
