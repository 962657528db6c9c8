"""CLIP_benchmark's webdataset layout — what its ``build_wds_dataset`` reads and its ``clip_benchmark_export_wds``
writes (the ``wds_*`` sets it publishes) — as `rayvl eval --data` takes it, local or on object storage::

    ROOT/classnames.txt                          a class name a line (classification sets)
    ROOT/zeroshot_classification_templates.txt   a template a line, ``{c}`` where the name goes (optional)
    ROOT/dataset_type.txt                        ``retrieval`` for caption sets, ``multilabel`` for sets of
                                                 several classes an image (absent: classification)
    ROOT/<split>/nshards.txt                     the split's shard count n: its shards are 0.tar … n-1.tar
    ROOT/<split>/<i>.tar                         samples of an image (webp, png, jpg) and a ``cls`` member (the
                                                 class index), an ``npy`` (a multilabel set's multi-hot vector of
                                                 its classes) or a ``txt`` (the image's captions, a line each)

``ROOT`` is read as its ``test`` split, CLIP_benchmark's default; ``ROOT/<split>`` as that split. ``ROOT`` may be a
folder, an object-store URL or, as CLIP_benchmark's README gives the sets it publishes, a Hugging Face repository's
page (``https://huggingface.co/datasets/clip-benchmark/wds_vtab-cifar10/tree/main``: its files are read from
``…/resolve/main``, the Hub at HF_ENDPOINT, with HF_TOKEN: rayvl.http_objects). The shards are
then read as any shards are (their samples' ``cls`` members are the labels, a held-out row's ``npy`` its label
set: rayvl.data.pipeline); the class names and templates are the text sets beside them
(rayvl.data.prompts.read_class_file).
"""
from __future__ import annotations

from dataclasses import dataclass

from rayvl import http_objects, storage
from rayvl.data.specs import GLOB_CHARS, SHARD_SUFFIXES
from rayvl.spec_syntax import is_pipe

SPLIT = "test"  # CLIP_benchmark's default split
NSHARDS, TYPE, CLASSNAMES = "nshards.txt", "dataset_type.txt", "classnames.txt"


@dataclass(frozen=True)
class BenchmarkSet:
    root: str
    split: str
    shards: str  # the split's shard spec: <root>/<split>/{0..n-1}.tar
    classes: str  # its classnames.txt ('' for a retrieval set, or a classification set without one)
    kind: str  # "classification" (a class a sample, no caption), "multilabel" (classes a sample) or "retrieval"


def find(data: str) -> BenchmarkSet | None:
    """The CLIP_benchmark set ``data`` names — its root (the test split) or a split's folder, one with an
    ``nshards.txt`` —, or None when ``data`` is not a folder in that layout (shards, globs, ``pipe:``, other trees):
    one or two lookups (on object storage, requests). Its ``dataset_type.txt`` may say classification, multilabel
    or retrieval."""
    if is_pipe(data) or any(c in data for c in GLOB_CHARS + "{,") or data.endswith((*SHARD_SUFFIXES, ".txt")) \
            or "::" in data:
        return None
    data = http_objects.file_url(storage.normalize(data))  # the Hub's …/tree/main: its files' …/resolve/main
    for root, split in ((data, SPLIT), (storage.parent(data), data.rstrip("/").rsplit("/", 1)[-1])):
        try:
            here = storage.is_file(storage.join(root, split, NSHARDS))
        except OSError as e:  # a store out of reach: said as the data's own error, naming it
            raise ValueError(f"{data}: cannot look for {NSHARDS} ({' '.join(str(e).split())})") from None
        if here:
            return _opened(root, split)
    return None


def _opened(root: str, split: str) -> BenchmarkSet:
    count_file = storage.join(root, split, NSHARDS)
    try:
        n = int(storage.read_text(count_file).strip())
    except ValueError:
        raise ValueError(f"{count_file}: not a shard count (CLIP_benchmark writes the number of shards)") from None
    except OSError as e:
        raise ValueError(f"{count_file}: cannot be read ({' '.join(str(e).split())})") from None
    if n < 1:
        raise ValueError(f"{count_file}: {n} shards")
    type_file = storage.join(root, TYPE)
    kind = storage.read_text(type_file).strip().lower() if storage.is_file(type_file) else "classification"
    names = storage.join(root, CLASSNAMES)
    classes = names if kind != "retrieval" and storage.is_file(names) else ""
    return BenchmarkSet(root, split, storage.join(root, split, f"{{0..{n - 1}}}.tar"), classes,
                        kind if kind in ("retrieval", "multilabel") else "classification")


def label_vectors(found: BenchmarkSet | None, classes_file: str) -> int:
    """A multilabel set's class count — how many entries each sample's npy vector has (pipeline.Rows.label_vectors)
    —, from the class list it is evaluated with; 0 for any other set. A multilabel set needs one."""
    if found is None or found.kind != "multilabel":
        return 0
    if not classes_file:
        raise ValueError(f"{found.root}: a multilabel set without {CLASSNAMES}: its samples' vectors of classes need "
                         "the class names (--classes, data.classes)")
    from rayvl.data.prompts import read_class_file

    return len(read_class_file(classes_file)[0])


def split(found: BenchmarkSet, name: str) -> BenchmarkSet | None:
    """The same set's split ``name`` (its linear probe's train split: CLIP_benchmark's ``--train_split``), or None
    where the set has none."""
    if name == found.split or not storage.is_file(storage.join(found.root, name, NSHARDS)):
        return None
    return _opened(found.root, name)
