"""img2dataset / webdataset shards as files: which shards a spec names, the samples inside one tar stream, and
writing a shard in img2dataset's layout.

Pure Python over file objects (no Ray): the Ray Data datasource (``shards.py``), the BoW preview and the
benchmarks' plain reader all parse tars with ``iter_tar_samples``.
"""
from __future__ import annotations

import glob
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

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


def write_img2dataset_shard(out: Path, name: str, rows: list[dict], stats: dict) -> None:
    """``<name>.tar`` (jpg, txt = the row's caption, json = the row without its image, for every row with a "jpg"),
    ``<name>.parquet`` (every row but its image, failed ones too, as img2dataset lists them) and
    ``<name>_stats.json``. Each file is written under a temporary name and renamed, the stats file last: a shard
    whose stats file exists is complete (a rerun of a resumable job skips it)."""
    def publish(suffix: str, write) -> None:
        tmp = out / f".{name}{suffix}.tmp"
        write(tmp)
        os.replace(tmp, out / f"{name}{suffix}")

    def write_tar(path: Path) -> None:
        with tarfile.open(path, "w") as tar:
            for row in rows:
                if row.get("jpg") is None:
                    continue
                meta = {k: v for k, v in row.items() if k != "jpg"}
                for ext, payload in (("jpg", row["jpg"]), ("txt", row["caption"].encode()),
                                     ("json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(f"{row['key']}.{ext}")
                    info.size = len(payload)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(payload))

    publish(".tar", write_tar)
    table = pa.Table.from_pylist([{k: v for k, v in row.items() if k != "jpg"} for row in rows])
    publish(".parquet", lambda path: pq.write_table(table, path))
    publish("_stats.json", lambda path: path.write_text(json.dumps(stats, indent=2)))
