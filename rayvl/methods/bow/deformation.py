"""Bag-of-Words caption deformation ([BoW] §2.2) with its corpus statistics computed on Ray.

A random ``base_fraction`` of captions (10% in the paper) stays intact; every other caption goes through a cascade
of word operations — the paper's default is Shuffle + RmStopNalpha + LimitToBaseVocab + RmTopFreq(1000) + Keep(4).
LimitToBaseVocab and RmTopFreq need the base split's vocabulary and per-word document frequency ("the number of
captions from the base set in which it appears", §2.2): ``compute_stats`` gets both in one Ray Data pass over the
shards (each batch's partial counts, summed on the driver: never the captions) and saves them as a small JSON
artifact with a fingerprint of the shards and of the split, so a run reuses it and a changed dataset is detected
instead of silently mixed.

Randomness — the base split and each caption's shuffle — is a hash of (seed, sample key), so a caption deforms the
same way on 1 or N workers, in any order, and after a restart.

Words: the caption is lower-cased and split by one regular expression (the pattern of an nltk RegexpTokenizer)
into word tokens (letters/digits with inner apostrophes or hyphens, so "should've" and "t-shirt" stay whole) and
punctuation runs (":" and "." are tokens, as in the paper's Figure 2). A deformed caption is its remaining tokens
joined by spaces.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rayvl import storage
from rayvl.data import artifacts
from rayvl.data.shards import Reading, sum_over_shards
from rayvl.data.specs import resolve_shards
from rayvl.data.text import TOKEN_PATTERN, is_alphabetical, stopwords, validate_caption, words
from rayvl.methods.bow.check import BowOp, needs_stats
from rayvl.methods.bow.marks import PSEUDO_FLAG, PSEUDO_MARKER

STATS_FORMAT = 1
# reserved aggregation keys: the tokenizer never joins "<" to a word, so no caption word can collide with these
BASE_CAPTIONS, ALL_CAPTIONS = "<base captions>", "<captions>"


# ----------------------------------------------------------------------------- the operators of §2.2

def shuffle(ws: list[str], key: str, seed: int) -> list[str]:
    """Shuffle: remove word order (syntax). The permutation sorts the words by random 32-bit keys drawn from
    SHAKE-128 of (seed, sample key): the same on every worker and Python version, and cheaper than seeding a
    random.Random per caption (the Mersenne Twister's set-up alone outweighs the hash)."""
    draws = memoryview(hashlib.shake_128(f"{seed}/shuffle/{key}".encode()).digest(4 * len(ws))).cast("I")
    return [w for _, _, w in sorted(zip(draws, range(len(ws)), ws))]


def rm_stop_nalpha(ws: list[str]) -> list[str]:
    """RmStopNalpha: drop NLTK stop words and non-alphabetical tokens (numbers, punctuation)."""
    stop = stopwords()
    return [w for w in ws if w not in stop and is_alphabetical(w)]


def limit_to_base_vocab(ws: list[str], vocab) -> list[str]:
    """LimitToBaseVocab: keep only words that occur in the base split."""
    return [w for w in ws if w in vocab]


def rm_top_freq(ws: list[str], top) -> list[str]:
    """RmTopFreq(t): drop the t words with the highest base-split document frequency (``top``)."""
    return [w for w in ws if w not in top]


def keep(ws: list[str], n: int) -> list[str]:
    """Keep(n): the first n words — applied last, after Shuffle, so n random words survive (§2.2)."""
    return ws[:n]


# ----------------------------------------------------------------------------- seeded per-sample randomness

def _unit(seed: int, salt: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{salt}/{key}".encode(), digest_size=8).digest(), "big")


def is_base(key: str, seed: int, fraction: float) -> bool:
    """The caption belongs to the intact base split: a hash of (seed, key), so no worker needs to coordinate."""
    return _unit(seed, "base", key) < fraction * 2**64


# ----------------------------------------------------------------------------- statistics (one Ray Data pass, summed)

@dataclass
class BowStats:
    """Base-split document frequencies and the fingerprint of the data and split they were computed on."""

    fingerprint: dict
    captions: int
    base_captions: int
    df: dict[str, int] = field(repr=False)

    def top(self, t: int, content: bool = False) -> frozenset[str]:
        """The t most frequent base words (ties broken alphabetically, so the set is deterministic); ``content``:
        among the words RmStopNalpha keeps (alphabetical, not stop words) only."""
        stop = stopwords() if content else frozenset()
        kept = (kv for kv in self.df.items() if not content or (kv[0] not in stop and is_alphabetical(kv[0])))
        ranked = sorted(kept, key=lambda kv: (-kv[1], kv[0]))
        return frozenset(w for w, _ in ranked[:t])


def is_pseudo(meta) -> bool:
    """A pseudo-BoW caption (rayvl.methods.bow.pseudo_label, [BoW] §2.3): already a BoW, trained as it is, and no
    part of the aligned captions' statistics."""
    try:
        info = json.loads(meta) if meta else {}
    except (ValueError, TypeError):
        return False
    return isinstance(info, dict) and info.get(PSEUDO_FLAG) is True


def base_word_counts(batch: dict, *, seed: int, fraction: float) -> dict:
    """One Ray Data batch → partial document frequencies of its base captions (each word once per caption),
    plus the caption counts under the reserved keys. ``sum_over_shards`` adds the partials up."""
    df: Counter = Counter()
    for key, txt, meta in zip(batch["key"], batch["txt"], batch["json"]):
        text, reason = validate_caption(txt)
        if reason or is_pseudo(meta):
            continue
        df[ALL_CAPTIONS] += 1
        if is_base(key, seed, fraction):
            df[BASE_CAPTIONS] += 1
            df.update(set(words(text)))
    return {"word": np.array(list(df), dtype=object), "df": np.array(list(df.values()), dtype=np.int64)}


def counted_shards(spec: str | Sequence[str]) -> list[str]:
    """The shards whose captions the statistics count: all but those a `rayvl pseudo-label` job wrote (its <rule>/
    folders sit beside its PSEUDO_MARKER). Their captions stay out of the statistics anyway (``is_pseudo``), so
    S_a + pseudo has S_a's statistics — fingerprint included, and a run on both reuses S_a's artifact."""
    shards = resolve_shards(spec)
    folders = {storage.parent(s) for s in shards}
    pseudo = {f for f in folders if storage.is_file(storage.join(storage.parent(f), PSEUDO_MARKER))}
    return [s for s in shards if storage.parent(s) not in pseudo] or shards


def fingerprint(spec: str | Sequence[str], seed: int, fraction: float) -> dict:
    return _fingerprint(counted_shards(spec), seed, fraction)


def _fingerprint(shards: list[str], seed: int, fraction: float) -> dict:
    """What the statistics depend on: every counted shard (name and size), the base split, the word tokenizer."""
    return {"shards": artifacts.shard_sizes(shards), "seed": seed, "base_fraction": fraction,
            "token_pattern": TOKEN_PATTERN, "format": STATS_FORMAT}


def _count(shards: list[str], seed: int, fraction: float, reading: Reading, summed=sum_over_shards) -> dict:
    """The statistics pass: shards streamed by Ray Data (or ``summed``: another ``sum_over_shards``, e.g. a local
    loader's) → per-batch partial counts → summed by word."""
    df = summed(shards, ("key", "txt", "json"), base_word_counts, {"seed": seed, "fraction": fraction},
                "word", "df", reading)
    captions, base = df.pop(ALL_CAPTIONS, 0), df.pop(BASE_CAPTIONS, 0)
    return {"captions": captions, "base_captions": base, "df": dict(sorted(df.items()))}


def compute_stats(spec: str | Sequence[str], *, seed: int, fraction: float, reading: Reading = Reading()) -> BowStats:
    """The statistics of the shards ``spec`` names, read as ``reading`` says (its read_cpus and io)."""
    shards = counted_shards(spec)
    return BowStats(_fingerprint(shards, seed, fraction), **_count(shards, seed, fraction, reading))


def load_or_compute(spec: str | Sequence[str], path: str, *, seed: int, fraction: float,
                    reading: Reading = Reading(), summed=sum_over_shards) -> tuple[BowStats, bool]:
    """(stats, reused). A saved artifact is reused only if its fingerprint matches the data and split now.
    ``summed``: how the statistics pass sums over the shards (``_count``)."""
    shards = counted_shards(spec)  # listed once: on object storage a listing is a round trip per folder
    content, reused = artifacts.load_or_make(path, _fingerprint(shards, seed, fraction), "bow.stats_path",
                                             lambda: _count(shards, seed, fraction, reading, summed))
    return BowStats(**content), reused


# ----------------------------------------------------------------------------- the deformation

class Deformer:
    """The configured cascade with its statistics; picklable, applied inside Ray Data's map_batches."""

    def __init__(self, ops: list[BowOp], seed: int, base_fraction: float, stats: BowStats | None,
                 top_freq_words: str = "content", keep_base_intact: bool = True):
        if needs_stats(ops) and stats is None:
            raise ValueError("limit_to_base_vocab / rm_top_freq need the base-split statistics")
        self.ops, self.seed, self.base_fraction = ops, seed, base_fraction
        self.keep_base_intact = keep_base_intact
        self.vocab = frozenset(stats.df) if stats else frozenset()
        # bow.top_freq_words: "content" ranks the words that survive RmStopNalpha, "all" the whole base vocabulary
        self.tops = {op.arg: stats.top(op.arg, content=top_freq_words == "content") for op in ops
                     if op.name == "rm_top_freq"}

    def deform_words(self, ws: list[str], key: str) -> list[str]:
        for op in self.ops:
            if op.name == "shuffle":
                ws = shuffle(ws, key, self.seed)
            elif op.name == "rm_stop_nalpha":
                ws = rm_stop_nalpha(ws)
            elif op.name == "limit_to_base_vocab":
                ws = limit_to_base_vocab(ws, self.vocab)
            elif op.name == "rm_top_freq":
                ws = rm_top_freq(ws, self.tops[op.arg])
            else:
                ws = keep(ws, op.arg)
        return ws

    def __call__(self, key: str, caption: str) -> tuple[str, bool]:
        """(caption to train on, is_base). Base captions stay intact; '' means the deformation emptied it."""
        if self.keep_base_intact and is_base(key, self.seed, self.base_fraction):
            return caption, True
        return " ".join(self.deform_words(words(caption), key)), False
