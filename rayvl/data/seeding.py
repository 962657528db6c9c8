"""What ``train.seed`` fixes in the data plane, whichever Ray task, worker or thread handles a row.

A row's random draws (its crop, its prompt) come from a generator of (seed, stable hash of the sample key, pass):
the same row gets the same draws for a seed however the rows are split into tasks, batches and threads, and new ones
each pass. Each rank's local shuffle buffer draws from (seed, rank, execution).
"""
from __future__ import annotations

import hashlib

import numpy as np

_ROW, _SHUFFLE = 0, 1  # stream tags: a row generator never shares its seed sequence with a shuffle buffer


def key_hash(key) -> int:
    """A 64-bit hash of a sample key, the same in every process (Python's ``hash`` of a str is salted per process)."""
    data = key if isinstance(key, bytes) else str(key).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def row_rng(seed: int, key, pass_: int) -> np.random.Generator:
    """The generator of one row's crop and prompt draws in pass ``pass_``."""
    return np.random.default_rng([_ROW, _unsigned(seed), key_hash(key), _unsigned(pass_)])


def shuffle_seed(seed: int, rank: int, execution: int, stream: int = 0) -> int:
    """The ``local_shuffle_seed`` of a rank's Ray Data iterator in its ``execution``-th execution (``stream``: which
    of the rank's datasets, when it reads more than one)."""
    sequence = np.random.SeedSequence([_SHUFFLE, _unsigned(seed), rank, execution, stream])
    return int(sequence.generate_state(1, np.uint32)[0])


def _unsigned(n: int) -> int:
    # SeedSequence takes non-negative entropy only; a negative seed or the −1 pass of an unnumbered row maps here
    return int(n) % (1 << 64)
