"""Evaluation sets: images (an in-memory array, a Ray Dataset with an ``index`` column 0..N-1, or the batches of a
local loader read without Ray: rayvl.eval.local_read) in key order,
what is known about them (class labels, captions), and the text sets evaluated beside them (class names and
templates, paraphrase pairs, STS pairs).

Kinds: img2dataset shards (the demo's held-out split, LAION/COCO-style shards with captions and an optional ``cls``
in the JSON), ImageFolder trees (one folder per class), and Fashion-MNIST IDX files. Rows are ordered by sample key
in every path, so training-time and ``rayvl eval`` evaluation rank the same gallery in the same order.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import ray

from rayvl.data import fashion_mnist
from rayvl.data.images import decode_and_crop
from rayvl.data.prompts import DEFAULT_TEMPLATES, read_class_file, templates
from rayvl.data.pipeline import DIGEST, LABEL_SET, Rows, image_column_names
from rayvl.data.shard_read import readers_per_shard
from rayvl.data.shards import Reading, read_shards
from rayvl.data.specs import resolve_shards
from rayvl.eval import local_read
from rayvl.eval.linear_probe import ProbeTrain
from rayvl.eval.sts import read_sts

# torchvision's ImageFolder's (datasets.folder.IMG_EXTENSIONS), which CLIP_benchmark reads such trees with
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class EvalData:
    # uint8 [N, 3, S, S]; or a Dataset with columns index, image[, cls]; or streamed shards (load_shards), or a local
    # loader's batches (local_*), whose size and row fields may be 0 and empty until their rows are read (with_rows)
    images: np.ndarray | ray.data.Dataset | local_read.Batches
    size: int
    labels: np.ndarray  # class id per image (-1 unknown)
    classes: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    caption_to_image: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # into ``gallery``
    # retrieval's images: the row of each distinct image, in key order (empty: every row)
    gallery: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    keys: list[str] = field(default_factory=list)
    paraphrases: list[dict] = field(default_factory=list)  # {caption, paraphrase[, expansions]}
    sts: tuple[list[str], list[str], np.ndarray] | None = None  # (sentences 1, sentences 2, gold scores)
    probe: ProbeTrain | None = None  # a train split for the linear probe (CLIP_benchmark's protocol)
    # a multilabel set's (CLIP_benchmark's npy members): each image's class ids, None where unknown; empty: no image
    # has a label set (a set of one class an image, or none)
    label_sets: list[list[int] | None] = field(default_factory=list)

    def with_text_sets(self, classes: str = "", paraphrases: str = "", sts: str = "") -> "EvalData":
        """The same images with the class list, paraphrase pairs and STS pairs of these files ('' = keep)."""
        out = replace(self)
        if classes:
            out.classes, out.templates = read_class_file(classes)
        if paraphrases:
            out.paraphrases = read_paraphrases(paraphrases)
        if sts:
            out.sts = read_sts(sts)
        return out

    def with_rows(self, rows: dict) -> "EvalData":
        """The set whose rows, in order, are ``rows``: shards' (key, caption, cls, image digest[, label set]:
        one label per sample, in key order), or an image set's read as a stream (index and cls). Retrieval's captions
        are the lines of each row's caption, and its gallery the distinct images: rows of one digest — one photo
        under several keys, as COCO-style shards hold an image's captions — are one image, whose captions are all
        theirs (CLIP_benchmark's: a query is right when any of its image's captions, or its image, is in the top k)."""
        n = len(rows["cls"])
        if "key" not in rows:
            return replace(self, size=n, labels=np.asarray(rows["cls"], np.int64))
        digests = np.asarray(rows[DIGEST], np.int64) if DIGEST in rows else np.arange(n)
        _, first, image_of_row = np.unique(digests, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # the distinct images in the order of their first row
        position = np.empty(len(first), np.int64)
        position[order] = np.arange(len(first))
        lines = [str(c).split("\n") if c else [] for c in rows["caption"]]  # none: a classification set's image
        caption_to_image = np.repeat(position[image_of_row.reshape(-1)], [len(x) for x in lines])
        sets = [json.loads(s) if s else None for s in rows[LABEL_SET]] if LABEL_SET in rows else []
        return replace(self, size=n, labels=np.asarray(rows["cls"], np.int64),
                       label_sets=sets if any(s is not None for s in sets) else [],
                       captions=[line for x in lines for line in x], caption_to_image=caption_to_image,
                       gallery=first[order], keys=[str(k) for k in rows["key"]])

    @property
    def multilabel(self) -> bool:
        """Whether the images carry label sets (several classes each) rather than one class id."""
        return bool(self.label_sets)

    def labelled(self) -> bool:
        """Whether any image has a known class (or label set)."""
        return self.multilabel or bool((self.labels >= 0).any())

    def retrieval_images(self) -> np.ndarray:
        """The rows of retrieval's gallery (every row where no digests grouped them)."""
        return self.gallery if len(self.gallery) else np.arange(self.size)

    def captioned(self) -> tuple[np.ndarray, np.ndarray]:
        """(the rows of retrieval's images that have a caption, in gallery order; each caption's index into them):
        what retrieval searches — an image kept for the class tasks without a caption is no query and no target."""
        with_captions = np.unique(self.caption_to_image)
        position = np.full(len(self.retrieval_images()), -1, np.int64)
        position[with_captions] = np.arange(len(with_captions))
        return self.retrieval_images()[with_captions], position[self.caption_to_image]

    def head(self, n: int) -> "EvalData":
        """The first n distinct images that have captions, with all their captions, in memory: a quick held-out check
        whose gallery is n images however many samples or caption lines each has (TOnICS's refresh reads its R@1
        against a threshold)."""
        rows, caption_to_image = self.captioned()
        chosen, keep = rows[:n], caption_to_image < n
        captions = [c for c, k in zip(self.captions, keep) if k]
        return EvalData(self.images[chosen], len(chosen), self.labels[chosen], captions=captions,
                        caption_to_image=caption_to_image[keep], gallery=np.arange(len(chosen)),
                        keys=[self.keys[i] for i in chosen] if self.keys else [])


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


def from_batches(batches: list[dict]) -> EvalData:
    """In memory, from numpy batches of preprocessed shard rows (key, caption, image, cls), in key order."""
    cols = {c: np.concatenate([b[c] for b in batches]) for c in ("key", "caption", "image", "cls", DIGEST, LABEL_SET)
            if c in batches[0]}
    order = np.argsort(cols["key"].astype(str), kind="stable")
    return EvalData(cols["image"][order], 0, np.zeros(0, np.int64)).with_rows({c: cols[c][order] for c in cols})


SHARD_COLUMNS = ["key", "caption", "cls", DIGEST]  # and the image's (pipeline.image_column_names)


def shard_columns(decode: str, label_vectors: int) -> list[str]:
    """The columns an evaluation reads of shard rows: SHARD_COLUMNS, a multilabel set's label sets, the image's."""
    return SHARD_COLUMNS + ([LABEL_SET] if label_vectors else []) + image_column_names(decode)


def load_shards(spec: str, image_size: int, tokenizer_path: str, max_tokens: int, read_cpus: float,
                report_name: str | None = None, threads: int = 1, batch_size: int = 64,
                decode: str = "cpu", label_vectors: int = 0) -> EvalData:
    """The held-out shards as a stream of rows (columns key, caption, cls and the image: decoded, or for
    ``decode`` "device" a JPEG's bytes and box), read as they are embedded and never held whole: its size,
    labels, captions and keys come with the rows' embeddings (``with_rows``), in blocks of ``batch_size`` rows.
    Fewer shards than the cluster's CPUs hold read tasks are read by several tasks each
    (``shard_read.readers_per_shard``). Dropped samples are counted in the DataReport ``report_name`` (created by
    the caller). ``label_vectors``: a multilabel set's class count (pipeline.Rows.label_vectors)."""
    paths = resolve_shards(spec)
    readers = readers_per_shard(paths, read_cpus, ray.cluster_resources().get("CPU", 1.0))
    reading = Reading(read_cpus=read_cpus, batch_size=batch_size, threads=threads, report_name=report_name,
                      readers_per_shard=readers)
    rows = Rows(image_size, 1.0, False, tokenizer_path, max_tokens, decode=decode, label_vectors=label_vectors)
    ds = read_shards(paths, rows, reading, shard_columns(decode, label_vectors))
    return EvalData(ds, 0, np.zeros(0, np.int64))


def local_shards(spec: str, image_size: int, tokenizer_path: str, max_tokens: int, workers: int = 0,
                 batch_size: int = 64, decode: str = "cpu", label_vectors: int = 0) -> EvalData:
    """``load_shards`` without Ray: the held-out shards streamed by a local loader's ``workers`` processes
    (rayvl.eval.local_read; 0 = CPUs − 1, one thread each: the processes fill the CPUs), the samples they drop
    counted in ``images.counts``."""
    rows = Rows(image_size, 1.0, False, tokenizer_path, max_tokens, decode=decode, label_vectors=label_vectors)
    reading = Reading(batch_size=batch_size)
    images = local_read.shard_batches(resolve_shards(spec), rows, reading, shard_columns(decode, label_vectors),
                                      workers)
    return EvalData(images, 0, np.zeros(0, np.int64))


def local_imagefolder(root: str, image_size: int, workers: int = 0, batch_size: int = 64) -> EvalData:
    """``load_imagefolder`` without Ray: the images read and decoded by a local loader's ``workers`` processes as
    they are embedded; the labels and size come with the rows (``with_rows``), undecodable files dropped."""
    classes, files, labels = _imagefolder_files(root)
    columns = {"index": np.arange(len(files)), "path": np.array(files, dtype=object), "cls": labels}
    images = local_read.Batches(
        local_read.ListBatches(columns, batch_size, partial(_read_and_decode, image_size=image_size)),
        local_read.loader_workers(workers), batch_size * 3 * image_size ** 2)
    return EvalData(images, 0, np.zeros(0, np.int64), [c.replace("_", " ") for c in classes],
                    list(templates(DEFAULT_TEMPLATES)))


def local_fashion_mnist(root: str, image_size: int, workers: int = 0, batch_size: int = 64, split: str = "t10k",
                        limit: int = 0) -> EvalData:
    """``load_fashion_mnist`` without Ray: the images made RGB by a local loader's ``workers`` processes."""
    pixels, labels = fashion_mnist.read(root, split, limit)
    columns = {"index": np.arange(len(labels)), "pixels": pixels, "cls": labels}
    images = local_read.Batches(
        local_read.ListBatches(columns, batch_size, partial(_to_rgb, image_size=image_size)),
        local_read.loader_workers(workers), batch_size * 3 * image_size ** 2)
    return EvalData(images, len(labels), labels, list(fashion_mnist.CLASSES), list(templates(DEFAULT_TEMPLATES)))


def _read_and_decode(batch: dict, image_size: int) -> dict:
    out = _decode_files(_read_files(batch), image_size)
    dropped = len(batch["index"]) - len(out["index"])
    return {**out, local_read.COUNTS: {"dropped_corrupt_image": dropped} if dropped else {}}


def _decode_files(batch: dict, image_size: int) -> dict:
    images, cls, index = [], [], []
    for i, data in enumerate(batch["bytes"]):
        img = decode_and_crop(data, image_size, None)
        if img is None:
            continue
        images.append(img)
        cls.append(batch["cls"][i])
        index.append(batch["index"][i])
    return {"index": np.array(index, np.int64), "image": np.stack(images) if images else
            np.zeros((0, 3, image_size, image_size), np.uint8), "cls": np.array(cls, np.int64)}


def _imagefolder_files(root: str) -> tuple[list[str], list[str], np.ndarray]:
    """(the class folders' names, sorted; every image file under each, in its subfolders too; each file's class) as
    torchvision's ImageFolder lists them (``make_dataset``: class by class, ``os.walk`` sorted, following links,
    files by extension). Files of other extensions are left out and said, never silently."""
    root_path = Path(root).expanduser()
    classes = sorted(d.name for d in os.scandir(root_path) if d.is_dir())
    files, labels, other = [], [], 0
    for i, c in enumerate(classes):
        for folder, _, names in sorted(os.walk(root_path / c, followlinks=True)):
            for name in sorted(names):
                if name.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(os.path.join(folder, name))
                    labels.append(i)
                else:
                    other += 1
    if not files:
        raise ValueError(f"{root}: no images in class folders")
    if other:
        print(f"rayvl eval: left out {other} files under {root} whose extension is not an image's "
              f"({' '.join(IMAGE_EXTENSIONS)}, as torchvision's ImageFolder)")
    return classes, files, np.array(labels, np.int64)


def load_imagefolder(root: str, image_size: int, read_cpus: float) -> EvalData:
    classes, files, file_labels = _imagefolder_files(root)
    paths = ray.data.from_items([{"index": i, "path": f, "cls": int(c)} for i, (f, c) in enumerate(zip(files,
                                                                                                      file_labels))])
    ds = paths.map_batches(_read_files, batch_format="numpy", num_cpus=read_cpus).map_batches(
        _decode_files, fn_kwargs={"image_size": image_size}, batch_format="numpy", num_cpus=read_cpus).materialize()
    labels = np.full(len(files), -1, np.int64)
    for row in ds.select_columns(["index", "cls"]).take_all():
        labels[row["index"]] = row["cls"]
    kept = labels >= 0  # undecodable files were dropped by _decode_files; keep indices dense
    if not kept.all():
        remap = -np.ones(len(files), np.int64)
        remap[kept] = np.arange(kept.sum())
        ds = ds.map_batches(lambda b: {**b, "index": remap[b["index"]]}, batch_format="numpy")
        print(f"rayvl eval: dropped {int((~kept).sum())} undecodable images under {root}")
    return EvalData(ds, int(kept.sum()), labels[kept], [c.replace("_", " ") for c in classes],
                    list(templates(DEFAULT_TEMPLATES)))


def _read_files(batch: dict) -> dict:
    return {"index": batch["index"], "path": batch["path"], "cls": batch["cls"],
            "bytes": np.array([Path(p).read_bytes() for p in batch["path"]], dtype=object)}


def _to_rgb(batch: dict, image_size: int) -> dict:
    images = np.stack([fashion_mnist.to_rgb(p, image_size) for p in batch["pixels"]])
    return {"index": batch["index"], "image": images, "cls": batch["cls"]}


def load_fashion_mnist(root: str, image_size: int, read_cpus: float, split: str = "t10k",
                       limit: int = 0) -> EvalData:
    pixels, labels = fashion_mnist.read(root, split, limit)
    ds = fashion_mnist.rows(pixels, labels, split).map_batches(_to_rgb, fn_kwargs={"image_size": image_size},
                                                               batch_format="numpy", num_cpus=read_cpus)
    return EvalData(ds, len(labels), labels, list(fashion_mnist.CLASSES), list(templates(DEFAULT_TEMPLATES)))


def read_paraphrases(path: str | Path) -> list[dict]:
    """JSON lines with caption, paraphrase and optional expansions (the demo writes them; COCO-P has the same
    shape)."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("caption") and r.get("paraphrase")]
