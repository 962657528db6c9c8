"""Image-label data as (image, prompt, class id) ([UniCL] §3, Algorithm 1, App. B.2): at train time each image-label
sample draws one template (rayvl.data.prompts) filled with its class name. ``train_classes`` keeps a subset of the
classes for training (the rest stay unseen, for zero-shot on held-out classes); excluded samples are counted."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayvl.data.prompts import read_class_file, templates


@dataclass(frozen=True)
class Prompts:
    """Class names (index = class id), prompt templates, and the class ids used for training."""

    classes: tuple[str, ...]
    templates: tuple[str, ...]
    train_classes: frozenset[int]

    def caption(self, cls: int, rng: np.random.Generator) -> str:
        """One prompt per sample, the template drawn at random ([UniCL]: label → text prompt)."""
        return self.templates[int(rng.integers(len(self.templates)))].format(self.classes[cls])


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
