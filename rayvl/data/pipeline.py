"""The per-sample pipeline: raw rows → model inputs, inside Ray Data's read tasks (shards) or ``map_batches``
(Fashion-MNIST).

Bad samples are dropped here and counted by reason: shard rows into the read task's counts, which
``shards.ShardStream`` records in the run's data report once per shard; Fashion-MNIST rows in the report directly
(``report.record``), before the batch they came from is emitted. Two row kinds: img2dataset shard rows
(``preprocess``; optionally BoW-deformed, expanded to one row per aligned class for TOnICS, or turned into class
prompts for image-label shards) and Fashion-MNIST rows (``prompt_batch``).
"""
from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from rayvl.data import fashion_mnist
from rayvl.data.images import decode_and_crop
from rayvl.data.position import unit_of
from rayvl.data.report import current_token, record
from rayvl.data.seeding import row_rng
from rayvl.data.text import PSEUDO_FLAG, tokenize, validate_caption

if TYPE_CHECKING:
    from rayvl.data.bow import Deformer
    from rayvl.data.ontology import Ontology
    from rayvl.data.prompts import Prompts


def preprocess(batch: dict, *, counts: Counter, image_size: int, crop_scale_min: float, train: bool,
               tokenizer_path: str, max_tokens: int, bow: Deformer | None = None, ontology: Ontology | None = None,
               prompts: Prompts | None = None, seed: int = 0) -> dict:
    """Shard rows → model inputs; samples seen, kept and dropped (by reason) and caption statistics (words of kept
    captions, BoW counts) are added to ``counts``. A row's crop and prompt are drawn from (``seed``, its key, the
    pass of its row id) alone (data/seeding.py).
    With ``bow`` the caption is deformed ([BoW] §2.2) before the image is decoded and before tokenisation;
    a caption the cascade empties drops its sample (counted as dropped_bow_empty, as the paper removes them).
    With ``prompts`` the shards are image-label data ([UniCL]): the JSON ``cls`` is the label and the caption is
    a prompt drawn for that class; classes outside ``prompts.train_classes`` are excluded and counted."""
    rows: list[tuple] = []
    ids = batch.get("row", np.full(len(batch["key"]), -1))  # data/position.py
    passes = unit_of(np.asarray(ids, dtype=np.int64))[0]
    for key, jpg, txt, meta, row, pass_ in zip(batch["key"], batch["jpg"], batch["txt"], batch["json"], ids, passes):
        rng = row_rng(seed, key, pass_) if train or prompts is not None else None
        info = _meta(meta)
        cls = _cls(info)
        text, reason = _prompt_for(cls, prompts, rng) if prompts is not None else validate_caption(txt)
        if not reason and bow is not None:
            if info.get(PSEUDO_FLAG) is True:  # already a BoW caption (rayvl.pseudo_label): trained as it is
                counts["pseudo_bow_captions"] += 1
            else:
                text, reason = _deform(bow, key, text, counts)
        image = None
        if not reason:
            image, reason = _image(jpg, image_size, crop_scale_min if train else None, rng)
        if reason:
            counts[reason] += 1
            continue
        counts["caption_words"] += len(text.split())
        # TOnICS: one training row per (pair, aligned class), [TOnICS] App. A.1; a pair without one is a
        # single root-only row (object −1)
        row_objects = ontology.row_objects(text, meta) if ontology is not None else [-1]
        if ontology is not None and row_objects == [-1]:
            counts["tonics_unaligned_pairs"] += 1
        rows += [(image, text, key, cls, obj, row) for obj in row_objects]
    images, captions, keys, classes, objects, ids = (list(c) for c in zip(*rows)) if rows else ([],) * 6
    if ontology is not None:
        counts["tonics_rows"] += len(keys)
    kept = len(set(keys)) if ontology is not None else len(keys)
    counts.update({"samples_seen": len(batch["key"]), "samples_kept": kept})
    # [UniCL] Algorithm 1: the label of an image-label row is its class id, −1 for an image-text pair (the
    # training loop gives each of those a unique label)
    labels = classes if prompts is not None else [-1] * len(classes)
    return {**_model_inputs(images, captions, labels, keys, image_size, tokenizer_path, max_tokens),
            "cls": np.array(classes, dtype=np.int64), "object": np.array(objects, dtype=np.int64),
            "row": np.array(ids, dtype=np.int64)}


def prompt_batch(batch: dict, *, prompts: Prompts, image_size: int, crop_scale_min: float, tokenizer_path: str,
                 max_tokens: int, report_name: str | None, seed: int = 0) -> dict:
    """Fashion-MNIST rows → model inputs with a drawn prompt as caption and the class id as UniCL label; a row's
    crop and prompt are drawn from (``seed``, its key, its ``pass`` column, 0 without one) alone."""
    token = current_token(report_name)  # the worker group this batch counts for, asked before it is made
    counts: Counter = Counter()
    images, captions, labels, keys = [], [], [], []
    passes = batch.get("pass", np.zeros(len(batch["key"]), np.int64))
    for key, pixels, cls, pass_ in zip(batch["key"], batch["pixels"], batch["cls"], passes):
        cls = int(cls)
        if cls not in prompts.train_classes:
            counts["excluded_held_out_class"] += 1
            continue
        rng = row_rng(seed, key, pass_)
        images.append(fashion_mnist.to_rgb(pixels, image_size, crop_scale_min, rng))
        captions.append(prompts.caption(cls, rng))
        labels.append(cls)
        keys.append(key)
    record(report_name, {"samples_seen": len(batch["key"]), "samples_kept": len(keys), **counts}, token=token)
    return _model_inputs(images, captions, labels, keys, image_size, tokenizer_path, max_tokens)


def _model_inputs(images, captions, labels, keys, image_size, tokenizer_path, max_tokens) -> dict:
    ids, mask = tokenize(captions, tokenizer_path, max_tokens)
    return {"image": np.stack(images) if images else np.zeros((0, 3, image_size, image_size), np.uint8),
            "input_ids": ids, "attention_mask": mask, "label": np.array(labels, dtype=np.int64),
            "key": np.array(keys, dtype=object), "caption": np.array(captions, dtype=object)}


def _deform(bow: Deformer, key: str, text: str, counts: Counter) -> tuple[str, str | None]:
    counts["bow_captions_in"] += 1
    counts["bow_words_in"] += len(text.split())
    text, base = bow(key, text)
    counts["bow_base_captions"] += base
    return text, None if text else "dropped_bow_empty"


def _image(jpg: bytes | None, size: int, scale_min: float | None,
           rng: np.random.Generator | None) -> tuple[np.ndarray | None, str | None]:
    if jpg is None:
        return None, "dropped_missing_image"
    image = decode_and_crop(jpg, size, scale_min, rng)
    return image, None if image is not None else "dropped_corrupt_image"


def _meta(meta) -> dict:
    """A sample's JSON metadata ({} when absent or not a JSON object)."""
    try:
        info = json.loads(meta) if meta else {}
    except (ValueError, TypeError):
        return {}
    return info if isinstance(info, dict) else {}


def _cls(info: dict) -> int:
    try:
        return int(info.get("cls", -1))
    except (ValueError, TypeError):
        return -1


def _prompt_for(cls: int, prompts: Prompts, rng) -> tuple[str, str | None]:
    if not 0 <= cls < len(prompts.classes):
        return "", "dropped_missing_cls"
    if cls not in prompts.train_classes:
        return "", "excluded_held_out_class"
    return prompts.caption(cls, rng), None
