"""A run's data, in two steps: ``resolve`` before Ray starts (demo data, files, the checks a typo fails, each enabled
method's data part — rayvl.plugins.data_parts) and ``build`` once Ray is up (the methods' corpus passes and the Ray
Datasets the run trains and evaluates on). Methods enter only through their data parts: this module names none."""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ray

from rayvl import plugins, storage
from rayvl.config import ConfigError, RayvlConfig, upsampling_factors
from rayvl.data import clip_benchmark, shards, specs
from rayvl.data.demo import DEMO_SEED, ensure_demo
from rayvl.data.mix import Mix
from rayvl.data.parts import DataPart, RowTransform, RunData
from rayvl.data.pipeline import Rows, read_columns
from rayvl.data.position import MAX_SHARDS
from rayvl.data.shards import Reading
from rayvl.train.batches import ROW

log = logging.getLogger("rayvl")
EVAL_FILES = {"classes_file": "classes", "paraphrases_file": "paraphrases", "sts_file": "sts"}


@dataclass(frozen=True)
class ResolvedData:
    """What a run reads, resolved before Ray starts."""

    cfg: RayvlConfig
    """the run's config as its data adjusts it: evaluation off without held-out shards, what a method's data
    sets (e.g. model.num_classes)."""
    train: str
    eval: str
    files: dict[str, str]
    """classes_file, paraphrases_file, sts_file ('' = none)."""
    parts: tuple[DataPart, ...] = ()
    """the enabled methods' data parts (rayvl.plugins.data_parts)."""
    train_shards: tuple[str, ...] = ()
    eval_shards: tuple[str, ...] = ()
    """the shards ``train`` and ``eval`` name, listed once here: everything after reads these lists."""
    checks: dict = dataclasses.field(default_factory=dict)
    """what the checks of the data specs found, by key (rayvl.data.specs.SpecCheck: the shards and a summary)."""
    train_mix: Mix | None = None
    """how often a pass reads each ``::`` source of ``train_shards`` (data.upsampling_factors; None: no shards
    listed — the dry run of the demo)."""
    eval_label_vectors: int = 0
    """a multilabel held-out set's class count (rayvl.data.clip_benchmark.label_vectors); 0: none."""

    @property
    def train_slots(self) -> int:
        """Shard reads a pass holds: the data position's size."""
        return self.train_mix.n_slots if self.train_mix else len(self.train_shards)

    def reports(self, report_name: str) -> dict[str, str]:
        """The data report of each stream the run reads, by stream: "train" is ``report_name``; the held-out
        stream and a method's own streams get theirs. A report per stream, no more: each is an idle actor
        process for the whole run."""
        held_out = eval_report(self.cfg, self.eval, report_name)
        return {"train": report_name, **({"eval": held_out} if held_out else {}),
                **{stream: f"{report_name}-{suffix}" for part in self.parts for stream, suffix in part.streams.items()}}


@dataclass(frozen=True)
class Built:
    """A run's data once Ray is up."""

    datasets: dict[str, ray.data.Dataset]
    """by name: "train", "eval" (held-out, when evaluating), "labeled" (a second training stream)."""
    worker_inputs: dict[str, dict]
    """what each method's training part needs on the workers, by method name."""


def resolve(cfg: RayvlConfig, make_demo: bool = True) -> ResolvedData:
    """Everything about a run's data that can be wrong, found before Ray starts (ConfigError naming the key).
    ``make_demo=False`` (the dry run): with no data given, the demo dataset is not written — its shards are neither
    checked nor listed, its methods' parts planned on its paths."""
    train, evalset, files, label_vectors = resolve_data(cfg, make_demo)
    made = make_demo or bool(cfg.data.train)
    checks = check_inputs(cfg, train if made else "", evalset if made or cfg.data.eval else "")
    parts = plugins.data_parts(cfg, train, evalset)
    cfg = with_classes(evaluation_or_off(cfg, evalset), parts)
    listed = {key: tuple(check.paths) for key, check in checks.items()}
    mix = training_mix(cfg, checks["data.train"]) if "data.train" in checks else None
    return ResolvedData(cfg, train, evalset, files, parts, listed.get("data.train", ()), listed.get("data.eval", ()),
                        checks, mix, label_vectors)


def with_classes(cfg: RayvlConfig, parts) -> RayvlConfig:
    """A class-embedding text tower's ``model.num_classes``: the classes the methods' data gives
    (DataPart.classes), set here on the driver before the config reaches the workers; other models as they are."""
    given = {part.name: n for part in parts if (n := part.classes())}
    if cfg.model.text_tower != "class_embedding" or not given:
        return cfg
    if len(set(given.values())) > 1:
        raise ConfigError(f"model.num_classes: the methods' data give different class counts ({given})")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=next(iter(given.values()))))


def training_mix(cfg: RayvlConfig, check: specs.SpecCheck) -> Mix:
    """The sources of the training shards and their data.upsampling_factors (rayvl.data.mix)."""
    return mix_of(cfg, check.sources or (len(check.paths),))


def mix_of(cfg: RayvlConfig, sizes) -> Mix:
    """The mix of sources of ``sizes`` shards as data.upsampling_factors asks; a factor a source's shard count
    cannot give (within 10%) or a pass a row id cannot number is a ConfigError naming the key."""
    mix = Mix.of(sizes, upsampling_factors(cfg.data))
    if mix.distorted():
        i, n, f, m = mix.distorted()[0]
        shards = f"{n:,} shard{'s' if n != 1 else ''}"
        near = sorted({max(1, math.floor(f * n)) / n, math.ceil(f * n) / n})
        source = f"source {i + 1} of data.train" if cfg.data.train else "the demo's training split"
        raise ConfigError(f"data.upsampling_factors: {source} has {shards}: factor {f:g} would "
                          f"read {m:,} a pass ({m / n:.3g}×) — a pass reads a shard a whole number of times, so "
                          f"{shards} take factors in steps of 1/{n:,}: give {' or '.join(f'{x:g}' for x in near)}"
                          + (", or split the source into more shards" if cfg.data.train else ""))
    if mix.n_slots > MAX_SHARDS:
        key = "data.upsampling_factors" if mix.upsampled else "data.train"
        raise ConfigError(f"{key}: a pass of {mix.n_slots:,} shard reads; a row id numbers at most {MAX_SHARDS:,} "
                          f"({mix.describe()})")
    return mix


def build(data: ResolvedData, run_dir: str, report_name: str, passes: int) -> Built:
    """The run's Ray Datasets — ``passes`` passes over the training shards (rayvl.train.run_plan) — and the methods'
    worker inputs; the methods' corpus passes (Ray Data) run here, their artifacts under ``run_dir``, over the shards
    ``resolve`` listed. The data reports ``data.reports(report_name)`` names must exist."""
    cfg = data.cfg
    run = RunData(cfg, data.train, data.train_shards, run_dir, data.reports(report_name))
    made = {part.name: part.build(run) for part in data.parts}
    transforms = tuple(c.transform for c in made.values() if c.transform is not None)
    sets = shard_datasets(cfg, data.train_shards, data.eval_shards, report_name, transforms, passes,
                          data.train_mix, data.eval_label_vectors)
    for contribution in made.values():
        sets.update(contribution.datasets)
    return Built(sets, {name: c.worker for name, c in made.items() if c.worker})


def evaluation_or_off(cfg: RayvlConfig, evalset: str) -> RayvlConfig:
    """The config, with evaluation off when there are no held-out shards (--data without --eval-data): the workers
    would otherwise look for an "eval" dataset that was never made."""
    if not cfg.eval.tasks or evalset:
        return cfg
    log.warning("no held-out shards (data.eval, --eval-data): training without evaluation (eval.tasks %s off)",
                ", ".join(cfg.eval.tasks))
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, tasks=[]))


def check_inputs(cfg: RayvlConfig, train: str, evalset: str) -> dict[str, specs.SpecCheck]:
    """What a typo makes wrong, as a config error naming the key before Ray starts: shards that match nothing, and
    the model's checks (rayvl.models.check). Returns what the checks of the data specs found, by key. (Each
    method's own inputs: its data part.)"""
    checks = {key: specs.checked(key, spec) for key, spec in (("data.train", train), ("data.eval", evalset)) if spec}
    from rayvl.models.check import check_model  # torch and timm on the meta device, loaded when a run checks

    check_model(cfg)
    return checks


def resolve_data(cfg: RayvlConfig, make_demo: bool = True) -> tuple[str, str, dict, int]:
    """(train shards, eval shards, eval files, a multilabel held-out set's class count or 0); generates the
    embedded demo dataset when no data is given (its paths only with ``make_demo=False``). A CLIP_benchmark set as
    data.eval (rayvl.data.clip_benchmark) is its split's shards, with its class names and templates unless
    data.classes names others."""
    d = cfg.data
    train, evalset = d.train, d.eval
    given = {"classes_file": d.classes, "paraphrases_file": d.paraphrases, "sts_file": d.sts}
    files = dict(given)
    try:
        found = clip_benchmark.find(evalset) if evalset else None
    except ValueError as e:
        raise ConfigError(f"data.eval: {e}") from None
    if found:
        evalset, files["classes_file"] = found.shards, d.classes or found.classes
    if not train and not make_demo:  # its paths, as a run would make them
        root = Path(d.demo_dir).expanduser()
    elif not train:
        log.info(f"demo dataset: {d.demo_dir} (generated on first use: {d.demo_samples} + {d.demo_eval_samples} "
                 f"scenes)")
        # the same dataset whatever train.seed is: the seeds of a comparison (rayvl.sweeps.comparison) train on
        # identical data
        root = ensure_demo(d.demo_dir, d.demo_samples, d.demo_eval_samples, seed=DEMO_SEED)
    if not train:
        train = str(root / "train")
        evalset = evalset or str(root / "eval")
        for key, name in (("classes_file", "classes.json"), ("paraphrases_file", "paraphrases.jsonl"),
                          ("sts_file", "sts.tsv")):
            files[key] = files[key] or str(root / name)
    for key, value in files.items():
        if value and (make_demo or given[key]) and not storage.is_file(value):
            raise ConfigError(f"data.{EVAL_FILES[key]}: {value!r} does not exist")
    files = {k: v if storage.is_url(v) else str(Path(v).expanduser()) if v else "" for k, v in files.items()}
    try:  # the class list the set is evaluated with, once it is known to be there
        label_vectors = clip_benchmark.label_vectors(found, files["classes_file"])
    except (ValueError, OSError) as e:
        raise ConfigError(f"data.eval: {e}") from None
    return train, evalset, files, label_vectors


def rows_needed(data: ResolvedData) -> int:
    """Rows of the training shards the run trains on: each micro-batch takes from them what the methods' own
    streams do not fill."""
    cfg = data.cfg
    t = cfg.train
    rows = t.micro_batch_size - sum(part.batch_rows(cfg) for part in data.parts)
    return t.max_steps * t.grad_accumulation * t.num_workers * rows


def read_ahead_bytes(data: ResolvedData) -> int:
    """The training stream's object-store budget: the bytes of the rows the run trains on, plus 5% for dropped
    samples and a transform batch per worker. Ray Data decodes ahead until its budget is full — by default a share of
    the cluster's object store, which on small images holds many passes — so a short run stops decoding near what it
    trains on; a long run's rows exceed Ray's default, and the smaller of the two applies (resource_limits)."""
    cfg = data.cfg
    rows = rows_needed(data) * 21 // 20 + cfg.train.num_workers * cfg.data.transform_batch_size
    return rows * shards.row_bytes(Rows.of(cfg, True))


def train_passes(data: ResolvedData, samples_per_pass: int | None, shard_count: int) -> int:
    """Passes over the training shards one Ray Data execution lists (shards.passes_needed)."""
    return shards.passes_needed(rows_needed(data), samples_per_pass, shard_count)


def shard_datasets(cfg: RayvlConfig, train: str | Sequence[str], evalset: str | Sequence[str], report_name: str,
                   transforms: tuple[RowTransform, ...] = (), passes: int = 1, mix: Mix | None = None,
                   label_vectors: int = 0) -> dict:
    """{"train": ``passes`` passes over the training shards (each as ``mix`` upsamples its sources), their rows
    changed by ``transforms``, "eval": … (the held-out rows as they are — a multilabel set's, of
    ``label_vectors`` classes, with their label sets —, counted in their own report "<report_name>-eval"); each a
    spec or its shards."""
    # only tensor columns go to the training iterator (keys and captions are strings)
    columns = list(dict.fromkeys(read_columns(cfg.data.decode) + [ROW] + [c for t in transforms for c in t.columns]))
    reading = Reading.of(cfg, report_name)
    datasets = {"train": shards.read_shards(train, Rows.of(cfg, True, transforms),
                                            dataclasses.replace(reading, passes=passes, positioned=True), columns,
                                            mix)}
    held_out = eval_report(cfg, evalset, report_name)
    if held_out:
        # held-out samples are counted in their own report, so training counts stay per pass over training data
        datasets["eval"] = shards.read_shards(evalset, Rows.of(cfg, False, label_vectors=label_vectors),
                                              dataclasses.replace(reading, shuffle=False, report_name=held_out))
    return datasets


def eval_report(cfg: RayvlConfig, evalset: str | Sequence[str], report_name: str) -> str | None:
    """The data report of the held-out stream, or None when the run reads none (no tasks or no held-out shards)."""
    return f"{report_name}-eval" if cfg.eval.tasks and evalset else None
