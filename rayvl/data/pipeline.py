"""The per-sample pipeline: img2dataset shard rows → model inputs, inside Ray Data's read tasks.

Bad samples are dropped here and counted by reason into the read task's counts, which ``shards.ShardStream``
records in the run's data report once per shard. What a method changes of a row — where its caption comes from,
the caption itself, the training rows one sample becomes and the columns they carry — comes from the row transforms
``Rows`` holds (``rayvl.data.parts.RowTransform``), applied in order: this module knows none of them by name.
"""
from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rayvl import assets
from rayvl.data import encoded_jpegs
from rayvl.data.encoded_jpegs import PIXELS
from rayvl.data.images import decode_and_crop
from rayvl.data.parts import RowTransform, Sample
from rayvl.data.position import unit_of
from rayvl.data.seeding import row_rng
from rayvl.data.text import tokenize, validate_caption, validate_caption_lines

if TYPE_CHECKING:
    from rayvl.config import RayvlConfig

# the model inputs a training step takes (keys and captions are strings and stay behind)
TRAIN_COLUMNS = ["image", "input_ids", "attention_mask", "label"]
UNLABELLED = -1  # the label of a row no transform labels: the training loop gives each such row a unique one
DIGEST = "image_digest"  # a held-out row's: its encoded image's (blake2b, 8 bytes), which retrieval groups rows by
LABEL_SET = "label_set"  # a held-out row's classes from its npy member, a JSON list ('' for none: _label_set)
FORMATS = {"jpeg": "jpg"}  # image member extensions counted as another's format


@dataclass(frozen=True)
class Rows:
    """What a shard row becomes (how the shards are read is ``shards.Reading``)."""

    image_size: int
    """side of the square uint8 crop (data.image_size)."""
    crop_scale_min: float
    """lower bound of the random-resized crop's area with ``train`` (data.crop_scale_min)."""
    train: bool
    """random-resized crops drawn per row; otherwise centre crops."""
    tokenizer_path: str
    """the text tower's tokenizer folder."""
    max_tokens: int
    """captions padded / truncated to this many tokens (data.max_text_tokens)."""
    seed: int = 0
    """with the row's key and pass, the seed of its crop and of every draw a transform makes (data/seeding.py)."""
    transforms: tuple[RowTransform, ...] = ()
    """the enabled methods' row transforms, in the order they apply."""
    decode: str = "cpu"
    """where images are decoded: "cpu" here, into ``image``; "device" where they are used — a JPEG the device
    takes kept encoded with its crop box, in ``image_bytes`` and ``image_box`` (data/encoded_jpegs.py,
    rayvl/device_decode.py)."""
    label_vectors: int = 0
    """a multilabel set's class count (CLIP_benchmark's ``dataset_type.txt`` says ``multilabel``): a held-out
    sample's ``npy`` member is its multi-hot vector of that many classes, its row's ``label_set``; 0: no set of
    that kind, npy members are not labels."""

    @classmethod
    def of(cls, cfg: RayvlConfig, train: bool, transforms: tuple[RowTransform, ...] = (),
           label_vectors: int = 0) -> Rows:
        """The rows ``cfg``'s data settings make, with ``transforms`` (``label_vectors``: Rows.label_vectors)."""
        d = cfg.data
        # the held-out rows of a training run are embedded by ModelEmbedder, which takes decoded images
        return cls(d.image_size, d.crop_scale_min, train, str(assets.text_model_path(cfg.model.text)),
                   d.max_text_tokens, cfg.train.seed, tuple(transforms), d.decode if train else "cpu", label_vectors)

    @property
    def columns(self) -> dict[str, int]:
        """The int64 columns every output row carries besides the model inputs' tensors, with the value of a row no
        transform set."""
        return {"label": UNLABELLED, **{c: v for t in self.transforms for c, v in t.columns.items()}}

    @property
    def draws(self) -> bool:
        """Every row gets its random generator: for its crop, or for a transform that draws even outside training."""
        return self.train or any(t.draws for t in self.transforms)


def row_bytes(rows: Rows) -> int:
    """Bytes one model-input row holds (in the object store, or a loader's queue): its uint8 image and int64 token
    ids and mask."""
    return 3 * rows.image_size ** 2 + 16 * rows.max_tokens


def preprocess(batch: dict, counts: Counter, rows: Rows) -> dict:
    """Shard rows → model inputs; samples seen, kept and dropped (by reason) and the words of kept captions are
    added to ``counts``, with whatever the transforms count. A row's crop and draws come from (``rows.seed``, its
    key, its shard's ``cycle`` — the pass of its row id without one) alone (data/seeding.py, data/mix.py).
    ``samples_kept`` counts samples, however many rows each became. A held-out row (``rows.train`` false) keeps
    its caption's lines apart (its image's captions) and carries its encoded image's digest (``DIGEST``)."""
    made: list[tuple] = []
    kept = 0
    ids = batch.get("row", np.full(len(batch["key"]), -1))  # data/position.py
    # a row's draws follow its shard's read (its cycle, data/mix.py: the pass, unless its source is upsampled)
    passes = np.full(len(ids), batch["cycle"]) if "cycle" in batch else unit_of(np.asarray(ids, dtype=np.int64))[0]
    draws = rows.draws
    vector_classes = 0 if rows.train else rows.label_vectors  # a multilabel held-out set's: npy members are labels
    none = [None] * len(batch["key"])
    exts, members, vectors = batch.get("img_ext", none), batch.get("cls", none), batch.get("npy", none)
    for key, img, ext, txt, meta, member, vector, row, pass_ in zip(batch["key"], batch["img"], exts, batch["txt"],
                                                                    batch["json"], members, vectors, ids, passes):
        info = _meta(meta)
        sample = Sample(key, meta, info, _cls(member, info), row_rng(rows.seed, key, pass_) if draws else None)
        if ext is not None:  # the image members read, by format (jpeg and jpg are one)
            counts[f"format_{FORMATS.get(ext, ext)}"] += 1
        label_set = _label_set(vector, vector_classes, counts) if vector_classes else ""
        text, reason = _caption(rows, txt, sample, counts, labelled=sample.cls >= 0 or bool(label_set))
        image = None
        if not reason:
            image, reason = _image(img, rows, sample.rng)
        if reason:
            counts[reason] += 1
            continue
        counts["caption_words"] += len(text.split())
        values = _expanded(rows, text, sample, counts)
        kept += bool(values)
        made += [(image, text, key, sample.cls, row, v, img, label_set) for v in values]
    counts.update({"samples_seen": len(batch["key"]), "samples_kept": kept})
    images, captions, keys, classes, ids, values, data, sets = (list(c) for c in zip(*made)) if made else ([],) * 8
    held_out = {} if rows.train else {DIGEST: np.array([digest(d) for d in data], dtype=np.int64)}
    if vector_classes:
        held_out[LABEL_SET] = np.array(sets, dtype=object)
    return {**model_inputs(images, captions, keys, rows), "cls": np.array(classes, dtype=np.int64),
            "row": np.array(ids, dtype=np.int64), **held_out,
            **{c: np.array([v.get(c, default) for v in values], dtype=np.int64) for c, default in rows.columns.items()}}


def digest(data: bytes) -> int:
    """An encoded image's identity: the first 8 bytes of its blake2b digest, as an int64 (two copies of one photo
    under two keys, as COCO-style shards store an image's captions, have the same)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def preprocess_columns(batch: dict, counts: Counter, rows: Rows, columns: list[str] | None = None) -> dict:
    """``preprocess``, only ``columns`` of its output kept (all of them when None): what a shard reader, Ray Data's
    read task or a local loader's worker, makes of a raw batch."""
    out = preprocess(batch, counts, rows)
    return {c: out[c] for c in columns} if columns else out


def model_inputs(images: list, captions: list[str], keys: list[str], rows: Rows) -> dict:
    """Stacked uint8 images (or, decoded on the device, their bytes and boxes: ``image_columns``), fixed-length
    token ids and mask, keys and captions (no label: the caller's column)."""
    ids, mask = tokenize(captions, rows.tokenizer_path, rows.max_tokens)
    return {**image_columns(images, rows), "input_ids": ids, "attention_mask": mask,
            "key": np.array(keys, dtype=object), "caption": np.array(captions, dtype=object)}


def image_columns(images: list, rows: Rows) -> dict:
    """The image columns of rows: ``image``, uint8 (n, 3, S, S); decoded on the device, ``image_bytes`` and
    ``image_box`` (encoded_jpegs.prepare's pairs; an image decoded already, as a method's stream makes them,
    travels as its pixels)."""
    if rows.decode == "device":
        pairs = [(i.tobytes(), (PIXELS,) * 4) if isinstance(i, np.ndarray) else i for i in images]
        data = np.empty(len(pairs), dtype=object)  # bytes a row: np.array would make one fixed-width string array
        data[:] = [d for d, _ in pairs]
        return {"image_bytes": data, "image_box": np.array([b for _, b in pairs], np.int64).reshape(-1, 4)}
    size = rows.image_size
    return {"image": np.stack(images) if images else np.zeros((0, 3, size, size), np.uint8)}


def image_column_names(decode: str) -> list[str]:
    """The columns ``image_columns`` makes where images are decoded as ``decode`` says (Rows.decode)."""
    return list(encoded_jpegs.COLUMNS) if decode == "device" else ["image"]


def read_columns(decode: str) -> list[str]:
    """The model inputs a training iterator takes from the read tasks: ``TRAIN_COLUMNS``, the image as ``decode``
    (data.decode) has it — the device decodes it into ``image`` (rayvl.train.batches.DeviceCopy)."""
    return image_column_names(decode) + TRAIN_COLUMNS[1:]


def _caption(rows: Rows, raw, sample: Sample, counts: Counter, labelled: bool) -> tuple[str, str | None]:
    """The caption the row trains on, or ("", the reason it is dropped): the first transform that sources one
    (else the sample's own text, validated; a held-out sample with a class or label set — ``labelled`` — may have
    none), then each transform's change to it."""
    for t in rows.transforms:
        sourced = t.source(raw, sample)
        if sourced is not None:
            text, reason = sourced
            break
    else:
        if raw is None and not rows.train and labelled:
            return "", None  # a held-out image with a class and no caption (a classification set): no caption lines
        text, reason = validate_caption(raw) if rows.train else validate_caption_lines(raw)
    for t in rows.transforms:
        if reason:
            break
        text, reason = t.caption(text, sample, counts)
    return text, reason


def _expanded(rows: Rows, text: str, sample: Sample, counts: Counter) -> list[dict[str, int]]:
    """The column values of each training row the sample becomes: one row unless a transform makes several."""
    values: list[dict[str, int]] = [{}]
    for t in rows.transforms:
        values = [{**v, **more} for v in values for more in t.expand(text, sample, counts)]
    return values


def _image(img: bytes | None, rows: Rows, rng: np.random.Generator | None) -> tuple[object, str | None]:
    """The row's image — its uint8 crop, or for the device its bytes and crop box (encoded_jpegs.prepare) —, or
    None and the reason it is dropped."""
    if img is None:
        return None, "dropped_missing_image"
    scale_min = rows.crop_scale_min if rows.train else None
    prepare = encoded_jpegs.prepare if rows.decode == "device" else decode_and_crop
    image = prepare(img, rows.image_size, scale_min, rng)
    return image, None if image is not None else "dropped_corrupt_image"


def _meta(meta) -> dict:
    """A sample's JSON metadata ({} when absent or not a JSON object)."""
    try:
        info = json.loads(meta) if meta else {}
    except (ValueError, TypeError):
        return {}
    return info if isinstance(info, dict) else {}


def class_of(sample: dict) -> int:
    """The class of a raw shard sample (its ``cls`` and ``json`` members, tar.COLUMNS) as ``preprocess`` reads it."""
    return _cls(sample.get("cls"), _meta(sample.get("json")))


def label_vector(member: bytes | None) -> np.ndarray | None:
    """The multi-hot vector an ``npy`` member holds — CLIP_benchmark's multilabel shards (VOC2007's) save one a
    sample as webdataset saves an array: 1-D, every entry 0 or 1 —, or None for a member that is none."""
    if member is None:
        return None
    try:
        vector = np.load(io.BytesIO(member), allow_pickle=False)
    except (ValueError, OSError, EOFError):
        return None
    if not isinstance(vector, np.ndarray) or vector.ndim != 1 or vector.dtype.kind not in "biuf" \
            or not np.isin(vector, (0, 1)).all():  # an .npz, a matrix, text; VOC's devkit's -1/0/1 marks
        return None
    return vector


def _label_set(member: bytes | None, classes: int, counts: Counter) -> str:
    """A held-out sample's classes (the JSON list of its vector's ones; ``[]``: an image of none of them) in a
    multilabel set of ``classes`` classes, '' without an ``npy`` member. A member that is no multi-hot vector of
    ``classes`` entries is counted (``unreadable_label_vector``) and its image's classes left unknown, as a ``cls``
    that is not an integer is."""
    if member is None:
        return ""
    vector = label_vector(member)
    if vector is None or len(vector) != classes:
        counts["unreadable_label_vector"] += 1
        return ""
    return json.dumps(np.flatnonzero(vector).tolist())


def _cls(member: bytes | None, info: dict) -> int:
    """The sample's class: its ``cls`` member (CLIP_benchmark's classification shards), else its JSON's ``cls``
    (−1 for neither, or one that is not an integer)."""
    try:
        return int(member if member is not None else info.get("cls", -1))
    except (ValueError, TypeError):
        return -1
