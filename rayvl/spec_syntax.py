"""The grammar of a shard spec (rayvl.data.specs resolves one into shards): sources joined by ``::`` (open_clip's
mix), each a comma list of parts outside braces, a ``pipe:`` source one command, commas and all. Here, below the
config, so the config can make a spec's relative local parts absolute (``absolute``) without the data plane."""
from __future__ import annotations

import os

PIPE = "pipe:"


def is_pipe(path: str) -> bool:
    return path.startswith(PIPE)


def sources(spec: str) -> list[str]:
    """``a::b,c`` → [a, "b,c"]: the sources of a mix (open_clip's ``::``), empty ones left out."""
    return [s.strip() for s in spec.split("::") if s.strip()]


def parts(spec: str) -> list[str]:
    """``a::b,c`` → [a, b, c]: sources split at ``::``, then at commas outside braces (``{a,b}`` stays whole); a
    ``pipe:`` source is one command, commas and all."""
    return [p for source in sources(spec) for p in source_parts(source)]


def source_parts(source: str) -> list[str]:
    if is_pipe(source):
        return [source]
    out, depth, start = [], 0, 0
    for i, c in enumerate(source + ","):
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            out.append(source[start:i].strip())
            start = i + 1
    return [p for p in out if p]


def is_relative(path: str) -> bool:
    """A local path relative to the working directory: not absolute, not ``~``, not a URL, not ``pipe:``."""
    return bool(path) and not (os.path.isabs(path) or path.startswith("~") or "://" in path or is_pipe(path))


def absolute(spec: str, base: str) -> str:
    """``spec`` with each relative local part (a path, folder, glob, brace pattern or list file) under ``base``;
    URLs, ``pipe:`` commands, absolute and ``~`` paths as written."""
    if not any(is_relative(p) for p in parts(spec)):
        return spec
    return "::".join(",".join(os.path.join(base, p) if is_relative(p) else p for p in source_parts(s))
                     for s in sources(spec))
