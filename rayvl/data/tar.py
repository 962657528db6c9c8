"""img2dataset / webdataset shards as files: the samples inside one tar stream, and writing a shard in
img2dataset's layout (which shards a spec names: ``specs.py``; reading a shard's bytes: ``shard_io.py``).

Pure Python over file objects (no Ray): the Ray Data datasource (``shards.py``), the BoW preview and the
benchmarks' plain reader all parse tars with ``iter_tar_samples``.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq


COLUMNS = ("key", "jpg", "txt", "json")


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
