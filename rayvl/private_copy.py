"""Data folders that nltk will read, from any checkout.

nltk 3.10 refuses to read a corpus (the English stopwords, WordNet) from a folder or file that another account could
have written — a group or world write bit, or another owner — and reports the corpus as not found. A checkout made
under ``umask 002`` (the default on many shared clusters), an install under it, or a working directory unpacked by
``ray job submit`` leaves rayvl's folders group-writable. Such a folder is read through a private copy instead: made
once per machine and source under the user's cache, owner-only, and made again when the source changes.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
import uuid
from pathlib import Path

from filelock import FileLock

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


_threads = threading.Lock()


def readable(root: Path) -> Path:
    """``root`` when only this account (or root) can write it and everything under it, else its private copy."""
    root = Path(root)
    if _private(root):
        return root
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rayvl" / "private"
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    dest = cache / f"{root.name}-{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]}"
    # one process and one thread at a time checks and copies: a copy another one is reading is never replaced
    # under it unless it is stale (nltk opens WordNet's files lazily)
    with _threads, FileLock(str(cache / f"{dest.name}.lock")):
        if dest.exists() and _private(dest) and _listing(dest) == _listing(root):
            return dest
        staged = cache / f".{dest.name}.{uuid.uuid4().hex[:8]}"
        shutil.copytree(root, staged, symlinks=False)  # copy2: the sources' times, which _listing compares
        for folder, dirs, files in os.walk(staged):
            os.chmod(folder, 0o700)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o600)
        shutil.rmtree(dest, ignore_errors=True)  # a stale or tampered copy
        os.rename(staged, dest)
    return dest


def _private(root: Path) -> bool:
    mine = (os.geteuid(), 0)
    for folder, dirs, files in os.walk(root):
        for path in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            st = os.lstat(path)
            if st.st_uid not in mine or st.st_mode & OTHERS_WRITE:
                return False
    return True


def _listing(root: Path) -> list[tuple[str, int, int]]:
    """Every file under ``root`` with its size and modification time: what tells a copy from its changed source."""
    out = []
    for folder, _, files in os.walk(root):
        for name in files:
            st = os.stat(os.path.join(folder, name))
            out.append((os.path.relpath(os.path.join(folder, name), root), st.st_size, st.st_mtime_ns))
    return sorted(out)
