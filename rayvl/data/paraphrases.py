"""The demo's fixed paraphrase set for evaluation ([Paraphrase] §3, AO@k / JS@k): caption → paraphrase.

[Paraphrase] paraphrases COCO captions with GPT-3 and keeps the ones that preserve meaning. Offline, the demo
rewrites its own captions by three meaning-preserving edits, each applied at random:

- **synonyms from WordNet**: a size, colour, shape or "picture" is replaced by another lemma of the WordNet sense
  the scene means (the synsets are pinned, as configs/tonics.yaml pins its classes: "diamond" → rhombus.n.01 gives
  "rhombus", "rhomb"; "ring" → ring.n.02, the toroid, not a sound);
- **reordered relations**: "X to the left of Y" ↔ "Y to the right of X", "X above Y" ↔ "Y below X", and the
  objects of a list in another order;
- **function words** added or dropped: "there is" / "we can see" / "a photo of" prefixes, "in the center" ↔ "in the
  middle", "of the picture" dropped, articles dropped.

Half the set paraphrases the held-out images' own captions (one object each), half captions of unrendered 2–3
object scenes, where the relations are. The set depends only on its seed: every run evaluates the same pairs.
"""
from __future__ import annotations

import re

import numpy as np

# the WordNet sense each paraphrased caption word means in the demo's scenes
SENSES = {
    "small": "small.a.01", "large": "large.a.01", "picture": "picture.n.01",
    "red": "red.s.01", "green": "green.s.01", "blue": "blue.s.01", "yellow": "yellow.s.01",
    "purple": "purple.s.01", "orange": "orange.s.01", "black": "black.a.01", "white": "white.a.01",
    "circle": "circle.n.01", "square": "square.n.01", "triangle": "triangle.n.01", "star": "star.n.05",
    "cross": "crisscross.n.01", "diamond": "rhombus.n.01", "hexagon": "hexagon.n.01", "ring": "ring.n.02",
}
INVERSE = {"to the left of": "to the right of", "to the right of": "to the left of", "above": "below",
           "below": "above"}
PREFIXES = ("there is ", "we can see ", "a photo of ", "an image showing ", "")
LOCATIONS = {"in the center": "in the middle", "in the middle": "in the center", " of the picture": "",
             "on a gray background": "against a grey backdrop"}


def synonyms() -> dict[str, list[str]]:
    """Each word of SENSES → the other lemmas of its sense, read from WordNet 3.0. A lemma that contains the word
    itself ("dark-green", "cherry-red") names a narrower colour, not the same one, and is left out."""
    from rayvl.data.wordnet import wordnet

    wn = wordnet()
    out = {}
    for word, sense in SENSES.items():
        lemmas = [lemma.name().replace("_", " ") for lemma in wn.synset(sense).lemmas()]
        out[word] = [x for x in dict.fromkeys(lemmas) if word not in x]
    return out


def _split_prefix(text: str) -> tuple[str, str]:
    for prefix in ("there is ", "a picture of ", "a picture with "):
        if text.startswith(prefix):
            return prefix, text[len(prefix):]
    return "", text


def _reorder(core: str, rng: np.random.Generator) -> str:
    """Relations swapped with their inverse; list items permuted ("A, B and C" → "C, A and B")."""
    for rel, inverse in INVERSE.items():
        head, sep, tail = core.partition(f" {rel} ")
        if sep:
            return f"{tail} {inverse} {head}"
    if " and " in core:
        head, _, last = core.rpartition(" and ")
        items = head.split(", ") + [last]
        order = rng.permutation(len(items))
        while len(items) > 1 and list(order) == list(range(len(items))):
            order = rng.permutation(len(items))
        items = [items[i] for i in order]
        return f"{', '.join(items[:-1])} and {items[-1]}"
    return core


def _articles(text: str) -> str:
    """'a'/'an' agree with the word after them again once a synonym replaced it."""
    return re.sub(r"\b(a|an) (\w)", lambda m: ("an " if m.group(2) in "aeiou" else "a ") + m.group(2), text)


def rephrase(caption: str, rng: np.random.Generator, lexicon: dict[str, list[str]]) -> str:
    """One paraphrase of a demo caption; never the caption itself."""
    for _ in range(20):
        prefix, core = _split_prefix(caption)
        if rng.random() < 0.7:
            core = _reorder(core, rng)
        for old, new in LOCATIONS.items():
            if old in core and rng.random() < 0.5:
                core = core.replace(old, new)
        words = [w if not lexicon.get(w) or rng.random() < 0.5 else str(rng.choice(lexicon[w]))
                 for w in core.split(" ")]
        if rng.random() < 0.25:  # telegraphic: articles dropped
            words = [w for w in words if w not in ("a", "an")]
        if prefix == "a picture with ":
            prefix = "a picture with " if rng.random() < 0.5 else "an image containing "
        else:
            prefix = str(rng.choice(PREFIXES))
        text = _articles(prefix + " ".join(words))
        if text != caption:
            return text
    raise ValueError(f"no paraphrase of {caption!r}")


def paraphrase_set(held_out_captions: list[str], scene_captions: list[str], seed: int,
                   expansions: int = 3) -> list[dict]:
    """Rows {caption, paraphrase, expansions}: the paraphrase is what AO@k / JS@k compare the caption with; the
    expansions are further paraphrases for the query-expansion baseline ([Paraphrase] §5.2)."""
    rng, lexicon = np.random.default_rng(seed), synonyms()
    return [{"caption": c, "paraphrase": rephrase(c, rng, lexicon),
             "expansions": [rephrase(c, rng, lexicon) for _ in range(expansions)]}
            for c in held_out_captions + scene_captions]
