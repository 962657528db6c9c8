"""Dataset building per recipe: what the config's data settings resolve to (demo data, files, the TOnICS ontology,
image-label prompts — all checked before Ray starts), and the Ray Datasets a run trains and evaluates on."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from rayvl import assets
from rayvl.config import ConfigError, RayvlConfig, bow_needs_stats, parse_bow_ops
from rayvl.data import bow, fashion_mnist, shards, specs
from rayvl.data.artifacts import ArtifactMismatch
from rayvl.data.demo import DEMO_SEED, ensure_demo
from rayvl.data.ontology import Ontology, keep_frequent, load_or_count
from rayvl.data.pipeline import prompt_batch
from rayvl.data.report import DataPlaneError
from rayvl.data.prompts import Prompts, load_prompts
from rayvl.data.shard_io import ReadPolicy
from rayvl.data.specs import resolve_shards
from rayvl.train.batches import ROW, TRAIN_COLUMNS, label_rows

log = logging.getLogger("rayvl")
EVAL_FILES = {"classes_file": "classes", "paraphrases_file": "paraphrases", "sts_file": "sts"}


@dataclass
class DataPlan:
    """What a run reads, resolved before Ray starts."""

    train: str
    eval: str
    files: dict[str, str]  # classes_file, paraphrases_file, sts_file ('' = none)
    ontology: Ontology | None
    prompts: Prompts | None


def plan(cfg: RayvlConfig) -> DataPlan:
    train, evalset, files = resolve_data(cfg)
    check_inputs(cfg, train, evalset)
    return DataPlan(train, evalset, files, tonics_ontology(cfg), image_label_prompts(cfg))


def evaluation_or_off(cfg: RayvlConfig, evalset: str) -> RayvlConfig:
    """The config, with evaluation off when there are no held-out shards (--data without --eval-data): the workers
    would otherwise look for an "eval" dataset that was never made."""
    if not cfg.eval.tasks or evalset:
        return cfg
    log.warning("no held-out shards (data.eval, --eval-data): training without evaluation (eval.tasks %s off)",
                ", ".join(cfg.eval.tasks))
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, tasks=[]))


def check_inputs(cfg: RayvlConfig, train: str, evalset: str) -> dict[str, specs.SpecCheck]:
    """What a typo makes wrong, as a config error naming the key before Ray starts: shards that match nothing,
    a text tower that is neither an asset nor a local HF folder, a vision tower timm does not know. Returns what
    the checks of the data specs found, by key."""
    checks = {key: specs.checked(key, spec) for key, spec in (("data.train", train), ("data.eval", evalset)) if spec}
    if not evalset and cfg.tonics.enabled:
        raise ConfigError("data.eval: the TOnICS curriculum refresh needs held-out shards (--eval-data)")
    try:
        if cfg.model.text_tower == "lm":
            assets.text_model_path(cfg.model.text)
        assets.check_vision_name(cfg.model.vision)
        _check_image_size(cfg.model.vision, cfg.data.image_size)
        if cfg.tonics.enabled:  # Debian assets a cluster fetches only when asked (cluster.yaml)
            assets.require_wordnet()
        if cfg.image_label.data == "fashion-mnist":
            assets.require_fashion_mnist()
    except assets.MissingAssetError as e:
        raise ConfigError(str(e)) from None
    return checks


def _check_image_size(vision: str, size: int) -> None:
    """A timm tower that takes one image size only (a ViT's patch embedding is built for its size) gets that size,
    or the run stops here instead of at its first forward in every worker."""
    if vision in assets.VISION_ASSETS:
        return
    import timm
    import torch

    with torch.device("meta"):  # the architecture only: no memory, no weights
        model = timm.create_model(vision, pretrained=False)
    embed = getattr(model, "patch_embed", None)
    fixed = tuple(embed.img_size) if getattr(embed, "strict_img_size", False) else None
    if fixed is not None and fixed != (size, size):
        raise ConfigError(f"data.image_size: {size} px, but model.vision={vision!r} takes {fixed[0]}×{fixed[1]} px "
                          f"images: set data.image_size={fixed[0]}")


def resolve_data(cfg: RayvlConfig) -> tuple[str, str, dict]:
    """(train shards, eval shards, eval files); generates the embedded demo dataset when no data is given."""
    d = cfg.data
    train, evalset = d.train, d.eval
    files = {"classes_file": d.classes, "paraphrases_file": d.paraphrases, "sts_file": d.sts}
    if not train:
        log.info(f"demo dataset: {d.demo_dir} (generated on first use: {d.demo_samples} + {d.demo_eval_samples} "
                 f"scenes, ≈1 min)")
        # the same dataset whatever train.seed is: the seeds of a comparison (rayvl.compare) train on identical data
        root = ensure_demo(d.demo_dir, d.demo_samples, d.demo_eval_samples, seed=DEMO_SEED)
        train = str(root / "train")
        evalset = evalset or str(root / "eval")
        for key, name in (("classes_file", "classes.json"), ("paraphrases_file", "paraphrases.jsonl"),
                          ("sts_file", "sts.tsv")):
            files[key] = files[key] or str(root / name)
    for key, value in files.items():
        if value and not Path(value).expanduser().is_file():
            raise ConfigError(f"data.{EVAL_FILES[key]}: {value!r} does not exist")
    return train, evalset, {k: str(Path(v).expanduser()) if v else "" for k, v in files.items()}


def tonics_ontology(cfg: RayvlConfig) -> Ontology | None:
    """The TOnICS ontology resolved against WordNet (before Ray starts: a bad class name is a config error)."""
    x = cfg.tonics
    if not x.enabled:
        return None
    try:
        return Ontology.build(x.classes, x.overrides, x.tags_field)
    except ValueError as e:
        raise ConfigError(f"tonics.classes{e}" if str(e).startswith("[") else f"tonics.{e}") from None


def image_label_prompts(cfg: RayvlConfig) -> Prompts | None:
    """Class names and templates of the image-label source (before Ray starts: a bad file is a config error)."""
    il = cfg.image_label
    if not il.data:
        return None
    try:
        default = fashion_mnist.CLASSES if fashion_mnist.is_fashion_mnist(il.data) else None
        return load_prompts(il.classes, il.templates, il.train_classes, default)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(str(e) if str(e).startswith("image_label") else f"image_label.classes: {e}") from None


def bow_deformer(cfg: RayvlConfig, train: str, run_dir: str) -> bow.Deformer | None:
    """The configured BoW cascade with its base-split statistics (reused from the artifact when it matches)."""
    b = cfg.bow
    if not b.enabled:
        return None
    ops = parse_bow_ops(b.ops)
    stats = None
    if bow_needs_stats(ops):
        path = b.stats_path or f"{run_dir.rstrip('/')}/bow_stats.json"
        log.info(f"BoW statistics of the base split: reading {path} or a Ray Data pass over {train}")
        start = time.perf_counter()
        try:
            stats, reused = bow.load_or_compute(train, path, seed=b.seed, fraction=b.base_fraction,
                                                read_cpus=cfg.data.read_cpus, io=ReadPolicy.of(cfg.data))
        except ArtifactMismatch as e:
            raise ConfigError(str(e)) from None
        log.info(f"BoW statistics {'reused from' if reused else 'computed with Ray Data →'} {path} "
                 f"({time.perf_counter() - start:.0f} s): {stats.base_captions} base captions of {stats.captions}, "
                 f"base vocabulary {len(stats.df)} words")
    return bow.Deformer(ops, b.seed, b.base_fraction, stats, b.top_freq_words, b.keep_base_intact)


def tonics_counts(cfg: RayvlConfig, ontology: Ontology, train: str, run_dir: str) -> tuple[Ontology, list[int]]:
    """|X(η_o)| per class (Ray Data groupby, reused from the artifact when it matches); rare classes dropped."""
    x = cfg.tonics
    path = x.counts_path or f"{run_dir.rstrip('/')}/tonics_counts.json"
    log.info(f"TOnICS rows per class: reading {path} or a Ray Data pass over {train}")
    start = time.perf_counter()
    try:
        counts, reused = load_or_count(train, path, ontology, cfg.data.read_cpus, ReadPolicy.of(cfg.data))
    except ArtifactMismatch as e:
        raise ConfigError(str(e)) from None
    kept, sizes = keep_frequent(ontology, counts, x.min_instances)
    log.info(f"TOnICS rows per class {'reused from' if reused else 'counted with Ray Data →'} {path} "
             f"({time.perf_counter() - start:.0f} s): "
             + ", ".join(f"{c} {counts.get(i, 0)}{'' if sizes[i] else ' (dropped)'}"
                         for i, c in enumerate(ontology.classes))
             + f"; {counts.get(-1, 0)} pairs without an aligned noun")
    if not kept.kept:
        raise ConfigError(f"tonics.min_instances: no object class has {x.min_instances} rows")
    return kept, sizes


def _common(cfg: RayvlConfig, report_name: str) -> dict:
    d = cfg.data
    return dict(image_size=d.image_size, crop_scale_min=d.crop_scale_min,
                tokenizer_path=str(assets.text_model_path(cfg.model.text)), max_tokens=d.max_text_tokens,
                report_name=report_name)


def labeled_dataset(cfg: RayvlConfig, prompts: Prompts, report_name: str) -> ray.data.Dataset:
    """The image-label stream: Fashion-MNIST IDX rows or img2dataset shards with ``cls``, prompts as captions."""
    d, il, t = cfg.data, cfg.image_label, cfg.train
    if fashion_mnist.is_fashion_mnist(il.data):
        pixels, labels = fashion_mnist.read(il.data, limit=il.limit)
        # the rows the run trains on (+ one micro-batch per rank of slack): without a limit the stream runs through
        # its whole epoch ahead of training, as fast as the object store takes it — measured: the 35,000 photos of
        # a 30-step run decoded and tokenized in 106 s beside the training workers, 2.9 s per step
        needed = (t.max_steps * t.grad_accumulation + 1) * t.num_workers * label_rows(cfg)
        usable = max(1, int(np.isin(labels, sorted(prompts.train_classes)).sum()))
        # every pass the run needs in one execution: each pass draws its own photo order, crops and prompts
        ds = fashion_mnist.passes(pixels, labels, t.seed, -(-needed // usable), d.read_cpus).map_batches(
            prompt_batch, batch_size=d.transform_batch_size, batch_format="numpy", num_cpus=d.read_cpus,
            fn_kwargs=dict(prompts=prompts, seed=t.seed, **_common(cfg, report_name)))
        # given the map's CPUs, the column selection fuses into its tasks (alone it would ask for a whole CPU)
        return ds.select_columns(TRAIN_COLUMNS, num_cpus=d.read_cpus).limit(needed)
    return shards.read_shards(il.data, train=True, read_cpus=d.read_cpus, transform_batch_size=d.transform_batch_size,
                              shuffle_files=d.shuffle_files, prompts=prompts, columns=TRAIN_COLUMNS,
                              seed=cfg.train.seed, threads=d.read_threads, io=ReadPolicy.of(d),
                              **_common(cfg, report_name))


def train_passes(cfg: RayvlConfig, train: str, samples_per_pass: int | None) -> int:
    """Passes over the training shards one Ray Data execution lists (shards.passes_needed)."""
    t = cfg.train
    needed = t.max_steps * t.grad_accumulation * t.num_workers * (t.micro_batch_size - label_rows(cfg))
    return shards.passes_needed(needed, samples_per_pass, len(resolve_shards(train)))


def build_datasets(cfg: RayvlConfig, train: str, evalset: str, report_name: str,
                   deformer: bow.Deformer | None = None, ontology: Ontology | None = None, passes: int = 1) -> dict:
    """{"train": ``passes`` passes over the training shards, "eval": … (held-out, counted in its own report
    "<report_name>-eval")}."""
    d = cfg.data
    common = dict(read_cpus=d.read_cpus, transform_batch_size=d.transform_batch_size, threads=d.read_threads,
                  io=ReadPolicy.of(d), **_common(cfg, report_name))
    # only tensor columns go to the training iterator (keys and captions are strings)
    columns = TRAIN_COLUMNS + [ROW] + (["object"] if ontology is not None else [])
    datasets = {"train": shards.read_shards(train, train=True, shuffle_files=d.shuffle_files, bow=deformer,
                                            ontology=ontology, columns=columns, passes=passes, seed=cfg.train.seed,
                                            positioned=True, **common)}
    held_out = eval_report(cfg, evalset, report_name)
    if held_out:
        # held-out samples are counted in their own report, so training counts stay per pass over training data
        datasets["eval"] = shards.read_shards(evalset, train=False, shuffle_files=False,
                                              **{**common, "report_name": held_out})
    return datasets


def eval_report(cfg: RayvlConfig, evalset: str, report_name: str) -> str | None:
    """The data report of the held-out stream, or None when the run reads none (no tasks or no held-out shards)."""
    return f"{report_name}-eval" if cfg.eval.tasks and evalset else None
