"""Streaming read of img2dataset shards with Ray Data.

Why not ``ray.data.read_webdataset``: with its decoder it fails the whole dataset on one undecodable JPEG, and a
shard truncated mid-member fails the read (both seen on these machines; LAION shards contain both). This
datasource keeps Ray's file listing, fsspec filesystems, file shuffling and parallel read tasks, and replaces only
the per-file parse: it streams raw member bytes and stops a truncated shard at its last complete sample, naming it
in the run's data report. Decoding and validation happen in ``preprocess`` where bad samples are dropped and counted.
"""
from __future__ import annotations

import glob
import os
import tarfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import ray
from ray.data.datasource import FileBasedDatasource

from rayvl.data.bow import Deformer
from rayvl.data.images import decode_and_crop
from rayvl.data.labeled import Prompts
from rayvl.data.ontology import Ontology
from rayvl.data.text import tokenize, validate_caption

COLUMNS = ("key", "jpg", "txt", "json")
ROWS_PER_BLOCK = 256


class DataPlaneError(RuntimeError):
    """The data path cannot produce training data (no shards, every sample dropped, a starved pipeline)."""


# ----------------------------------------------------------------------------- the run's data report

@ray.remote(num_cpus=0)
class DataReport:
    """Counts every sample seen and every sample dropped (by reason) across all Ray Data tasks of one run."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.bad_shards: dict[str, str] = {}

    def add(self, counts: dict, bad_shard: tuple[str, str] | None = None) -> None:
        self.counts.update(counts)
        if bad_shard:
            self.bad_shards[bad_shard[0]] = bad_shard[1]

    def snapshot(self) -> dict:
        return {"counts": dict(self.counts), "bad_shards": dict(self.bad_shards)}


_handles: dict = {}


def report_actor(name: str):
    """The run's DataReport actor. The driver calls this first, so the actor is owned by (and dies with) the
    driver; Ray Data tasks then find the existing one (get_if_exists makes that race-free)."""
    if name not in _handles:
        _handles[name] = DataReport.options(name=name, namespace="rayvl", get_if_exists=True).remote()
    return _handles[name]


def _send(report_name: str | None, counts: dict, bad_shard=None) -> None:
    # waited for (one round trip per batch): the counts are recorded before the batch they describe is emitted,
    # so whoever has consumed the data also sees its counts — a fire-and-forget call could still be in flight
    if report_name:
        ray.get(report_actor(report_name).add.remote(counts, bad_shard))


# ----------------------------------------------------------------------------- reading

def resolve_shards(spec: str) -> list[str]:
    """A directory, a glob, a comma list, a ``.txt`` list file, or fsspec URLs → tar paths (local ones checked)."""
    if not spec:
        raise DataPlaneError("data.train: no shards given")
    out: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if "://" in part:
            out.append(part)  # Ray lists remote directories itself
            continue
        part = os.path.expanduser(part)
        if os.path.isdir(part):
            out += sorted(glob.glob(os.path.join(part, "*.tar")))
        elif part.endswith(".txt") and os.path.isfile(part):
            out += [line.strip() for line in Path(part).read_text().splitlines() if line.strip()]
        else:
            out += sorted(glob.glob(part))
    if not out:
        raise DataPlaneError(f"no .tar shards found for {spec!r}")
    return out


class Img2DatasetShards(FileBasedDatasource):
    """Raw samples (key, jpg, txt, json bytes) of img2dataset / webdataset tar shards."""

    _FILE_EXTENSIONS = ["tar"]

    def __init__(self, paths, report_name: str | None = None, columns: tuple[str, ...] = COLUMNS, **kwargs):
        super().__init__(paths, **kwargs)
        self.report_name = report_name
        self.columns = tuple(columns)  # e.g. ("key", "txt") for a caption-only pass: image bytes are not kept

    def _read_stream(self, f, path: str) -> Iterator[pa.Table]:
        rows: list[dict] = []
        read = 0
        try:
            for sample in iter_tar_samples(f, self.columns):
                rows.append(sample)
                if len(rows) >= ROWS_PER_BLOCK:
                    read += len(rows)
                    yield _table(rows, self.columns)
                    rows = []
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            # A damaged shard costs only its own bad tail (at most the one sample being read when it broke).
            _send(self.report_name, {"truncated_shards": 1},
                  (path, f"{type(e).__name__}: {e} after {read + len(rows)} samples"))
        if rows:
            yield _table(rows, self.columns)


def iter_tar_samples(f, columns: tuple[str, ...] = COLUMNS) -> Iterator[dict]:
    """Samples of an img2dataset tar stream: {"key", "jpg", "txt", "json"} bytes, members grouped by key (img2dataset
    writes a sample's members next to each other). Raises on a damaged stream; the incomplete sample is lost."""
    current: dict = {}
    with tarfile.open(fileobj=f, mode="r|*") as tar:
        for member in tar:
            if not member.isreg():
                continue
            stem, _, ext = os.path.basename(member.name).partition(".")
            if current and current["key"] != stem:
                yield current
                current = {}
            current.setdefault("key", stem)
            if ext in columns:
                current[ext] = tar.extractfile(member).read()
    if current:
        yield current


def _table(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> pa.Table:
    return pa.table({c: pa.array([r.get(c) for r in rows], pa.string() if c == "key" else pa.binary())
                     for c in columns})


def group_over_shards(spec: str, columns: tuple[str, ...], fn, fn_kwargs: dict, key: str, read_cpus: float):
    """Corpus statistics as a Ray Data aggregation: only ``columns`` of the shards are read, ``fn`` turns each
    batch into rows with a ``key`` column, and the rows are grouped by it for a sum or count — never collected on
    the driver."""
    paths = resolve_shards(spec)
    rows = ray.data.read_datasource(Img2DatasetShards(paths, columns=columns), num_cpus=read_cpus).map_batches(
        fn, batch_format="numpy", num_cpus=read_cpus, fn_kwargs=fn_kwargs)
    # hash partitions of the keys: Ray's default (200) costs ~15 s of task overhead on a few demo shards; one per
    # 8 shards keeps LAION's 41k shards at the default cap
    return rows.groupby(key, num_partitions=max(1, min(200, len(paths) // 8)))


# ----------------------------------------------------------------------------- decode, validate, tokenize

def preprocess(batch: dict, *, image_size: int, crop_scale_min: float, train: bool, tokenizer_path: str,
               max_tokens: int, report_name: str | None, bow: Deformer | None = None,
               ontology: Ontology | None = None, prompts: Prompts | None = None) -> dict:
    """Raw rows → model inputs. Bad samples are dropped here and counted by reason in the run's DataReport
    (with caption statistics: words of kept captions, BoW counts).
    With ``bow`` the caption is deformed (seed bow §2.2) before the image is decoded and before tokenisation;
    a caption the cascade empties drops its sample (counted as dropped_bow_empty, as the paper removes them).
    With ``prompts`` the shards are image-label data (seed unicl): the JSON ``cls`` is the label and the caption is
    a prompt drawn for that class; classes outside ``prompts.train_classes`` are excluded and counted."""
    counts: Counter = Counter()
    images, captions, keys, classes, objects = [], [], [], [], []
    rng = np.random.default_rng() if prompts is not None else None
    for key, jpg, txt, meta in zip(batch["key"], batch["jpg"], batch["txt"], batch["json"]):
        cls = _cls(meta)
        if prompts is not None:
            text, reason = _prompt_for(cls, prompts, rng)
        else:
            text, reason = validate_caption(txt)
        if reason:
            counts[reason] += 1
            continue
        if bow is not None:
            counts["bow_captions_in"] += 1
            counts["bow_words_in"] += len(text.split())
            text, base = bow(key, text)
            counts["bow_base_captions"] += base
            if not text:
                counts["dropped_bow_empty"] += 1
                continue
        if jpg is None:
            counts["dropped_missing_image"] += 1
            continue
        image = decode_and_crop(jpg, image_size, crop_scale_min if train else None)
        if image is None:
            counts["dropped_corrupt_image"] += 1
            continue
        counts["caption_words"] += len(text.split())
        # TOnICS: one training row per (pair, aligned noun), seed tonics App. A.1; a pair without one is a
        # single root-only row (object −1)
        row_objects = ontology.row_objects(text, meta) if ontology is not None else [-1]
        if ontology is not None and row_objects == [-1]:
            counts["tonics_unaligned_pairs"] += 1
        for obj in row_objects:
            images.append(image)
            captions.append(text)
            keys.append(key)
            classes.append(cls)
            objects.append(obj)
    samples_kept = len(set(keys)) if ontology is not None else len(keys)
    if ontology is not None:
        counts["tonics_rows"] += len(keys)
    _send(report_name, {"samples_seen": len(batch["key"]), "samples_kept": samples_kept, **counts})
    ids, mask = tokenize(captions, tokenizer_path, max_tokens)
    size = (0, 3, image_size, image_size)
    return {
        "image": np.stack(images) if images else np.zeros(size, np.uint8),
        "input_ids": ids,
        "attention_mask": mask,
        "key": np.array(keys, dtype=object),
        "caption": np.array(captions, dtype=object),
        "cls": np.array(classes, dtype=np.int64),
        # UniCL label (seed unicl Algorithm 1): the class id of an image-label source, −1 for an image-text pair
        # (the training loop gives each of those a unique label)
        "label": np.array(classes if prompts is not None else [-1] * len(classes), dtype=np.int64),
        "object": np.array(objects, dtype=np.int64),
    }


def _cls(meta) -> int:
    import json

    try:
        return int(json.loads(meta).get("cls", -1)) if meta else -1
    except (ValueError, TypeError, AttributeError):
        return -1


def _prompt_for(cls: int, prompts: Prompts, rng) -> tuple[str, str | None]:
    if not 0 <= cls < len(prompts.classes):
        return "", "dropped_missing_cls"
    if cls not in prompts.train_classes:
        return "", "excluded_held_out_class"
    return prompts.caption(cls, rng), None


def read_shards(spec: str, *, image_size: int, crop_scale_min: float, train: bool, tokenizer_path: str,
                max_tokens: int, read_cpus: float, transform_batch_size: int, shuffle_files: bool,
                report_name: str | None, bow: Deformer | None = None,
                ontology: Ontology | None = None, prompts: Prompts | None = None) -> ray.data.Dataset:
    """The streaming Ray Dataset of model inputs for a shard spec."""
    source = Img2DatasetShards(resolve_shards(spec), report_name=report_name,
                               shuffle="files" if shuffle_files else None)
    ds = ray.data.read_datasource(source, num_cpus=read_cpus)
    return ds.map_batches(
        preprocess, batch_size=transform_batch_size, batch_format="numpy", num_cpus=read_cpus,
        fn_kwargs=dict(image_size=image_size, crop_scale_min=crop_scale_min, train=train,
                       tokenizer_path=tokenizer_path, max_tokens=max_tokens, report_name=report_name, bow=bow,
                       ontology=ontology, prompts=prompts),
    )


def expected_samples(spec: str) -> int | None:
    """Successful samples according to img2dataset's parquet files (a Ray Data aggregation), or None if absent."""
    parquets = [p[:-4] + ".parquet" for p in resolve_shards(spec) if "://" not in p]
    parquets = [p for p in parquets if os.path.exists(p)]
    if not parquets:
        return None
    ds = ray.data.read_parquet(parquets, columns=["status"], num_cpus=0.25)
    return ds.filter(expr="status == 'success'").count()
