"""The object ontology of [TOnICS] §3 "Ontology Construction", App. A.1 — object classes, the nouns that name them,
and one training row per (image-text pair, aligned class): the paper's triplets, one per class (``aligned``) — and
WordNet under it (rayvl.data.wordnet). The TOnICS method's rows (rows.py) and its contextual evaluation
(contextual.py) use it.

A caption's nouns are told apart from its adjectives and verbs without a tagger model (none ships offline):
a word is a noun where WordNet's sense-tagged counts (SemCor, ``cntlist``) make the noun reading its most frequent
one, where it is a plural, or after a determiner with no noun following; an adjective-capable word right before a
noun is a modifier ("a white dog", "an orange circle": no row for "white" or "orange"). Each noun maps to a
configured class through WordNet hypernyms (nltk's WordNet reader over the Debian WordNet 3.0 that `rayvl assets
fetch` installs): "puppies" → morphy → puppy.n.01 → hypernym dog.n.01 → dog. A class given by name takes its first
sense that is a physical entity ("ring" → the band, not the sound; "star" is a celestial body unless the config
says star.n.05, the plane figure); ``name=synset.id`` names a sense explicitly. A user override file {noun: class}
is applied first, as the paper corrects its mapping by hand.

Detector tags in a sample's JSON metadata (``tonics.tags_field``) say which objects are in the image: with tags, a
caption noun makes a row only if its class is among the tags' classes — a triplet needs the noun in the caption
and the object in the image (App. A.1); without tags every class a caption noun names makes a row. The per-class row
counts |X(η_o)| are summed over the shards' Ray Data batches, saved as a run artifact; classes with fewer than
``min_instances`` rows are dropped (paper: 5000), and a pair left with no aligned noun stays as one root-only row
(object −1: it can be drawn in random minibatches only), counted in the data report.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rayvl.data import artifacts
from rayvl.data.shards import Reading, sum_over_shards
from rayvl.data.specs import resolve_shards
from rayvl.data.text import NLTK_LOCK, is_alphabetical, stopwords, validate_caption, words
from rayvl.data.wordnet import wordnet

COUNTS_FORMAT = 3  # 2: caption nouns only (POS), tags restrict rather than replace them; 3: a row per class
UNALIGNED = -1


def _hypernyms(synset):
    return synset.hypernyms() + synset.instance_hypernyms()


PHYSICAL = "physical_entity.n.01"
DETERMINERS = frozenset("a an the this that these those his her its their our my your some any each every no "
                        "one two three four five several many".split())


def class_sense(wn, spec: str):
    """The synset a class spec names: "dog.n.01" or "name=dog.n.01" as given, a plain name its first noun sense
    that is a physical entity (else its first noun sense)."""
    spec = spec.split("=", 1)[1] if "=" in spec else spec
    if ".n." in spec:
        return wn.synset(spec)
    found = wn.synsets(spec.replace(" ", "_"), wn.NOUN)
    if not found:
        raise LookupError(spec)
    physical = [s for s in found if any(h.name() == PHYSICAL for h in s.closure(_hypernyms))]
    return (physical or found)[0]


def class_name(spec: str) -> str:
    return (spec.split("=", 1)[0] if "=" in spec else spec.split(".")[0]).replace("_", " ")


def pos_counts(wn, word: str) -> dict[str, int]:
    """How often WordNet's sense-tagged corpus uses ``word`` as noun, verb, adjective and adverb (each reading's
    base form by morphy; summed over its senses)."""
    out = {}
    for pos, tags in (("n", (wn.NOUN,)), ("v", (wn.VERB,)), ("a", (wn.ADJ, wn.ADJ_SAT)), ("r", (wn.ADV,))):
        lemma = wn.morphy(word, tags[0])
        out[pos] = sum(l.count() for t in tags for s in (wn.synsets(lemma, t) if lemma else [])
                       for l in s.lemmas() if l.name().lower() == lemma) if lemma else -1
    return out


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
        """Resolve class specs ("dog" → its first physical-entity noun sense; "dog.n.01" or "hound=dog.n.01"
        as given) against WordNet."""
        wn = wordnet()
        names, synsets = [], []
        for i, spec in enumerate(specs):
            try:
                synset = class_sense(wn, spec)
            except LookupError:
                raise ValueError(f"[{i}]: {spec!r} is not a WordNet noun") from None
            except Exception:  # nltk raises WordNetError / ValueError for unknown ids
                raise ValueError(f"[{i}]: {spec!r} is not a WordNet noun synset") from None
            names.append(class_name(spec))
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
        """Through the noun's lemma: a class of that name, else the first of its senses in use (a SemCor count
        above 0, or its first sense) whose hypernym closure reaches a class synset — "square" is not a person
        through its rare sense square.n.05."""
        with NLTK_LOCK:  # the read tasks' transform threads share the reader
            wn = wordnet()
            index = {s: i for i, s in enumerate(self.synsets)}
            lemma = wn.morphy(word.replace("-", "_"), wn.NOUN)
            if lemma and lemma.replace("_", " ") in self.classes:
                return self.classes.index(lemma.replace("_", " "))
            senses = wn.synsets(lemma, wn.NOUN) if lemma else []
            for k, synset in enumerate(senses):
                if k and not any(x.count() for x in synset.lemmas() if x.name().lower() == lemma):
                    continue
                hit = next((index[s.name()] for s in [synset, *synset.closure(_hypernyms)] if s.name() in index),
                           None)
                if hit is not None:
                    return hit
        return None

    def aligned(self, caption: str, meta: bytes | str | None) -> list[tuple[str, int]]:
        """(noun, class id) for each kept class a caption noun names — its first noun — and, when the sample has
        detector tags, an object the tags put in the image. One per class: "a man and a woman" is one person row.
        The paper makes a triplet per noun (App. A.1), but its triplets differ by the noun's word features; rayvl's
        row is (image, caption, object), so two nouns of one class would be the same row twice — a false negative
        in an object batch, and two rows under one data-position key."""
        tags = _tags(meta, self.tags_field)
        in_image = {self.noun_class(t.lower()) for t in tags} if tags else None
        out, seen = [], set()
        for word in self.nouns(caption):
            cls = self.noun_class(word)
            if (cls is not None and cls not in seen and (in_image is None or cls in in_image)
                    and (self.kept is None or cls in self.kept)):
                seen.add(cls)
                out.append((word, cls))
        return out

    def nouns(self, caption: str) -> list[str]:
        """The caption's tokens read as nouns (module docstring: SemCor counts, plurals, determiners, modifiers)."""
        tokens = words(caption)
        out = []
        for i, word in enumerate(tokens):
            after = tokens[i + 1] if i + 1 < len(tokens) else ""
            before = tokens[i - 1] if i else ""
            if self._is_noun(word, before, after):
                out.append(word)
        return out

    def _is_noun(self, word: str, before: str, after: str) -> bool:
        counts = self._pos(word)
        if counts is None or counts["n"] < 0:  # not a word WordNet has as a noun
            return False
        if counts["a"] >= 0 and self._noun_like(after):  # "white dog", "orange circle": a modifier
            return False
        if self._noun_like(word):
            return True
        with NLTK_LOCK:
            plural = wordnet().morphy(word, "n") != word
        # "oranges" (adjectives have no plural; "runs" is a verb first); the head of a noun phrase — after a
        # determiner or an adjective, before no noun: "an orange .", "a white cross above", "a red ring and"
        opens = before in DETERMINERS or self._adjective_like(before)
        return (plural and counts["n"] >= counts["v"]) or (opens and not self._noun_like(after))

    def _adjective_like(self, word: str) -> bool:
        return self._reads_as(word, "a")

    def _noun_like(self, word: str) -> bool:
        return self._reads_as(word, "n")

    def _reads_as(self, word: str, pos: str) -> bool:
        """Whether ``word`` has a ``pos`` reading ("n", "v", "a", "r") at least as common as each other one."""
        counts = self._pos(word)
        return counts is not None and counts[pos] >= 0 and counts[pos] == max(counts.values())

    def _pos(self, word: str) -> dict[str, int] | None:
        if not word or not is_alphabetical(word) or word in stopwords():
            return None
        key = ("pos", word)
        if key not in self._cache:
            with NLTK_LOCK:
                self._cache[key] = pos_counts(wordnet(), word.replace("-", "_"))
        return self._cache[key]

    def row_objects(self, caption: str, meta) -> list[int]:
        """The object id of each training row this sample becomes: one per aligned class, or [UNALIGNED]."""
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


# ----------------------------------------------------------------------------- |X(η_o)| summed over Ray Data's batches

def batch_objects(batch: dict, *, ontology: Ontology) -> dict:
    """One Ray Data batch → its rows per object id: a (pair, aligned noun) row is one of its object's (UNALIGNED for
    none)."""
    objects: list[int] = []
    for txt, meta in zip(batch["txt"], batch["json"]):
        text, reason = validate_caption(txt)
        if not reason:
            objects += ontology.row_objects(text, meta)
    ids, rows = np.unique(np.array(objects, dtype=np.int64), return_counts=True)
    return {"object": ids, "rows": rows.astype(np.int64)}


def fingerprint(spec: str | Sequence[str], ontology: Ontology) -> dict:
    return {"shards": artifacts.shard_sizes(resolve_shards(spec)), "classes": ontology.synsets,
            "overrides": dict(sorted(ontology.overrides.items())), "tags_field": ontology.tags_field,
            "format": COUNTS_FORMAT}


def count_rows(spec: str | Sequence[str], ontology: Ontology, reading: Reading = Reading()) -> dict[int, int]:
    """Rows per object id over the shards: each batch's rows per object (Ray Data's tasks), summed here."""
    return {int(k): int(v) for k, v in sum_over_shards(resolve_shards(spec), ("key", "txt", "json"), batch_objects,
                                                       {"ontology": ontology}, "object", "rows", reading).items()}


def load_or_count(spec: str | Sequence[str], path: str, ontology: Ontology,
                  reading: Reading = Reading(), made_from: dict | None = None) -> tuple[dict[int, int], bool]:
    """(rows per object id, reused). A saved artifact is reused only if its fingerprint still matches
    (``made_from``: the fingerprint, where the caller has it already)."""
    content, reused = artifacts.load_or_make(
        path, made_from or fingerprint(spec, ontology), "tonics.counts_path",
        lambda: {"counts": {str(k): v for k, v in sorted(count_rows(spec, ontology, reading).items())}})
    return {int(k): v for k, v in content["counts"].items()}, reused


def keep_frequent(ontology: Ontology, counts: dict[int, int], min_instances: int) -> tuple[Ontology, list[int]]:
    """The ontology restricted to classes with ≥ min_instances rows, and |X(η_o)| per class (0 when dropped)."""
    sizes = [counts.get(i, 0) if counts.get(i, 0) >= min_instances else 0 for i in range(len(ontology.classes))]
    kept = frozenset(i for i, n in enumerate(sizes) if n)
    return Ontology(ontology.classes, ontology.synsets, ontology.overrides, ontology.tags_field, kept), sizes

