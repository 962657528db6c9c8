"""`rayvl config show`: a resolved config as YAML, each key under its meaning — the docstring its dataclass field
carries in rayvl/config.py or in a method's config.py (read from the source: Python keeps no field docstrings at run
time). The output is a
recipe: ``rayvl config show > mine.yaml`` then ``rayvl train --config mine.yaml`` trains the same config."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import lru_cache

import yaml

from rayvl.config import RayvlConfig

WIDTH = 110


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring (one line)} of a config dataclass: the string literal after each annotated field — of
    its bases too (RayvlConfig, made from the registered sections, has no source; its core fields are CoreConfig's)."""
    docs = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            try:
                docs.update(_own_field_docs(base))
            except (OSError, TypeError):  # made at run time: no source
                pass
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(getattr(after, "value", None), ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def show(cfg: RayvlConfig) -> str:
    """The config as commented YAML: each section with its class's docstring, each key with its field's."""
    return "\n".join(_lines(cfg, 0)) + "\n"


def _lines(obj, depth: int) -> list[str]:
    indent, out = "  " * depth, []
    hints = typing.get_type_hints(type(obj))
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        for line in textwrap.wrap(docs.get(f.name, ""), WIDTH - len(indent) - 2):
            out.append(f"{indent}# {line}")
        if dataclasses.is_dataclass(hints.get(f.name)):
            section = (inspect.getdoc(type(value)) or "").split("\n\n")[0]
            if section.startswith(f"{type(value).__name__}("):  # the signature dataclasses write, no docstring
                section = ""
            out += [f"{indent}# {line}" for line in textwrap.wrap(" ".join(section.split()), WIDTH - len(indent) - 2)
                    if not docs.get(f.name)]
            out.append(f"{indent}{f.name}:")
            out += _lines(value, depth + 1)
            continue
        plain = list(value) if isinstance(value, tuple) else value
        dumped = yaml.safe_dump({f.name: plain}, default_flow_style=True, width=10_000, sort_keys=False).strip()
        out.append(f"{indent}{dumped[1:-1]}")  # {key: value} without its braces
    return out
