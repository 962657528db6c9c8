"""TOnICS minibatch sampling and curriculum ([TOnICS] §3 "TOnICS Minibatch Sampling", "Curriculum
Refresh"; App. A.2) as a distributed batch sampler.

Nodes: 0 is the root *entity* node, k ≥ 1 is object class k − 1. At global step s every rank draws the node from
P_S with an RNG seeded by (seed, s) — the same node on every rank without any communication. Root → an ordinary
random micro-batch; object node → every rank fills its micro-batch from that object's bucket, so the whole global
batch shares the object. Each rank keeps bucket buffers fed by its own Ray Data stream (at least buffer_rows rows:
the rows an object's micro-batch reads past it stay, so it grows until it holds about a micro-batch of each object);
when a bucket cannot fill a micro-batch after reading ``max_wait_rows`` more rows, the rest of the micro-batch is
random rows (the documented fallback), counted per rank.

Curriculum refresh: P_S starts at P_S(root) = 1. Every R steps, if held-out image retrieval ≥ threshold,
P_S(root) ← α·P_S(root) (never below β) and the removed mass goes to the object nodes ∝ |X(η_o)|:
    P_S(η_o) ← P_S(η_o) + (1 − α)·P_S(η_e)·|X(η_o)| / Σ|X(η_o)|          (§3, the refresh equation)
P_S, the refresh history and the step are checkpointed, so a resumed run draws the same node sequence.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator

import numpy as np

ROOT = 0


def draw_node(p: np.ndarray, seed: int, step: int) -> int:
    """The node of global step ``step``: a function of (seed, step, P_S) only, identical on every rank."""
    return int(np.random.default_rng([seed, step]).choice(len(p), p=p / p.sum()))


def refresh(p: np.ndarray, sizes: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """One curriculum refresh ([TOnICS] §3): move (1 − α)·P_S(root) to the object nodes ∝ |X(η_o)|, keeping
    P_S(root) ≥ β."""
    p = p.astype(np.float64).copy()
    root = p[ROOT]
    new_root = max(alpha * root, beta) if root > beta else root
    moved = root - new_root
    if moved <= 0 or sizes.sum() == 0:
        return p
    p[ROOT] = new_root
    p[1:] += moved * sizes / sizes.sum()
    return p


SATURATION_TOLERANCE = 5.0  # points of R@1 below a control curve's plateau at which the curriculum starts


def saturation_threshold(curves: list[list[tuple[int, float]]],
                         tolerance: float = SATURATION_TOLERANCE) -> tuple[float, float]:
    """The refresh threshold read from a control arm's learning curves ([TOnICS] App. A.2 refreshes once held-out
    retrieval reaches 90%, a level coarse alignment reaches; the control shows where that is on other data).
    ``curves``: per seed, (step, refresh-set R@1 %) at each refresh check of a run whose curriculum never moves.
    Each curve's plateau is the mean of its last two checks; the threshold is the mean over seeds of plateau −
    ``tolerance``: the curriculum starts once alignment is within ``tolerance`` points of where random batches
    take it. Also returns the mean step at which the curves first reach their own level."""
    if not curves:
        raise ValueError("no finished control trial with refresh checks")
    levels, steps = [], []
    for curve in curves:
        if len(curve) < 2:
            raise ValueError(f"a control curve needs ≥ 2 refresh checks, got {len(curve)}")
        curve = sorted(curve)
        level = float(np.mean([a for _, a in curve[-2:]])) - tolerance
        levels.append(level)
        steps.append(next(s for s, a in curve if a >= level))  # the last two average ≥ level: one of them is
    return float(np.mean(levels)), float(np.mean(steps))


class Curriculum:
    """P_S over [root, classes...] and its refresh history; the state goes into every checkpoint."""

    def __init__(self, sizes: list[int], alpha: float, beta: float, threshold: float, seed: int,
                 moves: bool = True):
        self.sizes = np.asarray(sizes, dtype=np.float64)
        self.alpha, self.beta, self.threshold, self.seed = alpha, beta, threshold, seed
        self.moves = moves  # False: a control arm, evaluated at every refresh but always drawing the root
        self.p = np.zeros(len(sizes) + 1)
        self.p[ROOT] = 1.0
        self.history: list[dict] = []

    def node(self, step: int) -> int:
        return draw_node(self.p, self.seed, step)

    def update(self, step: int, accuracy: float) -> bool:
        """Refresh if the held-out accuracy reaches the threshold; every call is logged in the history."""
        refreshed = self.moves and accuracy >= self.threshold
        if refreshed:
            self.p = refresh(self.p, self.sizes, self.alpha, self.beta)
        self.history.append({"step": step, "accuracy": accuracy, "refreshed": refreshed,
                             "p_root": float(self.p[ROOT])})
        return refreshed

    def state_dict(self) -> dict:
        return {"p": self.p.tolist(), "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.p = np.asarray(state["p"], dtype=np.float64)
        self.history = list(state["history"])


SAMPLER_COUNTS = ("tonics_node_root_batches", "tonics_node_object_batches", "tonics_fallback_batches",
                  "tonics_fallback_rows")


class SamplerTotals:
    """The samplers' counts summed over ranks for the whole run, as a train-state component: what the checkpoint
    resumed from (``offset``) plus what the ranks counted since they started (summed at each report). Rank 0 saves
    the totals of the report its checkpoint is written with, so a resumed run counts on instead of from 0."""

    def __init__(self):
        self.offset = dict.fromkeys(SAMPLER_COUNTS, 0)
        self.totals = dict(self.offset)

    def add(self, since_start: dict) -> dict:
        self.totals = {n: self.offset[n] + int(since_start[n]) for n in SAMPLER_COUNTS}
        return self.totals

    def state_dict(self) -> dict:
        return {"counts": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.offset = {n: int(state["counts"].get(n, 0)) for n in SAMPLER_COUNTS}
        self.totals = dict(self.offset)


class BucketSampler:
    """One rank's bucket buffers over its Ray Data stream (numpy batches with an "object" column)."""

    def __init__(self, stream: Iterator[dict], columns: list[str], micro_batch: int, buffer_rows: int,
                 max_wait_rows: int, seed: int, rank: int):
        self.stream, self.columns, self.n = stream, columns, micro_batch
        self.capacity, self.max_wait = buffer_rows, max_wait_rows
        self.seed, self.rank = seed, rank
        self.buckets: dict[int, list[tuple]] = {}
        self.total = 0
        self.counts: Counter = Counter()

    def _pull(self) -> int:
        batch = next(self.stream)
        objects = batch["object"]
        cols = [batch[c] for c in self.columns]
        for i, obj in enumerate(objects.tolist()):
            self.buckets.setdefault(obj, []).append(tuple(c[i] for c in cols))
        self.total += len(objects)
        return len(objects)

    def _fill(self) -> None:
        while self.total < self.capacity:
            self._pull()

    @staticmethod
    def _pop(bucket: list, rng: np.random.Generator) -> tuple:
        return BucketSampler._take(bucket, int(rng.integers(len(bucket))))

    @staticmethod
    def _take(bucket: list, i: int) -> tuple:
        bucket[i], bucket[-1] = bucket[-1], bucket[i]  # swap-remove: O(1)
        return bucket.pop()

    def _random_rows(self, k: int, rng: np.random.Generator) -> list[tuple]:
        """k rows uniformly at random from everything buffered, none twice (a root-node draw): one draw of k
        distinct positions over the buckets laid end to end — not a draw per row, which rebuilt the buckets'
        sizes each time on the training thread."""
        keys = [key for key, b in self.buckets.items() if b]
        ends = np.cumsum([len(self.buckets[key]) for key in keys])
        picks = rng.choice(int(ends[-1]), size=k, replace=False)
        which = np.searchsorted(ends, picks, side="right")
        positions = picks - np.concatenate([[0], ends[:-1]])[which]
        rows = []
        # within a bucket, the highest position first: a swap-remove then never moves a row still to be taken
        for b, i in sorted(zip(which.tolist(), positions.tolist()), key=lambda bi: (bi[0], -bi[1])):
            rows.append(self._take(self.buckets[keys[b]], i))
        self.total -= k
        return rows

    def batch(self, node: int, step: int, micro: int = 0, stack=np.stack) -> dict:
        """The micro-batch of this rank for ``node`` at global step ``step`` (micro-step ``micro``); ``stack``
        makes a column of it from its rows' arrays."""
        rng = np.random.default_rng([self.seed, step, micro, self.rank, 1])
        self._fill()
        self.counts[f"tonics_node_{'root' if node == ROOT else 'object'}_batches"] += 1
        if node == ROOT:
            rows = self._random_rows(self.n, rng)
        else:
            obj = node - 1
            waited = 0
            while len(self.buckets.get(obj, [])) < self.n and waited < self.max_wait:
                waited += self._pull()
            bucket = self.buckets.get(obj, [])
            rows = [self._pop(bucket, rng) for _ in range(min(self.n, len(bucket)))]
            self.total -= len(rows)
            if len(rows) < self.n:  # fallback: the rest is random rows
                self.counts["tonics_fallback_rows"] += self.n - len(rows)
                self.counts["tonics_fallback_batches"] += 1
                rows += self._random_rows(self.n - len(rows), rng)
        return {c: stack([r[j] for r in rows]) for j, c in enumerate(self.columns)}
