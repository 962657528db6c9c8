"""Class prompts: the one source of prompt templates, and image-label data as (image, prompt, class id) ([UniCL] §3,
Algorithm 1, App. B.2).

Templates are named sets in ``rayvl/resources/prompt_templates.json``: ``clip_imagenet`` (CLIP's 80 ImageNet
templates), ``clip_imagenet_short`` (six of them, for evaluation sets that bring none) and ``demo_shapes`` (the
embedded demo's). At train time each image-label sample draws one template filled with its class name; at
evaluation all templates of a class are averaged (``rayvl.eval.tasks``). ``train_classes`` keeps a subset of the
classes for training (the rest stay unseen, for zero-shot on held-out classes); excluded samples are counted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

TEMPLATES_FILE = Path(__file__).resolve().parent.parent / "resources" / "prompt_templates.json"


@lru_cache(maxsize=None)
def templates(name: str = "clip_imagenet") -> tuple[str, ...]:
    sets = json.loads(TEMPLATES_FILE.read_text())
    if name not in sets:
        raise ValueError(f"no template set {name!r} (known: {', '.join(sets)})")
    return tuple(sets[name]["templates"])


@dataclass(frozen=True)
class Prompts:
    """Class names (index = class id), prompt templates, and the class ids used for training."""

    classes: tuple[str, ...]
    templates: tuple[str, ...]
    train_classes: frozenset[int]

    def caption(self, cls: int, rng: np.random.Generator) -> str:
        """One prompt per sample, the template drawn at random ([UniCL]: label → text prompt)."""
        return self.templates[int(rng.integers(len(self.templates)))].format(self.classes[cls])


def read_class_file(path: str | Path, default_templates: str = "clip_imagenet_short") -> tuple[list[str], list[str]]:
    """(class names, templates) of a JSON file {"classes": [...], "templates": [...]} (or a bare list of names);
    a file without templates gets the named default set."""
    raw = json.loads(Path(path).expanduser().read_text())
    classes = raw["classes"] if isinstance(raw, dict) else raw
    given = raw.get("templates") if isinstance(raw, dict) else None
    return list(classes), list(given or templates(default_templates))


def load_prompts(classes_file: str, templates_file: str, train_classes: list[int],
                 default_classes: list[str] | None = None) -> Prompts:
    classes = read_class_file(classes_file)[0] if classes_file else default_classes
    if not classes:
        raise ValueError("image_label.classes: a class-name list is needed (JSON {\"classes\": [...]})")
    chosen = templates("clip_imagenet")
    if templates_file:
        raw = json.loads(Path(templates_file).expanduser().read_text())
        chosen = tuple(raw["templates"] if isinstance(raw, dict) else raw)
    bad = [c for c in train_classes if not 0 <= c < len(classes)]
    if bad:
        raise ValueError(f"image_label.train_classes: {bad} are not class ids 0..{len(classes) - 1}")
    return Prompts(tuple(classes), chosen, frozenset(train_classes or range(len(classes))))
