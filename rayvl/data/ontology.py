"""The TOnICS ontology ([TOnICS] §3 "Ontology Construction", App. A.1): object classes, the nouns that
name them, and one training row per (image-text pair, aligned noun) — the paper's triplets.

A sample's objects come, in order, from detector tags in its JSON metadata (``tonics.tags_field``) or else from the
nouns of its caption, each mapped to a configured class through WordNet hypernyms (nltk's WordNet reader over the
Debian WordNet 3.0 that `rayvl assets fetch` installs): "puppies" → morphy → puppy.n.01 → hypernym dog.n.01 → dog.
A user override file {noun: class} is applied first, as the paper corrects its mapping by hand. The per-class row
counts |X(η_o)| are a Ray Data groupby over the shards, saved as a run artifact; classes with fewer than
``min_instances`` rows are dropped (paper: 5000), and a pair left with no aligned noun stays as one root-only row
(object −1: it can be drawn in random minibatches only), counted in the data report.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from rayvl import assets
from rayvl.data import artifacts
from rayvl.data.shards import group_over_shards
from rayvl.data.tar import resolve_shards
from rayvl.data.text import NLTK_LOCK, is_alphabetical, stopwords, validate_caption, words

COUNTS_FORMAT = 1
UNALIGNED = -1


@lru_cache(maxsize=1)
def wordnet():
    """nltk's WordNet reader over the offline WordNet 3.0 (loaded once per process, ≈4 s)."""
    import nltk

    root = assets.nltk_data_dir()
    if root is None:
        raise RuntimeError("WordNet 3.0 is not installed: run `rayvl assets fetch` (Debian wordnet-base)")
    with NLTK_LOCK:
        if str(root) not in nltk.data.path:
            nltk.data.path.insert(0, str(root))
        from nltk.corpus import wordnet as wn

        wn.ensure_loaded()
        return wn


def _hypernyms(synset):
    return synset.hypernyms() + synset.instance_hypernyms()


@dataclass
class Ontology:
    """Object classes (node k ≥ 1 of the sampler is class k − 1) and the noun → class mapping."""

    classes: list[str]
    synsets: list[str]
    overrides: dict[str, str] = field(default_factory=dict)
    tags_field: str = "objects"
    kept: frozenset[int] | None = None  # classes with ≥ min_instances rows (None: not filtered yet)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, specs: list[str], overrides_file: str = "", tags_field: str = "objects") -> "Ontology":
        """Resolve class specs ("dog" → its first noun sense, or an explicit "dog.n.01") against WordNet."""
        wn = wordnet()
        names, synsets = [], []
        for i, spec in enumerate(specs):
            if ".n." in spec:
                try:
                    synset = wn.synset(spec)
                except Exception:  # nltk raises WordNetError / ValueError for unknown ids
                    raise ValueError(f"[{i}]: {spec!r} is not a WordNet noun synset") from None
            else:
                found = wn.synsets(spec.replace(" ", "_"), wn.NOUN)
                if not found:
                    raise ValueError(f"[{i}]: {spec!r} is not a WordNet noun")
                synset = found[0]
            names.append(spec.split(".")[0].replace("_", " "))
            synsets.append(synset.name())
        overrides = {}
        if overrides_file:
            raw = json.loads(Path(overrides_file).expanduser().read_text())
            unknown = sorted({c for c in raw.values() if c not in names})
            if unknown:
                raise ValueError(f"overrides: classes {unknown} are not in tonics.classes")
            overrides = {noun.lower(): c for noun, c in raw.items()}
        return cls(names, synsets, overrides, tags_field)

    def noun_class(self, word: str) -> int | None:
        """The class a (lower-case) noun names: override, else the first WordNet sense whose hypernym closure
        (nearest first) reaches a class synset."""
        if word in self._cache:
            return self._cache[word]
        found = None
        if word in self.overrides:
            found = self.classes.index(self.overrides[word])
        elif word in self.classes:
            found = self.classes.index(word)
        elif is_alphabetical(word) and word not in stopwords():
            found = self._wordnet_class(word)
        self._cache[word] = found
        return found

    def _wordnet_class(self, word: str) -> int | None:
        with NLTK_LOCK:  # the read tasks' transform threads share the reader
            wn = wordnet()
            index = {s: i for i, s in enumerate(self.synsets)}
            lemma = wn.morphy(word.replace("-", "_"), wn.NOUN)
            for synset in wn.synsets(lemma, wn.NOUN) if lemma else []:
                hit = next((index[s.name()] for s in [synset, *synset.closure(_hypernyms)] if s.name() in index),
                           None)
                if hit is not None:
                    return hit
        return None

    def aligned(self, caption: str, meta: bytes | str | None) -> list[tuple[str, int]]:
        """(noun or tag, class id) for each distinct aligned noun of a sample, restricted to kept classes."""
        tags = _tags(meta, self.tags_field)
        candidates = [t.lower() for t in tags] if tags else words(caption)
        out, seen = [], set()
        for word in candidates:
            cls = self.noun_class(word)
            if cls is not None and word not in seen and (self.kept is None or cls in self.kept):
                seen.add(word)
                out.append((word, cls))
        return out

    def row_objects(self, caption: str, meta) -> list[int]:
        """The object id of each training row this sample becomes: one per aligned noun, or [UNALIGNED]."""
        return [cls for _, cls in self.aligned(caption, meta)] or [UNALIGNED]

    def __getstate__(self):  # Ray ships the ontology to its tasks: the WordNet lookups are cached per process
        return {**self.__dict__, "_cache": {}}


def _tags(meta, field_name: str) -> list[str]:
    if not meta:
        return []
    try:
        raw = json.loads(meta).get(field_name) or []
    except (ValueError, TypeError, AttributeError):
        return []
    tags = []
    for t in raw if isinstance(raw, list) else []:
        if isinstance(t, str):
            tags.append(t)
        elif isinstance(t, (list, tuple)) and t and isinstance(t[0], str):
            tags.append(t[0])
        elif isinstance(t, dict):
            label = t.get("label") or t.get("name") or t.get("class")
            if isinstance(label, str):
                tags.append(label)
    return tags


# ----------------------------------------------------------------------------- |X(η_o)| as a Ray Data aggregation

def batch_objects(batch: dict, *, ontology: Ontology) -> dict:
    """One Ray Data batch → one row per (pair, aligned noun) with its object id (UNALIGNED for none)."""
    objects: list[int] = []
    for txt, meta in zip(batch["txt"], batch["json"]):
        text, reason = validate_caption(txt)
        if not reason:
            objects += ontology.row_objects(text, meta)
    return {"object": np.array(objects, dtype=np.int64)}


def fingerprint(spec: str, ontology: Ontology) -> dict:
    return {"shards": artifacts.shard_sizes(resolve_shards(spec)), "classes": ontology.synsets,
            "overrides": dict(sorted(ontology.overrides.items())), "tags_field": ontology.tags_field,
            "format": COUNTS_FORMAT}


def count_rows(spec: str, ontology: Ontology, read_cpus: float = 0.5) -> dict[int, int]:
    """Rows per object id over the shards: map to objects, then groupby("object").count() on Ray Data."""
    grouped = group_over_shards(resolve_shards(spec), ("key", "txt", "json"), batch_objects, {"ontology": ontology},
                                "object", read_cpus)
    return {int(r["object"]): int(r["count()"]) for r in grouped.count().iter_rows()}


def load_or_count(spec: str, path: str, ontology: Ontology, read_cpus: float = 0.5) -> tuple[dict[int, int], bool]:
    """(rows per object id, reused). A saved artifact is reused only if its fingerprint still matches."""
    content, reused = artifacts.load_or_make(
        path, fingerprint(spec, ontology), "tonics.counts_path",
        lambda: {"counts": {str(k): v for k, v in sorted(count_rows(spec, ontology, read_cpus).items())}})
    return {int(k): v for k, v in content["counts"].items()}, reused


def keep_frequent(ontology: Ontology, counts: dict[int, int], min_instances: int) -> tuple[Ontology, list[int]]:
    """The ontology restricted to classes with ≥ min_instances rows, and |X(η_o)| per class (0 when dropped)."""
    sizes = [counts.get(i, 0) if counts.get(i, 0) >= min_instances else 0 for i in range(len(ontology.classes))]
    kept = frozenset(i for i, n in enumerate(sizes) if n)
    return Ontology(ontology.classes, ontology.synsets, ontology.overrides, ontology.tags_field, kept), sizes

