"""img2dataset / webdataset shards as files: which shards a spec names, and the samples inside one tar stream.

Pure Python over file objects (no Ray): the Ray Data datasource (``shards.py``), the BoW preview and the
benchmarks' plain reader all parse tars with ``iter_tar_samples``.
"""
from __future__ import annotations

import glob
import os
import tarfile
from pathlib import Path
from typing import Iterator

from rayvl import storage
from rayvl.data.report import DataPlaneError

COLUMNS = ("key", "jpg", "txt", "json")


def resolve_shards(spec: str) -> list[str]:
    """A directory, a glob, a comma list, a ``.txt`` list file, or URLs of files, folders or globs → tar paths."""
    if not spec:
        raise DataPlaneError("data.train: no shards given")
    out: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if storage.is_url(part):  # a file, a folder or a glob on object storage / any fsspec scheme
            out += storage.list_files(part, ".tar")
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


def open_shard(path: str):
    """A binary file object for a local path or an fsspec/pyarrow URL."""
    if not storage.is_url(path):
        return open(path, "rb")
    fs, inner = storage.filesystem(path)
    return fs.open_input_stream(inner)


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
