"""Image-label sources for UniCL (seed unicl-image-text-label §3, Algorithm 1, App. B.2).

Classification data enters the image-text-label space as (image, prompt, class id): at train time each sample
draws one of CLIP's 80 ImageNet prompt templates (shipped as data, rayvl/resources/clip_templates.json) filled with
its class name; at evaluation all templates are averaged (rayvl.eval.zeroshot). Two readers:

- img2dataset-style shards whose JSON carries a ``cls`` field (the shard reader, ``prompts`` mode), and
- Fashion-MNIST IDX files from the Debian ``dataset-fashion-mnist`` package (real photos, 10 classes).

``train_classes`` keeps a subset of the classes for training (the rest stay unseen, for zero-shot on held-out
classes); excluded samples are counted, not silently lost.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from rayvl.data.images import crop
from rayvl.data.text import tokenize

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
FASHION_MNIST_CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                         "ankle boot"]


@lru_cache(maxsize=1)
def clip_templates() -> tuple[str, ...]:
    return tuple(json.loads((RESOURCES / "clip_templates.json").read_text())["templates"])


@dataclass(frozen=True)
class Prompts:
    """Class names (index = class id), prompt templates, and the class ids used for training."""

    classes: tuple[str, ...]
    templates: tuple[str, ...]
    train_classes: frozenset[int]

    def caption(self, cls: int, rng: np.random.Generator) -> str:
        """One prompt per sample, the template drawn at random (seed unicl: label → text prompt)."""
        return self.templates[int(rng.integers(len(self.templates)))].format(self.classes[cls])


def load_prompts(classes_file: str, templates_file: str, train_classes: list[int],
                 default_classes: list[str] | None = None) -> Prompts:
    classes = default_classes
    if classes_file:
        raw = json.loads(Path(classes_file).expanduser().read_text())
        classes = raw["classes"] if isinstance(raw, dict) else raw
    if not classes:
        raise ValueError("image_label.classes: a class-name list is needed (JSON {\"classes\": [...]})")
    templates = clip_templates()
    if templates_file:
        raw = json.loads(Path(templates_file).expanduser().read_text())
        templates = tuple(raw["templates"] if isinstance(raw, dict) else raw)
    bad = [c for c in train_classes if not 0 <= c < len(classes)]
    if bad:
        raise ValueError(f"image_label.train_classes: {bad} are not class ids 0..{len(classes) - 1}")
    return Prompts(tuple(classes), templates, frozenset(train_classes or range(len(classes))))


def is_fashion_mnist(spec: str) -> bool:
    return spec == "fashion-mnist" or (Path(spec).expanduser().is_dir()
                                       and any(Path(spec).expanduser().glob("*-images-idx3-ubyte*")))


def fashion_mnist_rows(spec: str, split: str = "train", limit: int = 0):
    """Fashion-MNIST as a Ray Dataset of rows {key, pixels (28×28 uint8), cls}."""
    import ray

    from rayvl import assets

    root = assets.fashion_mnist_dir() if spec == "fashion-mnist" else Path(spec).expanduser()
    if root is None:
        raise FileNotFoundError("Fashion-MNIST is not installed: run `rayvl assets fetch` (Debian "
                                "dataset-fashion-mnist)")

    def find(stem):
        return next(p for p in (root / f"{stem}.gz", root / stem) if p.exists())

    pixels = assets.read_idx(find(f"{split}-images-idx3-ubyte"))
    labels = assets.read_idx(find(f"{split}-labels-idx1-ubyte")).astype(np.int64)
    if limit:
        pixels, labels = pixels[:limit], labels[:limit]
    return ray.data.from_items([{"key": f"fmnist-{split}-{i:05d}", "pixels": pixels[i], "cls": int(labels[i])}
                                for i in range(len(labels))])


def prompt_batch(batch: dict, *, prompts: Prompts, image_size: int, crop_scale_min: float, tokenizer_path: str,
                 max_tokens: int, report_name: str | None) -> dict:
    """Fashion-MNIST rows → model inputs with a drawn prompt as caption and the class id as UniCL label."""
    from PIL import Image

    from rayvl.data.shards import _send

    rng = np.random.default_rng()
    counts: Counter = Counter()
    images, captions, labels, keys = [], [], [], []
    for key, pixels, cls in zip(batch["key"], batch["pixels"], batch["cls"]):
        cls = int(cls)
        if cls not in prompts.train_classes:
            counts["excluded_held_out_class"] += 1
            continue
        img = Image.fromarray(np.asarray(pixels, np.uint8), "L").convert("RGB")
        images.append(crop(img, image_size, crop_scale_min, rng))
        captions.append(prompts.caption(cls, rng))
        labels.append(cls)
        keys.append(key)
    _send(report_name, {"samples_seen": len(batch["key"]), "samples_kept": len(keys), **counts})
    ids, mask = tokenize(captions, tokenizer_path, max_tokens)
    return {"image": np.stack(images) if images else np.zeros((0, 3, image_size, image_size), np.uint8),
            "input_ids": ids, "attention_mask": mask, "label": np.array(labels, dtype=np.int64),
            "key": np.array(keys, dtype=object), "caption": np.array(captions, dtype=object)}
