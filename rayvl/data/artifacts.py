"""Small run artifacts (corpus statistics, class counts) saved next to a run and reused when their fingerprint —
the shards they were computed on (name and size) and the settings they depend on — still matches."""
from __future__ import annotations

import json
import os
import posixpath
from collections import defaultdict
from typing import Callable

import pyarrow.fs as pafs

from rayvl import http_objects, storage
from rayvl.spec_syntax import is_pipe


class ArtifactMismatch(RuntimeError):
    """A saved artifact was made from other shards or other settings than the run's."""


def shard_sizes(paths: list[str]) -> dict[str, int]:
    """{shard name: bytes} (-1 for a ``pipe:`` shard, whose size is unknown, and for the shards of a folder of more
    than 8 over HTTP, which has no listing). Names are file names — the
    fingerprint survives moving the shards — unless two shards share one (``--data aligned,pseudo``: both folders
    have 00000.tar); then every shard is named by its path. A folder holding many of the shards is listed once
    instead of asked about each (41k shards on object storage: ~42 listing pages, not 41k requests)."""
    found: list[tuple[str, int]] = []
    folders: dict[str, list[str]] = defaultdict(list)
    for p in paths:
        if is_pipe(p):
            found.append((p, -1))
        else:
            folders[storage.parent(p)].append(p)
    for folder, members in folders.items():
        if len(members) <= 8:
            found += [(p, _size(p)) for p in members]
        elif http_objects.is_http(folder):  # no listing over HTTP, and a request a shard is too many
            found += [(p, -1) for p in members]
        else:
            fs, inner = storage.filesystem(folder)
            listed = {posixpath.basename(i.path): i.size for i in fs.get_file_info(pafs.FileSelector(inner))}
            found += [(p, int(listed.get(posixpath.basename(p)) or 0)) for p in members]
    # an http(s) shard's query (a presigned URL's signature, re-signed on every run) is no part of its name
    names = [os.path.basename(http_objects.without_query(path)) for path, _ in found]
    if len(set(names)) < len(names):
        names = [path for path, _ in found]
    return dict(sorted(zip(names, (size for _, size in found))))


def _size(path: str) -> int:
    try:
        return int(storage.size(path) or 0)
    except FileNotFoundError:  # gone since the run's plan: its fingerprint says 0 bytes
        return 0


def diff(saved: dict, now: dict) -> str:
    out = []
    for k in sorted(set(saved) | set(now)):
        if saved.get(k) == now.get(k):
            continue
        if k == "shards":
            a, b = saved.get(k, {}), now.get(k, {})
            changed = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            out.append(f"shards differ: {', '.join(changed[:5])}{' …' if len(changed) > 5 else ''}")
        else:
            out.append(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}")
    return "; ".join(out)


def load_or_make(path: str, expected: dict, key: str, make: Callable[[], dict]) -> tuple[dict, bool]:
    """(content, reused): the JSON artifact at ``path`` when its fingerprint equals ``expected``; otherwise
    ``make()``'s content, saved there with that fingerprint. A saved artifact with another fingerprint is refused,
    naming the config key that points at it and what changed — never silently mixed into another run."""
    if storage.is_file(path):
        saved = json.loads(storage.read_text(path))
        if saved["fingerprint"] != expected:
            raise ArtifactMismatch(f"{key}: {path} was made from other data or other settings "
                                   f"({diff(saved['fingerprint'], expected)}); delete it or point {key} "
                                   f"elsewhere to make it again")
        return saved, True
    content = {"fingerprint": expected, **make()}
    storage.write_text(path, json.dumps(content))
    return content, False
