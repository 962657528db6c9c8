"""A run's plan, made once before Ray starts: what it reads (its resolved data — each shard spec listed once, the
methods' data parts), how much (samples a pass, the passes one Ray Data execution lists, the read-ahead budget),
where it goes (storage, run name, the checkpoint a resume continues) and what it starts from (train.init_from).
``--dry-run`` prints it (rayvl.dry_run); the trainer executes it without resolving any of it again."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rayvl import storage
from rayvl.config import ConfigError, RayvlConfig, validate
from rayvl.data import shards
from rayvl.data.demo import DEMO_SHARD_SIZE
from rayvl.train import datasets
from rayvl.train.datasets import ResolvedData
from rayvl.train.layout import Layout, resolve
from rayvl.train.run_dir import check_same_shards, refuse_finished, run_paths


@dataclass(frozen=True)
class RunPlan:
    data: ResolvedData
    storage: str
    """train.storage_path, normalised."""
    name: str
    """the run's name under it (a resume's, or a new timestamped one)."""
    resumes_at: int
    """the step of the checkpoint the run continues from (0: none)."""
    init_from: str
    """train.init_from resolved to a checkpoint or export whose model settings match ('' = none)."""
    pass_size: int | None
    """samples a pass over the training shards holds (None: unknown)."""
    pass_size_from: str
    """how it was found, or why it is unknown."""
    passes: int
    """passes over the training shards the run's Ray Data execution lists."""
    read_ahead_bytes: int
    """the training stream's object-store budget."""
    layout: Layout | None = None
    """what train.zero_stage=auto chose, and why (None: the stage was set, or auto waits for the cluster's GPUs:
    ``cfg`` still says auto then, and the trainer resolves it once Ray reports them)."""

    @property
    def cfg(self) -> RayvlConfig:
        """the run's config, as its data adjusts it (rayvl.train.datasets.resolve)."""
        return self.data.cfg

    @property
    def run_dir(self) -> str:
        return storage.join(self.storage, self.name)


def plan_run(cfg: RayvlConfig, finished_ok: bool = True, dry: bool = False) -> RunPlan:
    """Everything about a run that can be wrong before Ray starts, found once (a ConfigError naming the key).
    ``finished_ok=False``: a resume of a run that reached train.max_steps is refused (a user's ``--resume``; a sweep's
    restored trial may resume its own finished run). ``dry``: as the dry run sees it — the demo dataset is not
    written, so its shards are not listed and its pass holds data.demo_samples."""
    data = datasets.resolve(cfg, make_demo=not dry)
    if data.train_shards:
        pass_size, how = shards.samples_per_pass(cfg.data.samples_per_pass, list(data.train_shards), data.train_mix)
    else:  # the dry run of the demo: one source of its shards, as the run will write them
        mix = datasets.mix_of(cfg, (math.ceil(cfg.data.demo_samples / DEMO_SHARD_SIZE),))
        pass_size = cfg.data.samples_per_pass or round(cfg.data.demo_samples * mix.n_slots / mix.sizes[0])
        how = "data.samples_per_pass" if cfg.data.samples_per_pass else "the demo's training split" + (
            f" × {mix.n_slots}/{mix.sizes[0]} shards (data.upsampling_factors)" if mix.upsampled else "")
    if cfg.train.max_passes:  # the budget in passes: its steps, before anything compares or plans by max_steps
        data = dataclasses.replace(data, cfg=steps_for_passes(data.cfg, data.parts, pass_size))
    cfg = data.cfg
    store, name, step, written = run_paths(cfg, data.train_mix.sizes if data.train_mix else ())
    if step:
        check_same_shards(storage.join(store, name), data.train_shards, step)
    if not finished_ok:
        refuse_finished(cfg, storage.join(store, name), step)
    init = check_init_from(cfg)
    passes = datasets.train_passes(data, pass_size, data.train_slots or 1)
    resolved, layout = resolve(cfg, checkpoint=written, cluster=None)
    return RunPlan(dataclasses.replace(data, cfg=resolved), store, name, step, init, pass_size, how, passes,
                   datasets.read_ahead_bytes(data), layout)


def steps_for_passes(cfg: RayvlConfig, parts, pass_size: int) -> RayvlConfig:
    """train.max_steps of a budget in passes (train.max_passes): the steps that read max_passes × ``pass_size``
    samples, a step reading workers × the micro-batch's image-text rows (what other streams' rows leave: a method's
    data part, e.g. UniCL's image-label rows) × the accumulated micro-batches — validated again with it."""
    t = cfg.train
    if not pass_size:
        raise ConfigError("train.max_passes: how many samples a pass holds is unknown for these shards (pipe: "
                          "commands, or local and remote shards mixed): set data.samples_per_pass, or give the "
                          "budget in train.max_steps")
    text_rows = t.micro_batch_size - sum(p.batch_rows(cfg) for p in parts)
    if text_rows <= 0:
        raise ConfigError("train.max_passes: no micro-batch row comes from the training shards (another stream "
                          "fills them all): give the budget in train.max_steps")
    steps = math.ceil(t.max_passes * pass_size / (t.num_workers * text_rows * t.grad_accumulation))
    resolved = dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=max(1, steps)))
    try:  # every step-bound setting (warm-up, cooldown, stop_at_step) against the resolved steps
        validate(dataclasses.replace(resolved, train=dataclasses.replace(resolved.train, max_passes=0.0)))
    except ConfigError as e:
        raise ConfigError(f"{e} (train.max_steps={steps}: train.max_passes={t.max_passes:g} of {pass_size:,} "
                          f"samples)") from None
    return resolved


def check_init_from(cfg: RayvlConfig) -> str:
    """``train.init_from`` resolved to a checkpoint or export whose model settings match this run's, before Ray
    starts ('' when unset)."""
    from rayvl.checkpoints import checkpoint_uri, read_meta
    from rayvl.export import EXPORT_META, is_export

    source = cfg.train.init_from
    if not source:
        return ""
    local = Path(source).expanduser()
    try:
        if is_export(local):
            path, meta = str(local.resolve()), json.loads((local / EXPORT_META).read_text())
        else:
            path = checkpoint_uri(source)
            meta = read_meta(path)
    except FileNotFoundError:
        raise ConfigError(f"train.init_from: {source!r} is not a rayvl run, checkpoint or export") from None
    theirs, ours = _shapes(meta["config"]["model"]), _shapes(cfg.to_dict()["model"])
    # a logit bias's initial value is not architecture; whether the model has one is
    theirs = {**theirs, "init_logit_bias": theirs.get("init_logit_bias") is not None}
    ours = {**ours, "init_logit_bias": ours.get("init_logit_bias") is not None}
    differ = [k for k in ours if k not in ARCHITECTURE_FREE and theirs.get(k) != ours[k]]
    if differ:
        raise ConfigError(f"model.{differ[0]}: {ours[differ[0]]!r} differs from {theirs.get(differ[0])!r} in "
                          f"train.init_from={source!r} — the weights would not fit (differing: "
                          f"{', '.join('model.' + k for k in differ)})")
    return path


def _shapes(model: dict) -> dict:
    """A model section as a config of today holds it: keys added since it was written at their defaults, a CLIP's
    MLP widths 4 × its widths where they were not read yet (what the model was built with then)."""
    default = RayvlConfig().to_dict()["model"]
    model = {**default, **model, "clip": {**default["clip"], **model.get("clip", {})}}
    clip = model["clip"]
    for tower in ("vision", "text"):
        clip[f"{tower}_mlp"] = clip[f"{tower}_mlp"] or 4 * clip[f"{tower}_width"]
    return model


# model settings that do not change the weights' shapes or meaning
ARCHITECTURE_FREE = ("vision_checkpoint", "init_from_clip", "init_logit_scale", "learn_logit_scale", "max_logit_scale",
                     "activation_checkpointing", "vision_strategy", "patch_dropout")
