"""Evaluation sets as Ray Datasets with an ``index`` column (0..N-1, a stable order), plus their small metadata.

Kinds: img2dataset shards (the demo's held-out split, LAION/COCO-style shards with captions and an optional ``cls``
in the JSON), ImageFolder trees (one folder per class), and Fashion-MNIST IDX files.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
from PIL import Image

from rayvl import assets
from rayvl.data import shards
from rayvl.data.images import decode_and_crop
from rayvl.data.labeled import FASHION_MNIST_CLASSES

# a short subset of CLIP's ImageNet templates, used when a dataset brings none
DEFAULT_TEMPLATES = ["a photo of a {}.", "a bad photo of a {}.", "a photo of the {}.", "a close-up photo of a {}.",
                     "a black and white photo of a {}.", "a low resolution photo of a {}."]
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


@dataclass
class EvalImages:
    """Images (as a Ray Dataset of uint8 crops) and what is known about them."""

    images: ray.data.Dataset  # columns: index, image[, cls]
    size: int
    labels: np.ndarray  # class id per image (-1 unknown)
    classes: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    caption_to_image: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    keys: list[str] = field(default_factory=list)


def detect_kind(spec: str) -> str:
    path = Path(spec).expanduser()
    if path.is_dir() and any(p.name.endswith("-idx3-ubyte.gz") or p.name.endswith("-idx3-ubyte")
                             for p in path.iterdir()):
        return "fashion-mnist"
    if spec.endswith(".tar") or "*" in spec or "://" in spec or (path.is_dir() and any(path.glob("*.tar"))):
        return "shards"
    if path.is_dir():
        return "imagefolder"
    raise ValueError(f"--data {spec!r}: not a shard directory/glob, an ImageFolder tree or Fashion-MNIST IDX files")


def _add_index(batch: dict, index_of: dict) -> dict:
    batch["index"] = np.array([index_of[k] for k in batch["key"]], dtype=np.int64)
    return batch


def load_shards(spec: str, image_size: int, tokenizer_path: str, max_tokens: int, read_cpus: float,
                report_name: str | None = None) -> EvalImages:
    """Dropped samples are counted in the DataReport ``report_name`` (created by the caller)."""
    ds = shards.read_shards(spec, image_size=image_size, crop_scale_min=1.0, train=False,
                            tokenizer_path=tokenizer_path, max_tokens=max_tokens, read_cpus=read_cpus,
                            transform_batch_size=64, shuffle_files=False, report_name=report_name).materialize()
    meta = sorted(ds.select_columns(["key", "caption", "cls"]).take_all(), key=lambda r: r["key"])
    index_of = {r["key"]: i for i, r in enumerate(meta)}
    images = ds.map_batches(_add_index, fn_kwargs={"index_of": index_of}, batch_format="numpy",
                            num_cpus=read_cpus).select_columns(["index", "image", "cls"])
    return EvalImages(images, len(meta), np.array([r["cls"] for r in meta], np.int64),
                      captions=[r["caption"] for r in meta], caption_to_image=np.arange(len(meta)),
                      keys=[r["key"] for r in meta])


def _decode_files(batch: dict, image_size: int, class_of: dict) -> dict:
    images, cls, index = [], [], []
    for i, (path, data) in enumerate(zip(batch["path"], batch["bytes"])):
        img = decode_and_crop(data, image_size, None)
        if img is None:
            continue
        images.append(img)
        cls.append(class_of[os.path.basename(os.path.dirname(path))])
        index.append(batch["index"][i])
    return {"index": np.array(index, np.int64), "image": np.stack(images) if images else
            np.zeros((0, 3, image_size, image_size), np.uint8), "cls": np.array(cls, np.int64)}


def load_imagefolder(root: str, image_size: int, read_cpus: float) -> EvalImages:
    root_path = Path(root).expanduser()
    classes = sorted(d.name for d in root_path.iterdir() if d.is_dir())
    files = sorted(str(p) for c in classes for p in (root_path / c).iterdir()
                   if p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise ValueError(f"{root}: no images in class folders")
    class_of = {c: i for i, c in enumerate(classes)}
    paths = ray.data.from_items([{"index": i, "path": f} for i, f in enumerate(files)])
    ds = paths.map_batches(_read_files, batch_format="numpy", num_cpus=read_cpus).map_batches(
        _decode_files, fn_kwargs={"image_size": image_size, "class_of": class_of}, batch_format="numpy",
        num_cpus=read_cpus).materialize()
    labels = np.full(len(files), -1, np.int64)
    for row in ds.select_columns(["index", "cls"]).take_all():
        labels[row["index"]] = row["cls"]
    kept = labels >= 0  # undecodable files were dropped by _decode_files; keep indices dense
    if not kept.all():
        remap = -np.ones(len(files), np.int64)
        remap[kept] = np.arange(kept.sum())
        ds = ds.map_batches(lambda b: {**b, "index": remap[b["index"]]}, batch_format="numpy")
        print(f"rayvl eval: dropped {int((~kept).sum())} undecodable images under {root}")
    return EvalImages(ds, int(kept.sum()), labels[kept], [c.replace("_", " ") for c in classes], DEFAULT_TEMPLATES)


def _read_files(batch: dict) -> dict:
    return {"index": batch["index"], "path": batch["path"],
            "bytes": np.array([Path(p).read_bytes() for p in batch["path"]], dtype=object)}


def _gray_to_rgb(batch: dict, image_size: int) -> dict:
    out = []
    for img in batch["pixels"]:
        pil = Image.fromarray(img.astype(np.uint8), "L").convert("RGB").resize((image_size, image_size),
                                                                               Image.BICUBIC)
        out.append(np.asarray(pil, np.uint8).transpose(2, 0, 1))
    return {"index": batch["index"], "image": np.stack(out), "cls": batch["cls"]}


def load_fashion_mnist(root: str, image_size: int, read_cpus: float, split: str = "t10k",
                       limit: int = 0) -> EvalImages:
    root_path = Path(root).expanduser()

    def find(stem):
        for name in (f"{stem}.gz", stem):
            if (root_path / name).exists():
                return root_path / name
        raise FileNotFoundError(f"{root_path / stem}(.gz) not found")

    pixels = assets.read_idx(find(f"{split}-images-idx3-ubyte"))
    labels = assets.read_idx(find(f"{split}-labels-idx1-ubyte")).astype(np.int64)
    if limit:
        pixels, labels = pixels[:limit], labels[:limit]
    rows = [{"index": i, "pixels": pixels[i], "cls": int(labels[i])} for i in range(len(labels))]
    ds = ray.data.from_items(rows).map_batches(_gray_to_rgb, fn_kwargs={"image_size": image_size},
                                               batch_format="numpy", num_cpus=read_cpus)
    return EvalImages(ds, len(labels), labels, FASHION_MNIST_CLASSES, DEFAULT_TEMPLATES)


def read_paraphrases(path: str | Path) -> list[dict]:
    """JSON lines with caption, paraphrase and optional expansions (the demo writes them; COCO-P has the same
    shape)."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("caption") and r.get("paraphrase")]
