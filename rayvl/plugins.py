"""Where the core meets the methods, one way. The core — ``rayvl.config``, ``rayvl.data``, ``rayvl.train``,
``rayvl.eval`` — defines what a method may fill (``rayvl.data.parts``: a row transform and a data part;
``rayvl.train.parts``: a training part) and never imports a method. Each method registers itself here with one
``register`` line in ``rayvl/methods/__init__.py``; the core asks ``methods()``, which imports that package by name
the first time.

Order: registration order. The data parts' row transforms apply in it (a transform that rewrites a caption comes
before one that makes rows from its words), the config checks run in it, and the first training part that gives a batch source,
targets or a loss is the one used (the config checks refuse the combinations where two would give one)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

PACKAGE = "rayvl.methods"


@dataclass(frozen=True)
class Method:
    """One method's parts; each is optional."""

    name: str
    check: Callable[[Any], None] | None = None
    """``check(cfg)``: its config constraints, raising ``rayvl.errors.ConfigError`` naming the dotted key; torch-free
    (``rayvl.config.validate`` runs it before Ray starts, whether or not the method is on)."""
    data_part: str = ""
    """``"module:function"`` of ``data_part(cfg, train, evalset)``: its ``rayvl.data.parts.DataPart`` for a run reading
    those specs, or None when the method is off; torch-free, imported by the driver only (its data part reads with
    Ray Data: a config check or ``rayvl.load`` imports no Ray)."""
    train_part: str = ""
    """``"module:Class"`` of its ``rayvl.train.parts.TrainPart``, imported on the workers only (it needs torch)."""
    report: str = ""
    """the module whose ``statistics(counts) -> dict`` and ``lines(report) -> list[str]`` add the method's part to a
    run's data report (rayvl.data.report): statistics derived from its counts, and its lines of the report's text;
    torch-free, imported where a report is read (beside Ray, on a driver)."""
    progress: tuple[tuple[str, str], ...] = ()
    """(metric, format) of what the progress line shows when a report has the metric, e.g. ``("x_rate", "rate
    {:.3f}")`` (rayvl.train.progress)."""
    data_metrics: tuple[str, ...] = ()
    """prefixes of its metrics that count data (grouped under ``data/`` in TensorBoard and MLflow)."""
    streams: Callable[[Any], int] | None = None
    """``streams(cfg)``: the Ray Data pipelines it reads beside the training stream (each needs a read task's CPUs
    beside the workers: rayvl.session.check_resources); torch-free."""
    commands: str = ""
    """``"module:function"`` of ``add_commands(subparsers)``: the method's own `rayvl` commands, each parser naming
    the function that runs it (``set_defaults(method_command=main)``); imported when the command line is parsed."""
    negatives: Callable[[Any], tuple[int, str]] | None = None
    """``negatives(cfg)``: (the negatives a query gets beyond the gathered batch, where they come from), e.g. a queue
    of keys; (0, ...) when the config leaves it off. The dry run and the model card say it; torch-free."""
    loss_kinds: tuple[str, ...] = ()
    """values of ``loss.kind`` it adds beside the core's clip and siglip (its training part gives their targets or
    loss)."""
    sections: tuple[tuple[str, type], ...] = ()
    """(key, dataclass) of each config section it owns, e.g. ``("x", XConfig)``: ``rayvl.config.RayvlConfig``
    gets a field ``key`` of that type (its ``--set key.field=…`` keys, their checks and ``rayvl config show``'s
    docs as every section's); torch-free, imported with the registration."""


_registered: dict[str, Method] = {}


def register(method: Method) -> None:
    if method.name in _registered:
        raise ValueError(f"a method named {method.name!r} is registered already")
    _registered[method.name] = method


def methods() -> tuple[Method, ...]:
    """Every registered method, in registration order."""
    importlib.import_module(PACKAGE)  # its __init__ registers each method, once
    return tuple(_registered.values())


def extra_negatives(cfg) -> list[tuple[int, str]]:
    """(count, where) of the negatives each enabled method adds beyond the gathered batch (Method.negatives)."""
    found = [m.negatives(cfg) for m in methods() if m.negatives]
    return [(n, where) for n, where in found if n]


def config_sections() -> list[tuple[str, type]]:
    """Every method's config sections, in registration order; a key given twice is a mistake in a registration."""
    sections = [section for m in methods() for section in m.sections]
    keys = [key for key, _ in sections]
    if len(set(keys)) < len(keys):
        raise ValueError(f"config sections registered twice: {sorted(k for k in keys if keys.count(k) > 1)}")
    return sections


def loss_kinds() -> list[str]:
    return [kind for m in methods() for kind in m.loss_kinds]


def check(cfg) -> None:
    """Each method's constraints on ``cfg``; the first one broken raises."""
    for method in methods():
        if method.check is not None:
            method.check(cfg)


def data_parts(cfg, train: str, evalset: str) -> tuple:
    """The enabled methods' data parts for a run reading ``train`` (and ``evalset``, '' = none); a problem is a
    ConfigError naming the key."""
    parts = (_named(m.data_part)(cfg, train, evalset) for m in methods() if m.data_part)
    return tuple(part for part in parts if part is not None)


def report_statistics(counts: dict) -> dict:
    """What every method derives from a training data report's counts."""
    out: dict = {}
    for m in methods():
        if m.report:
            out.update(importlib.import_module(m.report).statistics(counts))
    return out


def report_lines(report: dict) -> list[str]:
    """Every method's lines of a data report's text, in registration order."""
    return [line for m in methods() if m.report for line in importlib.import_module(m.report).lines(report)]


def progress_fields() -> list[tuple[str, str]]:
    return [field for m in methods() for field in m.progress]


def data_metric_prefixes() -> tuple[str, ...]:
    return tuple(prefix for m in methods() for prefix in m.data_metrics)


def extra_streams(cfg) -> int:
    """The Ray Data pipelines the enabled methods read beside the training stream."""
    return sum(m.streams(cfg) for m in methods() if m.streams is not None)


def add_commands(subparsers) -> None:
    """Every method's own commands on `rayvl`'s parser (Method.commands), in registration order."""
    for m in methods():
        if m.commands:
            _named(m.commands)(subparsers)


def train_part_classes() -> list[type]:
    """Every method's training part class (imported here: on a worker)."""
    return [_named(m.train_part) for m in methods() if m.train_part]


def _named(where: str):
    """The object ``"module:name"`` names, its module imported."""
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)
