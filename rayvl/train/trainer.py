"""Driver side, wiring only: the config's data plan → Ray Datasets → TorchTrainer(DeepSpeed) → the run directory."""
from __future__ import annotations

import dataclasses
import uuid

from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from rayvl import assets, session
from rayvl import storage as store
from rayvl.config import RayvlConfig
from rayvl.data.report import caption_stats, position_report, report_actor, snapshot
from rayvl.data.shards import expected_samples
from rayvl.data.tar import resolve_shards
from rayvl.train import datasets
from rayvl.train.checkpoint import restored_state
from rayvl.train.loop import train_loop_per_worker
from rayvl.train.run_dir import RunResult, finish, run_paths


def train(cfg: RayvlConfig, callbacks: list = (), placement_registry: str = "") -> RunResult:
    """Run one training job end to end and return where everything is. ``callbacks``: Ray Train UserCallbacks
    (a Tune trial passes its report callback); ``placement_registry``: the named actor a sweep collects the runs'
    placement groups in."""
    data = datasets.plan(cfg)
    storage, name = run_paths(cfg)
    if data.prompts is not None and cfg.model.text_tower == "class_embedding":
        # [UniCL] eq. (4): one learned class embedding per class of the image-label source
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=len(data.prompts.classes)))
    started_here = session.connect(cfg.ray_address, cfg.local_num_cpus)
    session.check_resources(cfg, fixed_size=started_here)
    session.check_storage(cfg)
    report_name = f"rayvl-data-report-{name}-{uuid.uuid4().hex[:8]}"
    reports = {"train": report_name, "eval": f"{report_name}-eval", "image_label": f"{report_name}-labels"}
    for r in reports.values():
        report_actor(r)  # created by the driver, so they live as long as it does
    run_dir = store.join(storage, name)
    ontology, sizes = data.ontology, None
    if ontology is not None:
        ontology, sizes = datasets.tonics_counts(cfg, ontology, data.train, run_dir)
    expected = expected_samples(data.train)
    sets = datasets.build_datasets(cfg, data.train, data.eval, report_name,
                                   datasets.bow_deformer(cfg, data.train, run_dir), ontology,
                                   passes=datasets.train_passes(cfg, data.train, expected))
    if data.prompts is not None:  # [UniCL] App. B.2: image-label data next to (or instead of) image-text data
        labeled = datasets.labeled_dataset(cfg, data.prompts, reports["image_label"])
        sets["labeled" if cfg.image_label.weight < 1.0 else "train"] = labeled
    result = _trainer(cfg, storage, name, sets, list(callbacks), {
        "rayvl": cfg.to_dict(), "report_name": report_name, **data.files,
        "tokenizer_path": str(assets.text_model_path(cfg.model.text)), "tonics_sizes": sizes,
        "placement_registry": placement_registry, "train_shards": len(resolve_shards(data.train))}).fit()
    report = {**snapshot(reports["train"]), "img2dataset_successes_per_pass": expected,
              "eval": snapshot(reports["eval"])}
    report["captions"] = caption_stats(report["counts"])
    if result.checkpoint is not None:  # what the run trained on, per pass, across its resumes
        state = restored_state(result.checkpoint)
        report["position"] = position_report(state["data_position"], state["progress"]["resumed_at"])
    if data.prompts is not None:
        report["image_label"] = snapshot(reports["image_label"])
    return finish(run_dir, result, report)


def _trainer(cfg: RayvlConfig, storage: str, name: str, sets: dict, callbacks: list,
             loop_config: dict) -> TorchTrainer:
    t = cfg.train
    fs, inner = store.filesystem(storage)
    return TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=t.num_workers, use_gpu=t.use_gpu, placement_strategy=t.placement_strategy,
            resources_per_worker={"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})}),
        # the filesystem resolved once, as rayvl reads it back (an fsspec-only scheme works too)
        run_config=RunConfig(name=name, storage_path=inner, storage_filesystem=fs, callbacks=callbacks,
                             checkpoint_config=CheckpointConfig(num_to_keep=t.checkpoints_to_keep),
                             failure_config=FailureConfig(max_failures=t.max_failures)),
        datasets=sets,
        dataset_config=DataConfig(datasets_to_split=[k for k in ("train", "labeled") if k in sets]))
