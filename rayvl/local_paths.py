"""Relative local paths in the config, made absolute where the config is loaded (rayvl.config.load_config): the
folder the command runs in is what they mean, and Ray Train's workers and Tune's trials run in folders of their own
(each trial's directory). A path field says how by its type — ``SpecPath``, ``FilePath``, ``NamedOrPath``,
``NamedOrSpec`` — in the core's config and in the methods' sections alike; this module sits below both (it imports
only the spec grammar)."""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from rayvl import spec_syntax


@dataclass(frozen=True)
class Relative:
    """How a field's relative local path is made absolute when the config is loaded (``absolute_paths``): Ray Train's
    workers and Tune's trials run in other working directories (each trial's own folder), where the command's
    relative paths would name nothing."""

    kind: Literal["spec", "file", "named", "named_spec"]


SpecPath = Annotated[str, Relative("spec")]  # shards (rayvl.spec_syntax): each relative local part
FilePath = Annotated[str, Relative("file")]  # a local file or folder, or a URL
NamedOrPath = Annotated[str, Relative("named")]  # a name (a bare word: an asset, a run) or a path
NamedOrSpec = Annotated[str, Relative("named_spec")]  # a name (a bare word) or shards


def absolute_paths(cfg: Any, base: str) -> Any:
    """``cfg`` (a config or a section) with the relative local paths of its path fields (SpecPath, FilePath,
    NamedOrPath, NamedOrSpec) under ``base``: URLs, ``pipe:`` commands, absolute and ``~`` paths, and names stay
    as written."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    changes = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        marks = [m for m in getattr(hints.get(f.name), "__metadata__", ()) if isinstance(m, Relative)]
        if dataclasses.is_dataclass(value):
            new = absolute_paths(value, base)
        elif marks and isinstance(value, str) and value:
            new = absolute(value, marks[0].kind, base)
        else:
            continue
        if new != value:
            changes[f.name] = new
    return dataclasses.replace(cfg, **changes) if changes else cfg


def absolute(value: str, kind: str, base: str) -> str:
    """A value of a path field of ``kind`` under ``base``; a "named" field's bare word (``minilm-l6``, ``clip``,
    ``fashion-mnist``, a run's name) is a name, a path with a folder in it (``./mine``, ``runs/x``) a path — a
    name is never taken for a folder of that name in the working directory."""
    if kind.startswith("named") and os.sep not in value:
        return value
    if kind in ("spec", "named_spec"):
        return spec_syntax.absolute(value, base)
    return os.path.normpath(os.path.join(base, value)) if spec_syntax.is_relative(value) else value
