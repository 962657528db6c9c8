"""Where runs, sweeps and artifacts live: a local path, a ``file://`` URL, object storage (``s3://``, ``gs://``,
anything ``pyarrow.fs`` opens, as Ray Train does) or any other fsspec URL (wrapped for pyarrow, and handed to Ray
Train as its ``storage_filesystem``). One set of helpers, so the driver, the workers and ``rayvl eval`` read the
same files Ray Train wrote. ``http://`` and ``https://`` URLs are read-only objects (rayvl.http_objects): looked up,
read and copied here, never listed or written.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import posixpath
from pathlib import Path
from typing import Callable

import pyarrow.fs as pafs

from rayvl import http_objects


def is_url(path: str) -> bool:
    return "://" in str(path)


def local_path(path: str | os.PathLike) -> Path | None:
    """The local directory a path or ``file://`` URL names; None for remote storage."""
    path = str(path)
    if path.startswith("file://"):
        return Path(path.removeprefix("file://")).expanduser().resolve()
    return None if is_url(path) else Path(path).expanduser().resolve()


def normalize(path: str | os.PathLike) -> str:
    """Local paths absolute (trials and workers run in other working directories); URLs as given."""
    return str(path).rstrip("/") if is_url(path) else str(local_path(path))


def parent(path: str) -> str:
    return posixpath.dirname(str(path).rstrip("/")) if is_url(path) else str(Path(path).parent)


def join(base: str, *names: str) -> str:
    return posixpath.join(str(base).rstrip("/"), *names) if is_url(base) else str(Path(base, *names))


def filesystem(path: str | os.PathLike, patient: bool = False) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it), resolved as Ray Train resolves a storage path; a scheme pyarrow does
    not know goes through fsspec (e.g. ``memory://``, or a scheme an installed fsspec plugin adds). ``patient``:
    the filesystem a run or a sweep keeps for its checkpoints and state, which outlasts a GCS outage of minutes
    (RAYVL_GCS_RUN_RETRY_S, default 300 s); every other GCS call gives up after RAYVL_GCS_RETRY_S (10 s)."""
    path = str(path)
    if not is_url(path):
        return pafs.LocalFileSystem(), str(local_path(path))
    if http_objects.is_http(path):  # no filesystem: objects to read (exists, is_file, size, read_bytes, download_file)
        raise OSError(f"{path}: an http(s) URL is a file to read, not storage to list or write runs to")
    scheme = path.split("://", 1)[0]
    if scheme in ("gs", "gcs") and "?" not in path:  # a bounded retry: unreachable GCS is an error in seconds
        return _gcs(patient), path.split("://", 1)[1]
    try:
        return pafs.FileSystem.from_uri(path)
    except ValueError:  # pyarrow's ArrowInvalid: a scheme it has no filesystem for
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), inner


def _gcs(patient: bool = False) -> pafs.FileSystem:
    """pyarrow's GCS filesystem with its retries bounded by RAYVL_GCS_RETRY_S (default 10 s) — its own default
    retries an unreachable store (no network, no credentials) for 15 minutes in silence, and rayvl's reads retry on
    their own (data.io_retries) — or, ``patient``, by RAYVL_GCS_RUN_RETRY_S (default 300 s): a checkpoint written
    during a blip of the store is written late rather than lost with the run."""
    from datetime import timedelta

    limit = os.environ.get("RAYVL_GCS_RUN_RETRY_S", 300) if patient else os.environ.get("RAYVL_GCS_RETRY_S", 10)
    return pafs.GcsFileSystem(retry_time_limit=timedelta(seconds=float(limit)))


def exists(path: str) -> bool:
    if http_objects.is_http(path):
        return http_objects.info(path) is not None
    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound


def is_file(path: str) -> bool:
    if http_objects.is_http(path):
        return http_objects.info(path) is not None
    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type == pafs.FileType.File


def size(path: str) -> int | None:
    """The file's bytes (None where an HTTP server does not say); a missing file is a FileNotFoundError."""
    if http_objects.is_http(path):
        return _http_info(path).size
    fs, inner = filesystem(path)
    found = fs.get_file_info(inner)
    if found.type != pafs.FileType.File:
        raise FileNotFoundError(f"{path} is not a file")
    return found.size


def _http_info(path: str) -> http_objects.Info:
    found = http_objects.info(path)
    if found is None:
        raise FileNotFoundError(f"{path}: HTTP 404")
    return found


def read_bytes(path: str, limit: int | None = None) -> bytes:
    """The file's bytes, or its first ``limit`` of them (on object storage and HTTP, one ranged read)."""
    if http_objects.is_http(path):
        return http_objects.read_bytes(path, limit)
    fs, inner = filesystem(path)
    if limit is not None:
        with fs.open_input_file(inner) as f:
            return f.read(limit)
    with fs.open_input_stream(inner) as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def write_bytes(path: str, data: bytes) -> None:
    """Write ``path`` whole: a reader sees the old file or the new one, never a part (an object store's put is
    whole already; on a local or shared filesystem the bytes go to a temporary name first, then are renamed —
    sweep trials that share an artifact write and read it at once)."""
    fs, inner = filesystem(path)
    fs.create_dir(posixpath.dirname(inner), recursive=True)
    if is_url(path) and not str(path).startswith("file://"):
        with fs.open_output_stream(inner) as f:
            f.write(data)
        return
    partial = f"{inner}.partial-{os.getpid()}"
    with fs.open_output_stream(partial) as f:
        f.write(data)
    fs.move(partial, inner)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def replaced(path: Path, write: Callable[[Path], None]) -> None:
    """A local file written whole by ``write(a temporary path)`` and renamed to ``path`` — for files too large to
    hold as bytes (``write_bytes``): a kill leaves no half-written file under its name, and a process that reads or
    maps the file before keeps the old one whole (overwritten in place, its pages would change)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def list_files(spec: str, suffix: str | tuple[str, ...]) -> list[str]:
    """Files a URL names: the file itself, the files ending in ``suffix`` (one or a tuple) directly under a folder,
    or the files matching a glob in the last path component (``s3://bucket/laion/{0..9}*.tar`` style globs: ``*``,
    ``?``, ``[...]``) that end in it — a glob over img2dataset's output (``0000*``) also matches its ``.parquet`` and
    ``_stats.json`` beside each shard —, sorted, as URLs like ``spec``."""
    name = posixpath.basename(spec.rstrip("/"))
    pattern = name if any(c in name for c in "*?[") else ""
    if not pattern and spec.endswith(suffix):
        return [spec]
    base = parent(spec) if pattern else spec
    return [join(base, n) for n in _names(base, pafs.FileType.File)
            if n.endswith(suffix) and (not pattern or fnmatch.fnmatch(n, pattern))]


def subdirs(path: str, prefix: str = "") -> list[str]:
    """The folders directly under ``path`` whose name starts with ``prefix``, as paths/URLs like ``path``."""
    return [join(path, n) for n in _names(path, pafs.FileType.Directory) if n.startswith(prefix)]


def _names(path: str, kind: pafs.FileType) -> list[str]:
    """Sorted names of the entries of one kind directly under ``path`` (none when it does not exist)."""
    if http_objects.is_http(path):
        raise OSError(f"{path}: HTTP has no listing — an http(s) URL names one file")
    fs, inner = filesystem(path)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos if i.type == kind)


def download(path: str) -> Path:
    """A local copy of a remote folder (a checkpoint), cached under ~/.cache/rayvl by URL; local paths as they
    are. A checkpoint folder never changes once Ray Train has written it, so a complete copy is reused. The
    lock keeps evaluation actors on one node from copying over a folder another one is already loading."""
    from filelock import FileLock

    local = local_path(path)
    if local is not None:
        return local
    target = _cached(path)
    done = target.parent / ".complete"
    with FileLock(str(target.parent / ".lock")):
        if not done.exists():
            fs, inner = filesystem(path)
            target.mkdir(exist_ok=True)
            pafs.copy_files(inner, str(target), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            done.touch()
    return target


def download_file(path: str) -> Path:
    """A local copy of a remote file (a whole CLIP's weights), cached under ~/.cache/rayvl by URL as ``download``
    caches folders: each node copies it once, the processes of one node wait for one copy (a lock), and a copy
    is complete before it is used (written under another name, then renamed). The object's size and modification
    time are kept with the copy: an object replaced at the same URL is copied again, so a node that joins later
    and the nodes before it read the same weights."""
    from filelock import FileLock

    local = local_path(path)
    if local is not None:
        return local
    target = _cached(path)
    stamp, copy = _versioned(path)
    stamp_file = target.parent / ".object"
    with FileLock(str(target.parent / ".lock")):
        if not target.exists() or not stamp_file.exists() or stamp_file.read_text() != stamp:
            replaced(target, copy)
            stamp_file.write_text(stamp)
    return target


def _versioned(path: str) -> tuple[str, Callable[[Path], None]]:
    """(what changes when the remote file is replaced — its size and modification time, or over HTTP its size and
    ETag —, a function copying it into a local file; over HTTP a cut connection resumes where it broke off)."""
    if http_objects.is_http(path):
        version = _http_info(path).version

        def fetch(out: Path) -> None:
            with open(out, "wb") as f:
                http_objects.copy_to(path, f)

        return version, fetch
    fs, inner = filesystem(path)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"{path} is not a file on its storage")

    def copy(out: Path) -> None:
        with fs.open_input_stream(inner) as src, open(out, "wb") as f:
            while data := src.read(16 << 20):
                f.write(data)

    return f"{info.size} {info.mtime_ns}", copy


def _cached(path: str) -> Path:
    """Where ``download`` and ``download_file`` keep a URL's copy: a folder of its own under $RAYVL_CACHE (made)."""
    cache = Path(os.environ.get("RAYVL_CACHE", "~/.cache/rayvl")).expanduser() / "downloads"
    # a presigned URL, signed anew each run, is the same file (its stamp says if it is not)
    path = http_objects.without_query(path)
    target = cache / hashlib.sha1(path.encode()).hexdigest()[:16] / posixpath.basename(path.rstrip("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def download_to(path: str, local: Path) -> None:
    """Copy a folder of the storage (a URL) into a local folder, keeping the files' relative paths (uncached: for
    folders that change, unlike ``download``'s checkpoints)."""
    fs, inner = filesystem(path)
    local.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(inner, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())


def upload(local: Path, path: str) -> None:
    """Copy a local folder's files into a folder of the storage (a URL), keeping their relative paths."""
    fs, inner = filesystem(path)
    fs.create_dir(inner, recursive=True)
    pafs.copy_files(str(local), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
