"""Driver side: data → Ray Data datasets → TorchTrainer(DeepSpeed) → run directory with metrics and evaluation."""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.train
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from rayvl import assets
from rayvl.config import ConfigError, RayvlConfig
from rayvl.data import bow, shards
from rayvl.data.artifacts import ArtifactMismatch
from rayvl.data.demo import ensure_demo
from rayvl.data.labeled import FASHION_MNIST_CLASSES, Prompts, fashion_mnist_rows, is_fashion_mnist, load_prompts, \
    prompt_batch
from rayvl.data.ontology import Ontology, keep_frequent, load_or_count
from rayvl.train.batches import TRAIN_COLUMNS
from rayvl.train.checkpoint import latest_checkpoint_dir
from rayvl.train.loop import train_loop_per_worker

WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "TRANSFORMERS_VERBOSITY": "error", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


@dataclass
class RunResult:
    run_dir: Path
    checkpoint_dir: str
    metrics: dict
    data_report: dict


def resolve_data(cfg: RayvlConfig) -> tuple[str, str, dict]:
    """(train shards, eval shards, eval files); generates the embedded demo dataset when no data is given."""
    d = cfg.data
    train, evalset = d.train, d.eval
    files = {"classes_file": d.classes, "paraphrases_file": d.paraphrases, "sts_file": d.sts}
    if not train:
        root = ensure_demo(d.demo_dir, d.demo_samples, d.demo_eval_samples, seed=cfg.train.seed)
        train = str(root / "train")
        evalset = evalset or str(root / "eval")
        for key, name in (("classes_file", "classes.json"), ("paraphrases_file", "paraphrases.jsonl"),
                          ("sts_file", "sts.tsv")):
            files[key] = files[key] or str(root / name)
    for key, value in files.items():
        if value and not Path(value).expanduser().is_file():
            field = {"classes_file": "classes", "paraphrases_file": "paraphrases", "sts_file": "sts"}[key]
            raise ConfigError(f"data.{field}: {value!r} does not exist")
    return train, evalset, {k: str(Path(v).expanduser()) if v else "" for k, v in files.items()}


def connect(cfg: RayvlConfig) -> bool:
    """Join a cluster (config, RAY_ADDRESS, or a `ray job submit` driver) or start a local Ray. True if local."""
    if ray.is_initialized():
        return False
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    # "local": start a fresh Ray even if a `ray start` cluster runs on this machine; joining one is explicit
    # (ray_address / RAY_ADDRESS, which `ray job submit` sets for its driver)
    ray.init(address="local", num_cpus=cfg.local_num_cpus or None, runtime_env={"env_vars": WORKER_ENV})
    return True


def check_resources(cfg: RayvlConfig, fixed_size: bool) -> None:
    """Ray Train workers must leave CPUs for Ray Data, else the pipeline starves silently (DESIGN). On a Ray we
    started ourselves the size is final, so too few CPUs is an error; a cluster may still autoscale, so a warning."""
    t, d = cfg.train, cfg.data
    total = ray.cluster_resources().get("CPU", 0)
    need = t.num_workers * t.cpus_per_worker + d.read_cpus
    if need > total:
        message = (f"train.num_workers × train.cpus_per_worker + data.read_cpus = {need:g} CPUs, but the cluster "
                   f"has {total:g}: Ray Data would starve. Lower train.cpus_per_worker or data.read_cpus.")
        if fixed_size:
            raise ConfigError(message)
        print(f"rayvl: warning: {message} (waiting for the autoscaler)")
    if t.use_gpu and ray.cluster_resources().get("GPU", 0) < t.num_workers:
        print(f"rayvl: waiting for {t.num_workers} GPUs (cluster has "
              f"{ray.cluster_resources().get('GPU', 0):g}; the autoscaler may add them)")


def run_paths(cfg: RayvlConfig) -> tuple[str, str]:
    storage = cfg.train.storage_path
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    name = cfg.train.run_name or f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(storage) / name if "://" not in storage else None
    if run_dir is not None:
        exists = run_dir.exists() and latest_checkpoint_dir(run_dir) is not None
        if exists and not cfg.train.resume:
            raise ConfigError(f"train.run_name: run {str(run_dir)!r} already has checkpoints; "
                              f"set train.resume=true (--resume) to continue it, or choose another name")
        if cfg.train.resume and not exists:
            raise ConfigError(f"train.resume: run {str(run_dir)!r} has no checkpoint to resume from")
    return storage, name


def bow_deformer(cfg: RayvlConfig, train: str, run_dir: str) -> bow.Deformer | None:
    """The configured BoW cascade with its base-split statistics (reused from the artifact when it matches)."""
    b = cfg.bow
    if not b.enabled:
        return None
    ops = bow.parse_ops(b.ops)
    stats = None
    if bow.needs_stats(ops):
        path = b.stats_path or f"{run_dir.rstrip('/')}/bow_stats.json"
        try:
            stats, reused = bow.load_or_compute(train, path, seed=b.seed, fraction=b.base_fraction,
                                                read_cpus=cfg.data.read_cpus)
        except ArtifactMismatch as e:
            raise ConfigError(str(e)) from None
        print(f"rayvl: BoW statistics {'reused from' if reused else 'computed with Ray Data →'} {path}: "
              f"{stats.base_captions} base captions of {stats.captions}, base vocabulary {len(stats.df)} words")
    return bow.Deformer(ops, b.seed, b.base_fraction, stats)


def tonics_ontology(cfg: RayvlConfig) -> Ontology | None:
    """The TOnICS ontology resolved against WordNet (before Ray starts: a bad class name is a config error)."""
    x = cfg.tonics
    if not x.enabled:
        return None
    try:
        return Ontology.build(x.classes, x.overrides, x.tags_field)
    except ValueError as e:
        raise ConfigError(f"tonics.classes{e}" if str(e).startswith("[") else f"tonics.{e}") from None


def tonics_counts(cfg: RayvlConfig, ontology: Ontology, train: str, run_dir: str) -> tuple[Ontology, list[int]]:
    """|X(η_o)| per class (Ray Data groupby, reused from the artifact when it matches); rare classes dropped."""
    x = cfg.tonics
    path = x.counts_path or f"{run_dir.rstrip('/')}/tonics_counts.json"
    try:
        counts, reused = load_or_count(train, path, ontology, cfg.data.read_cpus)
    except ArtifactMismatch as e:
        raise ConfigError(str(e)) from None
    kept, sizes = keep_frequent(ontology, counts, x.min_instances)
    print(f"rayvl: TOnICS rows per class {'reused from' if reused else 'counted with Ray Data →'} {path}: "
          + ", ".join(f"{c} {counts.get(i, 0)}{'' if sizes[i] else ' (dropped)'}"
                      for i, c in enumerate(ontology.classes))
          + f"; {counts.get(-1, 0)} pairs without an aligned noun")
    if not kept.kept:
        raise ConfigError(f"tonics.min_instances: no object class has {x.min_instances} rows")
    return kept, sizes


def image_label_prompts(cfg: RayvlConfig) -> Prompts | None:
    """Class names and templates of the image-label source (before Ray starts: a bad file is a config error)."""
    il = cfg.image_label
    if not il.data:
        return None
    try:
        default = FASHION_MNIST_CLASSES if is_fashion_mnist(il.data) else None
        prompts = load_prompts(il.classes, il.templates, il.train_classes, default)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(str(e) if str(e).startswith("image_label") else f"image_label.classes: {e}") from None
    if cfg.model.text_tower == "class_embedding":
        cfg.model.num_classes = len(prompts.classes)
    return prompts


def labeled_dataset(cfg: RayvlConfig, prompts: Prompts, report_name: str):
    """The image-label stream: Fashion-MNIST IDX rows or img2dataset shards with ``cls``, prompts as captions."""
    d, il = cfg.data, cfg.image_label
    tokenizer_path = str(assets.text_model_path(cfg.model.text))
    if is_fashion_mnist(il.data):
        ds = fashion_mnist_rows(il.data, limit=il.limit).map_batches(
            prompt_batch, batch_size=d.transform_batch_size, batch_format="numpy", num_cpus=d.read_cpus,
            fn_kwargs=dict(prompts=prompts, image_size=d.image_size, crop_scale_min=d.crop_scale_min,
                           tokenizer_path=tokenizer_path, max_tokens=d.max_text_tokens, report_name=report_name))
    else:
        ds = shards.read_shards(il.data, image_size=d.image_size, crop_scale_min=d.crop_scale_min, train=True,
                                tokenizer_path=tokenizer_path, max_tokens=d.max_text_tokens, read_cpus=d.read_cpus,
                                transform_batch_size=d.transform_batch_size, shuffle_files=d.shuffle_files,
                                report_name=report_name, prompts=prompts)
    return ds.select_columns(TRAIN_COLUMNS)


def build_datasets(cfg: RayvlConfig, train: str, evalset: str, report_name: str,
                   deformer: bow.Deformer | None = None, ontology: Ontology | None = None) -> dict:
    tokenizer_path = str(assets.text_model_path(cfg.model.text))
    common = dict(image_size=cfg.data.image_size, crop_scale_min=cfg.data.crop_scale_min,
                  tokenizer_path=tokenizer_path, max_tokens=cfg.data.max_text_tokens, read_cpus=cfg.data.read_cpus,
                  transform_batch_size=cfg.data.transform_batch_size, report_name=report_name)
    # only tensor columns go to the training iterator (keys and captions are strings)
    columns = TRAIN_COLUMNS + (["object"] if ontology is not None else [])
    datasets = {"train": shards.read_shards(train, train=True, shuffle_files=cfg.data.shuffle_files, bow=deformer,
                                            ontology=ontology, **common).select_columns(columns)}
    if cfg.eval.tasks and evalset:
        # held-out samples are counted in their own report, so training counts stay per pass over training data
        datasets["eval"] = shards.read_shards(evalset, train=False, shuffle_files=False,
                                              **{**common, "report_name": f"{report_name}-eval"})
    return datasets


def train(cfg: RayvlConfig) -> RunResult:
    """Run one training job end to end and return where everything is."""
    train_data, eval_data, eval_files = resolve_data(cfg)
    storage, name = run_paths(cfg)
    ontology = tonics_ontology(cfg)
    prompts = image_label_prompts(cfg)
    started_here = connect(cfg)
    ray.data.DataContext.get_current().enable_progress_bars = False  # per-operator bars flood job logs
    check_resources(cfg, fixed_size=started_here)
    report_name = f"rayvl-data-report-{name}-{uuid.uuid4().hex[:8]}"
    report, eval_report = shards.report_actor(report_name), shards.report_actor(f"{report_name}-eval")
    run_dir = f"{storage.rstrip('/')}/{name}"
    sizes = None
    if ontology is not None:
        ontology, sizes = tonics_counts(cfg, ontology, train_data, run_dir)
    datasets = build_datasets(cfg, train_data, eval_data, report_name, bow_deformer(cfg, train_data, run_dir),
                              ontology)
    label_report = None
    if prompts is not None:  # seed unicl App. B.2: image-label data next to (or instead of) image-text data
        label_report = shards.report_actor(f"{report_name}-labels")
        labeled = labeled_dataset(cfg, prompts, f"{report_name}-labels")
        datasets["labeled" if cfg.image_label.weight < 1.0 else "train"] = labeled
    t = cfg.train
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "rayvl": cfg.to_dict(), "report_name": report_name, **eval_files,
            "tokenizer_path": str(assets.text_model_path(cfg.model.text)), "tonics_sizes": sizes,
        },
        scaling_config=ScalingConfig(
            num_workers=t.num_workers, use_gpu=t.use_gpu,
            resources_per_worker={"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})}),
        run_config=RunConfig(
            name=name, storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=t.checkpoints_to_keep),
            failure_config=FailureConfig(max_failures=t.max_failures),
        ),
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=[k for k in ("train", "labeled") if k in datasets]),
    )
    expected = shards.expected_samples(train_data)
    result = trainer.fit()
    data_report = {**ray.get(report.snapshot.remote()), "img2dataset_successes_per_pass": expected,
                   "eval": ray.get(eval_report.snapshot.remote())}
    data_report["captions"] = caption_stats(data_report["counts"])
    if label_report is not None:
        data_report["image_label"] = ray.get(label_report.snapshot.remote())
    return finish(Path(storage) / name if "://" not in storage else Path(name), result, data_report)


def finish(run_dir: Path, result, data_report: dict) -> RunResult:
    """Copy what a user looks for into the run directory: metrics.jsonl, eval.json, data_report.json."""
    checkpoint_dir = result.checkpoint.path if result.checkpoint else ""
    metrics = dict(result.metrics or {})
    run_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint_dir and Path(checkpoint_dir).is_dir():
        history = Path(checkpoint_dir) / "metrics.jsonl"
        if history.exists():
            (run_dir / "metrics.jsonl").write_text(history.read_text())
    evals = {k: v for k, v in metrics.items() if k.startswith(("zeroshot", "t2i", "i2t", "eval_", "paraphrase",
                                                                 "sts", "retrieval"))}
    (run_dir / "eval.json").write_text(json.dumps(evals, indent=2))
    (run_dir / "data_report.json").write_text(json.dumps(data_report, indent=2))
    return RunResult(run_dir, checkpoint_dir, metrics, data_report)


def format_eval_table(metrics: dict) -> str:
    """Each metric next to its chance level."""
    rows = [("metric", "value %", "chance %")]
    if "zeroshot_top1" in metrics:
        n = metrics.get("zeroshot_classes", 0)
        rows.append((f"zero-shot top-1 ({n} classes)", f"{metrics['zeroshot_top1']:.1f}",
                     f"{metrics['zeroshot_chance_top1']:.1f}"))
        if "zeroshot_top5" in metrics:
            rows.append(("zero-shot top-5", f"{metrics['zeroshot_top5']:.1f}", f"{min(100, 500 / n):.1f}"))
        rows.append(("zero-shot mean per-class recall", f"{metrics['zeroshot_mean_per_class_recall']:.1f}",
                     f"{metrics['zeroshot_chance_top1']:.1f}"))
    for direction, label in (("i2t", "image→text"), ("t2i", "text→image")):
        for k in (1, 5, 10):
            key = f"{direction}_R@{k}"
            if key in metrics:
                rows.append((f"{label} R@{k} ({metrics.get('eval_images', '?')} pairs)", f"{metrics[key]:.1f}",
                             f"{metrics[f'{direction}_chance_R@{k}']:.1f}"))
    k = next((key.split("@")[1] for key in metrics if key.startswith("paraphrase_AO@")), None)
    if k:
        rows.append((f"paraphrase AO@{k} ({metrics['paraphrase_pairs']} pairs)",
                     f"{metrics[f'paraphrase_AO@{k}']:.1f}", "-"))
        rows.append((f"paraphrase JS@{k}", f"{metrics[f'paraphrase_JS@{k}']:.1f}", "-"))
    if "sts_spearman" in metrics:
        rows.append((f"STS Spearman ({metrics['sts_pairs']} pairs)", f"{metrics['sts_spearman']:.1f}", "0.0"))
        rows.append(("STS Pearson", f"{metrics['sts_pearson']:.1f}", "0.0"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>8}  {c:>8}" for a, b, c in rows)


def _drop_lines(report: dict) -> list[str]:
    counts = report.get("counts", {})
    lines = [f"  {k}: {v}" for k, v in sorted(counts.items()) if k.startswith(("dropped_", "truncated_"))]
    return lines + [f"  bad shard {path}: {why}" for path, why in report.get("bad_shards", {}).items()]


def caption_stats(counts: dict) -> dict:
    """Average caption length (words) of the kept samples and, with BoW, before deformation and the dataset-size
    change caused by emptied captions — the columns of seed bow Tables 2 and 5."""
    out = {"avg_caption_words": counts.get("caption_words", 0) / max(1, counts.get("samples_kept", 0)),
           "bow_dataset_change_pct": 0.0}
    if counts.get("bow_captions_in"):
        n = counts["bow_captions_in"]
        out.update({"bow_avg_words_before": counts["bow_words_in"] / n,
                    "bow_dataset_change_pct": -100.0 * counts.get("dropped_bow_empty", 0) / n + 0.0,
                    "bow_base_share_pct": 100.0 * counts.get("bow_base_captions", 0) / n})
    return out


def _caption_line(counts: dict) -> str:
    c = caption_stats(counts)
    if "bow_avg_words_before" not in c:
        return f"  captions: {c['avg_caption_words']:.1f} words on average"
    return (f"  captions: BoW {c['bow_avg_words_before']:.1f} → {c['avg_caption_words']:.1f} words on average, "
            f"dataset {c['bow_dataset_change_pct']:+.1f}% (emptied captions dropped), "
            f"{c['bow_base_share_pct']:.1f}% kept intact (base split)")


def format_data_report(report: dict) -> str:
    counts = report.get("counts", {})
    lines = [f"training: seen {counts.get('samples_seen', 0)}, kept {counts.get('samples_kept', 0)} "
             f"(all passes over the data; img2dataset lists {report.get('img2dataset_successes_per_pass')} "
             f"successful samples per pass)", _caption_line(counts), *_drop_lines(report)]
    if "tonics_rows" in counts:  # seed tonics App. A.1: one row per (pair, aligned noun)
        lines.insert(2, f"  TOnICS: {counts['tonics_rows']} rows from {counts.get('samples_kept', 0)} pairs; "
                        f"{counts.get('tonics_unaligned_pairs', 0)} pairs without an aligned noun (root-only rows)")
    if "image_label" in report:
        lab = report["image_label"].get("counts", {})
        lines += [f"image-label: seen {lab.get('samples_seen', 0)}, kept {lab.get('samples_kept', 0)}, "
                  f"{lab.get('excluded_held_out_class', 0)} of held-out classes excluded",
                  *_drop_lines(report["image_label"])]
    if "eval" in report:
        held = report["eval"].get("counts", {})
        lines += [f"held-out: seen {held.get('samples_seen', 0)}, kept {held.get('samples_kept', 0)} "
                  f"(every rank reads the whole held-out split)", *_drop_lines(report["eval"])]
    return "\n".join(lines)
