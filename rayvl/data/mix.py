"""Per-source upsampling of a ``::`` mix (open_clip's ``--train-data-upsampling-factors``): the slots of a pass.

open_clip samples shards with replacement, each with a probability proportional to its source's factor
(``ResampledShards2``), an epoch being ``--train-num-samples`` draws; what a run has read is then not a set it can
resume from. rayvl keeps a pass a fixed list of *slots* that the data position resumes row for row
(data/position.py numbers rows by slot): a source of n shards with factor f has round(f·n) slots a pass, at least
one. A source's slots, pass after pass, walk one endless sequence of its shards: all n in one order, then all n in
the next, and so on (cycle c in a permutation drawn from train.seed, the source and c; in spec order without
data.shuffle_files). So a shard is read f times a pass on average and, over the passes, as often as every other
shard of its source (within one): factor 2 reads every shard twice a pass, 0.5 half of them, the other half in the
next pass. A source whose pass is whole cycles needs no draw (its slots are its shards in order, the pass's shard
order shuffles them); factors all 1 make every slot its own shard, the pass without a mix.

A row's crop and draws come from its *cycle*, not its pass (pipeline.preprocess): a shard read twice in a pass is
cropped two ways. Without upsampling the cycle is the pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_MIX = 2  # seeding stream tag (data/seeding.py uses 0 and 1)


@dataclass(frozen=True)
class Mix:
    """The shards of each ``::`` source (in spec order, consecutive in the run's shard list) and its factor."""

    sizes: tuple[int, ...]
    factors: tuple[float, ...]

    @classmethod
    def of(cls, sizes, factors: tuple[float, ...] = ()) -> Mix:
        """The mix of sources of ``sizes`` shards; ``factors``: one per source (config.upsampling_factors of
        data.upsampling_factors; () = 1 each)."""
        sizes, factors = tuple(int(n) for n in sizes), tuple(float(f) for f in factors)
        if factors and len(factors) != len(sizes):
            raise ValueError(f"{len(factors)} upsampling factors for {len(sizes)} sources")
        return cls(sizes, factors or (1.0,) * len(sizes))

    @property
    def slots(self) -> tuple[int, ...]:
        """Slots of each source in a pass: round(f·n), at least one."""
        return tuple(max(1, math.floor(f * n + 0.5)) if n else 0 for n, f in zip(self.sizes, self.factors))

    @property
    def n_slots(self) -> int:
        """Shard reads a pass holds (the data position's size)."""
        return sum(self.slots)

    @property
    def upsampled(self) -> bool:
        """Some source is read other than once a pass."""
        return self.slots != self.sizes

    @property
    def signature(self) -> tuple[tuple[int, int], ...]:
        """(shards, slots) of each source when upsampled, else (): what a resumed run's data position must match."""
        return tuple(zip(self.sizes, self.slots)) if self.upsampled else ()

    def distorted(self, within: float = 0.1) -> list[tuple[int, int, float, int]]:
        """(source, shards, factor, reads a pass) of each source whose reads are not its factor within ``within``
        (relative): a pass reads a shard a whole number of times, so n shards take factors in steps of 1/n."""
        return [(i, n, f, m) for i, (n, f, m) in enumerate(zip(self.sizes, self.factors, self.slots))
                if n and abs(m / n - f) > within * f]

    @property
    def whole_cycles(self) -> bool:
        """Every source's pass is whole cycles of its shards: which shard a slot reads depends on no draw."""
        return all(m % n == 0 for n, m in zip(self.sizes, self.slots) if n)

    def table(self, pass_: int, seed: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, cycle) of every slot of pass ``pass_``."""
        return _table(self, pass_, seed, shuffle)

    def describe(self) -> str:
        """One line: each source's shards, factor and reads a pass."""
        return "; ".join(f"source {i + 1}: {n:,} shard{'s' if n != 1 else ''} × {f:g} = {m:,} "
                         f"read{'s' if m != 1 else ''}" for i, (n, f, m) in enumerate(zip(self.sizes, self.factors,
                                                                                           self.slots)))


@lru_cache(maxsize=8)
def _table(mix: Mix, pass_: int, seed: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    shards, cycles, first = [], [], 0
    for source, (n, m) in enumerate(zip(mix.sizes, mix.slots)):
        q = pass_ * m + np.arange(m, dtype=np.int64)  # positions in the source's endless sequence
        cycle, index = q // n, q % n
        if shuffle and m % n:
            for c in np.unique(cycle).tolist():
                at = cycle == c
                order = np.random.default_rng([_MIX, int(seed) % (1 << 64), source, c]).permutation(n)
                index[at] = order[index[at]]
        shards.append(first + index)
        cycles.append(cycle)
        first += n
    return np.concatenate(shards), np.concatenate(cycles)
