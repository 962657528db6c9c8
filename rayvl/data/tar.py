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
import zlib
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from rayvl.storage import replaced


IMAGE_EXTENSIONS = ("jpg", "png", "jpeg", "webp")
"""The image members a sample may carry, as webdataset and open_clip read them (``jpg;png;jpeg;webp``; img2dataset
writes jpg, png or webp by its ``--encode_format``), in any case; of several, the first in this order."""
COLUMNS = ("key", "img", "img_ext", "txt", "json", "cls", "npy")
"""``img``: the bytes of the sample's image member, whichever its extension; ``img_ext``: that extension, lower
case; ``txt``, ``json``, ``cls``, ``npy``: those members' bytes (``cls``: the class index as text, as webdataset
writes it for CLIP_benchmark's classification shards; ``npy``: a saved numpy array, its multilabel shards' multi-hot
vector of classes). Every value is None where the sample has no such member."""


# what reading a damaged tar stream raises (a cut or bad member, a broken gzip): the caller keeps what it read
DAMAGED = (tarfile.TarError, EOFError, zlib.error)


def member_key(name: str) -> tuple[str, str]:
    """(sample key, extension) of a tar member: the basename's text before its first dot, and after it, as
    img2dataset and webdataset split it; the key is empty for macOS's ._ files and dotfiles, which no sample holds."""
    stem, _, ext = os.path.basename(name).partition(".")
    return stem, ext


class _Ending(tarfile.TarInfo):
    """A TarInfo that notes on its archive why the archive's headers ended: read as a stream, ``tarfile`` takes a
    damaged, empty or cut-off header after the first for the end of the archive, as it takes the zero blocks a
    whole archive ends with, and says nothing."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as e:
            tar.rayvl_ended_by = e
            raise


def iter_tar_samples(f, columns: tuple[str, ...] = COLUMNS) -> Iterator[dict]:
    """Samples of an img2dataset / webdataset tar stream: the ``columns`` of COLUMNS each sample has, members grouped
    by key (both write a sample's members next to each other). Raises on a damaged stream — a cut inside a member,
    and (after the samples read before it) a damaged, empty or cut-off header where its end blocks should be; the
    incomplete sample is lost."""
    current: dict = {}
    images = "img" in columns
    with tarfile.open(fileobj=f, mode="r|*", tarinfo=_Ending) as tar:
        for member in tar:
            if not member.isreg():
                continue
            stem, ext = member_key(member.name)
            if not stem:  # macOS's ._ files, dotfiles (webdataset skips them too)
                continue
            if current and current["key"] != stem:
                yield current
                current = {}
            current.setdefault("key", stem)
            ext = ext.lower()
            if images and ext in IMAGE_EXTENSIONS:
                if "img" not in current or _preferred(ext, current["img_ext"]):
                    current["img"], current["img_ext"] = tar.extractfile(member).read(), ext
            elif ext in columns and ext not in ("img", "img_ext", "key"):
                current[ext] = tar.extractfile(member).read()
        ended, offset = getattr(tar, "rayvl_ended_by", None), tar.offset
    if current:
        yield current
    if not isinstance(ended, tarfile.EOFHeaderError):  # the zero blocks of a whole archive
        why = {tarfile.EmptyHeaderError: "the file ends there", tarfile.TruncatedHeaderError: "a cut-off header",
               tarfile.InvalidHeaderError: "a damaged header"}.get(type(ended), type(ended).__name__)
        raise tarfile.ReadError(f"no end-of-archive blocks at byte {offset:,}: {why}")


def _preferred(ext: str, than: str) -> bool:
    return IMAGE_EXTENSIONS.index(ext) < IMAGE_EXTENSIONS.index(than)


def member_extensions(f, samples: int) -> dict[str, int]:
    """How many of the first ``samples`` samples of a tar stream carry a member of each extension (lower case) — what
    a shard holds when none of its members is what rayvl reads. A damaged stream ends the count."""
    found: dict[str, set[str]] = {}
    keys: list[str] = []
    try:
        with tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                stem, ext = member_key(member.name)
                if not stem:  # macOS's ._ files (iter_tar_samples skips them)
                    continue
                if not keys or keys[-1] != stem:
                    if len(keys) == samples:
                        break
                    keys.append(stem)
                found.setdefault(ext.lower() or "(none)", set()).add(stem)
    except (tarfile.TarError, EOFError, OSError):
        pass
    return {ext: len(stems) for ext, stems in sorted(found.items())}


def write_img2dataset_shard(out: Path, name: str, rows: list[dict], stats: dict) -> None:
    """``<name>.tar`` (the row's "jpg" bytes under the extension of its "img_ext" (jpg when absent), txt = the row's
    caption, json = the row without its image, for every row with a "jpg"),
    ``<name>.parquet`` (every row but its image, failed ones too, as img2dataset lists them) and
    ``<name>_stats.json``. Each file is written under a temporary name and renamed, the stats file last: a shard
    whose stats file exists is complete (a rerun of a resumable job skips it)."""
    def write_tar(path: Path) -> None:
        with tarfile.open(path, "w") as tar:
            for row in rows:
                if row.get("jpg") is None:
                    continue
                meta = {k: v for k, v in row.items() if k not in ("jpg", "img_ext")}
                for ext, payload in ((row.get("img_ext") or "jpg", row["jpg"]), ("txt", row["caption"].encode()),
                                     ("json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(f"{row['key']}.{ext}")
                    info.size = len(payload)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(payload))

    replaced(out / f"{name}.tar", write_tar)
    table = pa.Table.from_pylist([{k: v for k, v in row.items() if k not in ("jpg", "img_ext")} for row in rows])
    replaced(out / f"{name}.parquet", lambda path: pq.write_table(table, path))
    replaced(out / f"{name}_stats.json", lambda path: path.write_text(json.dumps(stats, indent=2)))
