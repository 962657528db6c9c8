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
from rayvl.data import shards
from rayvl.data.demo import ensure_demo
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


def build_datasets(cfg: RayvlConfig, train: str, evalset: str, report_name: str) -> dict:
    tokenizer_path = str(assets.text_model_path(cfg.model.text))
    common = dict(image_size=cfg.data.image_size, crop_scale_min=cfg.data.crop_scale_min,
                  tokenizer_path=tokenizer_path, max_tokens=cfg.data.max_text_tokens, read_cpus=cfg.data.read_cpus,
                  transform_batch_size=cfg.data.transform_batch_size, report_name=report_name)
    # only tensor columns go to the training iterator (keys and captions are strings)
    datasets = {"train": shards.read_shards(train, train=True, shuffle_files=cfg.data.shuffle_files, **common)
                .select_columns(TRAIN_COLUMNS)}
    if cfg.eval.tasks and evalset:
        # held-out samples are counted in their own report, so training counts stay per pass over training data
        datasets["eval"] = shards.read_shards(evalset, train=False, shuffle_files=False,
                                              **{**common, "report_name": f"{report_name}-eval"})
    return datasets


def train(cfg: RayvlConfig) -> RunResult:
    """Run one training job end to end and return where everything is."""
    train_data, eval_data, eval_files = resolve_data(cfg)
    storage, name = run_paths(cfg)
    started_here = connect(cfg)
    ray.data.DataContext.get_current().enable_progress_bars = False  # per-operator bars flood job logs
    check_resources(cfg, fixed_size=started_here)
    report_name = f"rayvl-data-report-{name}-{uuid.uuid4().hex[:8]}"
    report, eval_report = shards.report_actor(report_name), shards.report_actor(f"{report_name}-eval")
    datasets = build_datasets(cfg, train_data, eval_data, report_name)
    t = cfg.train
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "rayvl": cfg.to_dict(), "report_name": report_name, **eval_files,
            "tokenizer_path": str(assets.text_model_path(cfg.model.text)),
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
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )
    expected = shards.expected_samples(train_data)
    result = trainer.fit()
    data_report = {**ray.get(report.snapshot.remote()), "img2dataset_successes_per_pass": expected,
                   "eval": ray.get(eval_report.snapshot.remote())}
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
    lines = [f"  {k}: {v}" for k, v in sorted(counts.items()) if k not in ("samples_seen", "samples_kept")]
    return lines + [f"  bad shard {path}: {why}" for path, why in report.get("bad_shards", {}).items()]


def format_data_report(report: dict) -> str:
    counts = report.get("counts", {})
    lines = [f"training: seen {counts.get('samples_seen', 0)}, kept {counts.get('samples_kept', 0)} "
             f"(all passes over the data; img2dataset lists {report.get('img2dataset_successes_per_pass')} "
             f"successful samples per pass)", *_drop_lines(report)]
    if "eval" in report:
        held = report["eval"].get("counts", {})
        lines += [f"held-out: seen {held.get('samples_seen', 0)}, kept {held.get('samples_kept', 0)} "
                  f"(every rank reads the whole held-out split)", *_drop_lines(report["eval"])]
    return "\n".join(lines)
