"""Pseudo Bag-of-Words captions from retrieved captions ([BoW] §2.3, Fig. 5).

An image without a caption is cropped c times; each crop's top-k nearest intact captions of the aligned set S_a
make NN_i (k·c captions, best first). Its words go through RmStopNalpha (as every BoW caption does, §2.2), are
ranked by one of the paper's four rules, and the first p words are the pseudo caption:

    max_count         count(w, NN_i): in how many of the retrieved captions w appears at least once
    rm_top_max_count  max_count after removing S_a's top-t most frequent words
    rm_top_rand       the survivors of rm_top_max_count in random order (seeded by the image key)
    weighted_count    count(w, NN_i) / count(w, S_a) — frequent words ranked lower instead of removed

count(w, S_a) is w's document frequency over S_a's captions (the BoW statistics pass over every caption). The
top-t list is taken over the words that survive RmStopNalpha, so t counts content words — with stop words and
punctuation in it, RmTopFreq(t) spends most of a small t on words the filter already removed. The paper leaves
ties open: here they go to the word seen first in NN_i, i.e. in the caption closest to a crop.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from rayvl.data.text import is_alphabetical, stopwords, words
from rayvl.methods.bow.check import RULES
from rayvl.methods.bow.deformation import rm_stop_nalpha, shuffle


def caption_words(caption: str) -> tuple[str, ...]:
    """A caption's words after RmStopNalpha, each once, in order: what NN_i counts of it (a pool caption retrieved
    for many crops is split once, where the labeller caches this)."""
    return tuple(dict.fromkeys(rm_stop_nalpha(words(caption))))


def neighbour_counts(captions: Sequence[str]) -> tuple[Counter, dict[str, int]]:
    """(count(w, NN_i), first position of w) over the filtered words of the retrieved captions, best first."""
    return count_words(map(caption_words, captions))


def count_words(caption_word_lists: Iterable[tuple[str, ...]]) -> tuple[Counter, dict[str, int]]:
    """``neighbour_counts`` from each retrieved caption's ``caption_words``, best first."""
    counts: Counter = Counter()
    first: dict[str, int] = {}
    for ws in caption_word_lists:
        counts.update(ws)  # each word once per caption
        for w in ws:
            if w not in first:
                first[w] = len(first)
    return counts, first


class WordRanker:
    """The four rules over S_a's document frequencies ``df`` (picklable: it travels to Ray Data actors)."""

    def __init__(self, df: dict[str, int], words: int, top_t: int, seed: int = 0):
        self.df, self.p, self.seed = df, words, seed
        stop = stopwords()
        content = sorted(((w, c) for w, c in df.items() if w not in stop and is_alphabetical(w)),
                         key=lambda wc: (-wc[1], wc[0]))
        self.top = frozenset(w for w, _ in content[:top_t])

    def rank(self, rule: str, captions: Sequence[str], key: str) -> list[str]:
        """The pseudo caption's words (at most p; none when every retrieved word was filtered out)."""
        return self.ranked(rule, *neighbour_counts(captions), key)

    def ranked(self, rule: str, counts: Counter, first: dict[str, int], key: str) -> list[str]:
        """``rank`` from ``neighbour_counts`` already made (one count serves every rule of an image)."""
        if rule == "max_count":
            ranked = sorted(counts, key=lambda w: (-counts[w], first[w]))
        elif rule == "rm_top_max_count":
            ranked = sorted((w for w in counts if w not in self.top), key=lambda w: (-counts[w], first[w]))
        elif rule == "rm_top_rand":
            ranked = shuffle([w for w in first if w not in self.top], key, self.seed)
        elif rule == "weighted_count":
            # a retrieved word comes from an S_a caption, so df ≥ 1 unless the statistics missed it
            ranked = sorted(counts, key=lambda w: (-counts[w] / max(self.df.get(w, 0), 1), first[w]))
        else:
            raise ValueError(f"unknown ranking rule {rule!r}; one of {', '.join(RULES)}")
        return ranked[:self.p]
