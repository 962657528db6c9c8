"""Hyperparameter sweeps: Ray Tune over the trainer, search spaces as YAML (``tune_spaces/*.yaml``).

Train V2's pattern: each Tune trial runs a small driver function that builds and fits the same TorchTrainer
``rayvl train`` builds (``rayvl.train.trainer.train``), with a Train run named after the trial id (so a restored
sweep finds the trial's checkpoints and resumes it) and a report callback that hands rank 0's reports carrying the
sweep metric to Tune. Everything in a space file is checked against the config tree before Ray starts.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rayvl import storage
from rayvl.config import ConfigError, RayvlConfig, load_config, read_yaml

DOMAINS = ("grid", "choice", "uniform", "loguniform", "randint")
SCHEDULERS = ("asha", "fifo")
FILE_KEYS = {"recipe", "metric", "mode", "num_samples", "scheduler", "set", "demo", "space",
             "max_concurrent_trials", "name", "variants"}
SCHEDULER_KEYS = {"kind", "grace_period", "reduction_factor", "max_t"}
MAX_GRID_CHECKED = 1000  # grid combinations validated one by one before Ray starts


class SweepError(ConfigError):
    """A search-space file is wrong; the message names the file and the key."""


@dataclass
class Sweep:
    """A search space as read from its YAML file, validated."""

    path: str
    recipe: str  # the recipe YAML the sweep applies to
    metric: str
    mode: str  # "max" or "min"
    space: dict[str, dict]  # dotted config key → {domain: arguments}
    fixed: list[str] = field(default_factory=list)  # "key=value" overrides every trial gets (set, demo, --set)
    num_samples: int = 1
    scheduler: dict = field(default_factory=lambda: {"kind": "fifo"})
    max_concurrent_trials: int = 0  # 0 = as many as the cluster holds at its largest (its autoscaler's max_workers)
    name: str = ""
    # named bundles of "key=value" overrides, one more grid dimension (rayvl.compare: variants × seeds)
    variants: dict[str, list[str]] = field(default_factory=dict)
    # "module:function" each trial calls on its finished run for more metrics (e.g. a held-out evaluation), its
    # keyword arguments, and the metric names it returns (a sweep may rank trials by them)
    after: str = ""
    after_kwargs: dict = field(default_factory=dict)
    after_metrics: tuple[str, ...] = ()
    rows: list = field(default_factory=list)  # a comparison's table: (label, metric, format) rows (rayvl.compare)
    # a comparison run in stages: the directories of its earlier stages, whose trials its report includes
    parts: list[str] = field(default_factory=list)

    def base_config(self, overrides: list[str] = ()) -> RayvlConfig:
        return load_config(self.recipe, self.fixed + list(overrides))


def trial_config(recipe: str, fixed: list[str], values: dict, variant: list[str] = ()) -> RayvlConfig:
    """The full config of one trial: the recipe, the sweep's fixed overrides, its variant's, then its values."""
    return load_config(recipe, list(fixed) + list(variant) + [f"{k}={_yaml(v)}" for k, v in values.items()])


def load_sweep(path: str | os.PathLike, overrides: list[str] = ()) -> Sweep:
    """Read and validate a space file. Every trial gets its ``set`` (what the question fixes, on any data), then
    on the embedded demo only its ``demo`` (the per-trial budget that fits a laptop), then ``overrides``
    ("key=value", e.g. from --set), which win over both."""
    path = str(path)
    try:
        raw = read_yaml(path, "search space") or {}  # 1e-3 is a number here too
    except ConfigError as e:
        raise SweepError(str(e)) from None
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: a search space is a mapping (recipe, metric, mode, space, ...)")
    unknown = sorted(set(raw) - FILE_KEYS)
    if unknown:
        raise SweepError(f"{path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(FILE_KEYS))})")
    for key in ("recipe", "metric", "space"):
        if key not in raw:
            raise SweepError(f"{path}: {key}: missing")
    recipe = _recipe_path(path, raw["recipe"])
    fixed = [f"{k}={_yaml(v)}" for k, v in (raw.get("set") or {}).items()]
    if on_demo(recipe, fixed + list(overrides)):
        fixed += [f"{k}={_yaml(v)}" for k, v in (raw.get("demo") or {}).items()]
    sweep = Sweep(path, recipe, str(raw["metric"]), str(raw.get("mode", "max")), raw["space"],
                  fixed + list(overrides), int(raw.get("num_samples", 1)),
                  dict(raw.get("scheduler") or {"kind": "fifo"}), int(raw.get("max_concurrent_trials", 0)),
                  str(raw.get("name", "")), _variants(path, raw))
    validate(sweep)
    return sweep


def on_demo(recipe: str, overrides: list[str]) -> bool:
    """Whether trials read the embedded demo dataset: neither the recipe nor the overrides give data.train."""
    from rayvl.config import parse_override

    train = ((read_yaml(recipe, "recipe") or {}).get("data") or {}).get("train", "")
    for text in overrides:
        train = parse_override(text).get("data", {}).get("train", train)
    return not train


def _variants(path: str, raw: dict) -> dict[str, list[str]]:
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict) or not all(isinstance(v, dict) or v is None for v in variants.values()):
        raise SweepError(f"{path}: variants: a mapping of names to config overrides, e.g. "
                         f"{{tonics: {{tonics.enabled: true}}, random: {{tonics.enabled: false}}}}")
    return {str(name): [f"{k}={_yaml(v)}" for k, v in (overrides or {}).items()]
            for name, overrides in variants.items()}


def _recipe_path(space_file: str, recipe: str) -> str:
    """A recipe path as written: absolute, relative to the working directory, or to the repository root."""
    for candidate in (Path(recipe).expanduser(), Path(space_file).resolve().parent.parent / recipe):
        if candidate.is_file():
            return str(candidate.resolve())  # trials run with their trial directory as working directory
    raise SweepError(f"{space_file}: recipe: {recipe!r} not found")


def _yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def validate(s: Sweep) -> None:
    """Every key, value, variant and grid combination against the config tree; the metric, the scheduler."""
    where = s.path
    if s.mode not in ("max", "min"):
        raise SweepError(f"{where}: mode: {s.mode!r} is not max or min")
    if s.num_samples < 1:
        raise SweepError(f"{where}: num_samples: must be ≥ 1, got {s.num_samples}")
    try:
        base = s.base_config()
    except ConfigError as e:
        raise SweepError(f"{where}: set: {e}") from None
    for name, overrides in s.variants.items():
        _check(s, {}, f"variants.{name}", overrides)
    reported = reported_metrics(base) | set(s.after_metrics)
    if s.metric not in reported:
        raise SweepError(f"{where}: metric: {s.metric!r} is not reported by this recipe's training (eval.tasks "
                         f"{base.eval.tasks}); one of: {', '.join(sorted(reported))}")
    _check_evaluated(s, base)
    _validate_scheduler(s, base)
    if not isinstance(s.space, dict) or not (s.space or s.variants):
        raise SweepError(f"{where}: space: a mapping of config keys to domains, e.g. "
                         f"model.alignment_layers: {{grid: [0, 2, 4]}}")
    values = {key: _domain_values(where, key, domain) for key, domain in s.space.items()}
    variants = s.variants or {"": []}
    for key, candidates in values.items():
        for value in candidates:  # each value on its own, on top of the recipe, the fixed overrides, each variant
            for name, overrides in variants.items():
                _check(s, {key: value}, f"space.{key}" + (f" (variant {name})" if name else ""), overrides)
    grid = {k: v for k, v in values.items() if "grid" in s.space[k]}
    combos = math.prod(len(v) for v in grid.values()) * len(variants)
    if 1 < len(grid) and combos <= MAX_GRID_CHECKED:  # one key: its values were checked above, with each variant
        for combo in itertools.product(*grid.values()):
            for name, overrides in variants.items():
                _check(s, dict(zip(grid, combo)), "space (" + ", ".join(grid) + ")"
                       + (f" (variant {name})" if name else ""), overrides)


def reported_metrics(cfg: RayvlConfig) -> set[str]:
    """Metric names a training run of this config reports that a sweep can optimise."""
    k = cfg.eval.paraphrase_k
    by_task = {"zeroshot": ["zeroshot_top1", "zeroshot_top5", "zeroshot_mean_per_class_recall"],
               "retrieval": [f"{d}_R@{n}" for d in ("t2i", "i2t") for n in (1, 5, 10)],
               "paraphrase": [f"paraphrase_AO@{k}", f"paraphrase_JS@{k}"], "sts": ["sts_spearman", "sts_pearson"]}
    return {"loss", "lr", "logit_scale", *(m for task in cfg.eval.tasks for m in by_task[task])}


def _check_evaluated(s: Sweep, base: RayvlConfig) -> None:
    """An evaluation metric as the sweep's metric or a comparison's row needs held-out shards: given data.train
    and no data.eval, training switches its evaluation off (rayvl.train.datasets.evaluation_or_off; only the
    embedded demo brings its own held-out split), so Tune would never get the metric and the table would show
    "-". Checked for the recipe and each variant (a variant may name its own data)."""
    wanted = {s.metric: "metric", **{row[1]: f"row {row[0]!r}" for row in s.rows if row[1] != s.metric}}
    for name, overrides in (s.variants or {"": []}).items():
        cfg = trial_config(s.recipe, s.fixed, {}, overrides) if overrides else base
        if cfg.data.eval or not cfg.data.train or not cfg.eval.tasks:
            continue
        from rayvl.eval.tasks import METRIC_PREFIXES  # what the evaluation's metric names start with

        evaluated = [m for m in wanted if m.startswith(METRIC_PREFIXES)]
        if evaluated:
            metric = evaluated[0]
            variant = f" (variant {name})" if cfg.data.train != base.data.train else ""
            raise SweepError(f"{s.path}: {wanted[metric]}: {metric!r} is an evaluation metric, but data.train is "
                             f"given without data.eval{variant}: training would not evaluate and never report it; "
                             f"give held-out shards (--eval-data, or --set data.eval=SHARDS)")


def _domain_values(where: str, key: str, domain) -> list:
    """The values a domain can take that are worth checking: every listed value, or both ends of a range."""
    if not isinstance(domain, dict) or len(domain) != 1 or next(iter(domain)) not in DOMAINS:
        raise SweepError(f"{where}: space.{key}: expected one of {{{', '.join(DOMAINS)}: ...}}, got {domain!r}")
    kind, args = next(iter(domain.items()))
    if kind in ("grid", "choice"):
        if not isinstance(args, list) or not args:
            raise SweepError(f"{where}: space.{key}: {kind} takes a non-empty list, got {args!r}")
        return args
    if not (isinstance(args, list) and len(args) == 2 and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                                               for a in args) and args[0] < args[1]):
        raise SweepError(f"{where}: space.{key}: {kind} takes [low, high] with low < high, got {args!r}")
    if kind == "loguniform" and args[0] <= 0:
        raise SweepError(f"{where}: space.{key}: loguniform needs low > 0, got {args!r}")
    if kind == "randint":
        if not all(isinstance(a, int) for a in args):
            raise SweepError(f"{where}: space.{key}: randint takes whole numbers [low, high), got {args!r}")
        return [args[0], args[1] - 1]
    return list(args)


def _check(s: Sweep, values: dict, label: str, variant: list[str] = ()) -> None:
    try:
        trial_config(s.recipe, s.fixed, values, variant)
    except ConfigError as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise SweepError(f"{s.path}: {label}: {shown}: {e}") from None


def _validate_scheduler(s: Sweep, base: RayvlConfig) -> None:
    sch = s.scheduler
    unknown = sorted(set(sch) - SCHEDULER_KEYS)
    if unknown:
        raise SweepError(f"{s.path}: scheduler.{unknown[0]}: unknown key (known: {', '.join(sorted(SCHEDULER_KEYS))})")
    if sch.get("kind", "fifo") not in SCHEDULERS:
        raise SweepError(f"{s.path}: scheduler.kind: {sch.get('kind')!r} is not one of {', '.join(SCHEDULERS)}")
    if sch.get("kind") == "asha":
        max_t = int(sch.get("max_t", base.train.max_steps))
        grace = _grace_period(sch, base)
        if not 1 <= grace <= max_t:
            raise SweepError(f"{s.path}: scheduler.grace_period: must be in [1, max_t={max_t}], got {grace}")
        if float(sch.get("reduction_factor", 2)) <= 1:
            raise SweepError(f"{s.path}: scheduler.reduction_factor: must be > 1")
        if not base.eval.every_steps and s.metric not in ("loss",):
            raise SweepError(f"{s.path}: scheduler.kind: ASHA stops trials on {s.metric!r}, which training reports "
                             f"only when it evaluates: set eval.every_steps (--set eval.every_steps=N)")


def _grace_period(scheduler: dict, base: RayvlConfig) -> int:
    """ASHA's first rung in steps: as the space gives it, else the first evaluation (the metric's first value), so
    the rungs follow the budget a run is given."""
    return int(scheduler.get("grace_period") or base.eval.every_steps or 1)


# ----------------------------------------------------------------------------- running a sweep

def trial_bundles(cfg: RayvlConfig) -> list[dict]:
    """What one trial takes besides its driver: a bundle per Train worker and a CPU for Ray Data. Train V2 workers
    get their own placement group outside Tune's accounting, and Ray Data's tasks none, so Tune cannot see this."""
    t = cfg.train
    worker = {"CPU": t.cpus_per_worker, **({"GPU": 1.0} if t.use_gpu else {})}
    # a whole CPU per trial for Ray Data, whatever data.read_cpus says: besides its read tasks, each trial's
    # streaming-split coordinator runs the executor loop (measured ≈ 1/3 of a core each): on 2 cores, two trials
    # of one worker each ran 10 steps in ≈ 60 s, one trial of two workers alone in ≈ 10 s
    return [dict(worker) for _ in range(t.num_workers)] + [{"CPU": max(1.0, cfg.data.read_cpus)}]


def concurrent_trials(cfg: RayvlConfig, resources: dict) -> int:
    """How many trials ``resources`` (a cluster's totals) hold at once: drivers, Train workers and Ray Data."""
    need: dict[str, float] = {}
    for bundle in [cfg.tune.driver_bundle(), *trial_bundles(cfg)]:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    return min(int(resources.get(name, 0.0) // amount) for name, amount in need.items() if amount > 0)


def _tune_domain(domain: dict):
    from ray import tune

    kind, args = next(iter(domain.items()))
    return {"grid": lambda: tune.grid_search(args), "choice": lambda: tune.choice(args),
            "uniform": lambda: tune.uniform(*args), "loguniform": lambda: tune.loguniform(*args),
            "randint": lambda: tune.randint(*args)}[kind]()


def _scheduler(sweep: Sweep, base: RayvlConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = sweep.scheduler
    if s.get("kind", "fifo") == "fifo":
        return FIFOScheduler()
    # time is the optimizer step every report carries, so rungs are in steps whatever eval.every_steps is
    return ASHAScheduler(time_attr="step", max_t=int(s.get("max_t", base.train.max_steps)),
                         grace_period=_grace_period(s, base),
                         reduction_factor=float(s.get("reduction_factor", 2)))


def trial(config: dict) -> None:
    """One Tune trial: the sweep's recipe with this trial's values, trained by the trainer `rayvl train` runs.
    Its Train run is named after the trial id, so a restored sweep resumes the trial from its checkpoints."""
    import dataclasses

    from ray import tune

    from rayvl.checkpoints import latest_checkpoint_dir
    from rayvl.train.trainer import train

    variant = config.get("variant", "")
    cfg = trial_config(config["recipe"], config["fixed"], config["set"], config.get("variants", {}).get(variant, []))
    name = f"trial-{tune.get_context().get_trial_id()}"
    resume = latest_checkpoint_dir(storage.join(config["storage"], name)) is not None
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_name=name, resume=resume,
                                                             storage_path=config["storage"]))
    result = train(cfg, callbacks=[_metric_report(config["metric"])], placement_registry=config["registry"])
    write_final_metrics(result, variant, config["set"], config.get("after", ""), config.get("after_kwargs", {}))


FINAL_METRICS = "final_metrics.json"  # in each trial's run directory: what rayvl.compare summarises


def hook(spec: str):
    """The function a "module:function" setting names (a trial's ``after``, a comparison's ``notes``)."""
    import importlib

    module, function = spec.split(":")
    return getattr(importlib.import_module(module), function)


def write_final_metrics(result, variant: str, values: dict, after: str = "", after_kwargs: dict | None = None) -> dict:
    """The trial's final numbers in its run directory: the last report's metrics, the caption statistics of its data
    report and what ``after`` ("module:function", called with the run's result) adds."""
    import json

    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update(result.data_report["captions"])  # caption_stats, computed by train()
    metrics["samples_kept"] = result.data_report["counts"].get("samples_kept", 0)
    if after:
        metrics.update(hook(after)(result, **(after_kwargs or {})))
    record = {"variant": variant, "values": values, "metrics": metrics, "checkpoint": result.checkpoint_dir}
    storage.write_text(storage.join(result.uri, FINAL_METRICS), json.dumps(record, indent=2))
    return record


class PlacementRegistry:
    """Which placement group each trial's Train run holds (rank 0 registers it, by run name)."""

    def __init__(self):
        self.groups: dict[str, str] = {}

    def register(self, run_name: str, group_id: str) -> None:
        self.groups[run_name] = group_id

    def group(self, run_name: str) -> str | None:
        return self.groups.get(run_name)


def _release_callback(registry: str):
    """A Tune callback that removes a finished, stopped or failed trial's worker placement group if Train left it.
    Train V2 creates the group in its controller actor, so it outlives the trial (a placement group lives as long
    as its job); Train's own cleaner asks the State API whether the controller is alive, and here it timed out
    every time ("Timed out while waiting for GCS"), so without this every early-stopped trial kept its CPUs and the
    next trials' Ray Data starved (Ray issue #54305 is the same leak). It holds the registry's name, not a handle:
    Tune saves its callbacks with the sweep's state, and a resumed sweep runs in another Ray session."""
    import ray
    from ray.tune import Callback
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup

    class ReleaseTrialResources(Callback):
        def _release(self, trial) -> None:
            actor = ray.get_actor(registry, namespace="rayvl")
            group = ray.get(actor.group.remote(f"trial-{trial.trial_id}"))
            if group and placement_group_table().get(group, {}).get("state") not in (None, "REMOVED"):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group))))

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._release(trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._release(trial)

    return ReleaseTrialResources()


def _metric_report(metric: str):
    """Tune's TuneReportCallback for the reports that carry the sweep metric (Tune checks every result for it;
    eval metrics come only every eval.every_steps)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class MetricReport(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metric in metrics[0]:
                super().after_report(run_context, metrics, checkpoint)

    return MetricReport()


def sweep_directory(base: RayvlConfig, name: str) -> str:
    """Where a sweep named ``name`` keeps its state and runs: under tune.storage_path (a local path or a URL, as
    train.storage_path)."""
    return storage.join(storage.normalize(base.tune.storage_path), name)


def run_sweep(sweep: Sweep, overrides: list[str] = (), name: str = "", resume: bool = False):
    """Start (or with ``resume`` continue) the sweep; returns (sweep directory, Tune's ResultGrid)."""
    import ray
    from ray import tune
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayvl import session

    base = sweep.base_config(overrides)
    name = name or sweep.name or Path(sweep.path).stem
    store = storage.normalize(base.tune.storage_path)
    sweep_dir = sweep_directory(base, name)
    if resume != storage.exists(sweep_dir):
        raise SweepError(f"{sweep.path}: sweep {sweep_dir!r} {'has no state to resume' if resume else 'exists'}"
                         f": {'drop --resume' if resume else 'pass --resume to continue it, or --name another'}")
    if not resume:
        save_settings(sweep, sweep_dir, overrides)
    fs, inner = storage.filesystem(store)
    session.check_local_gpus(base)
    fixed_size = session.connect(base.ray_address, base.local_num_cpus)
    session.check_storage(base)
    session.check_gpus(base, fixed_size)
    trainable = tune.with_resources(trial, base.tune.driver_bundle())
    # named after the sweep directory, so the trial configs and the callback a resumed sweep restores still find it
    registry_name = f"rayvl-placement-{hashlib.sha1(sweep_dir.encode()).hexdigest()[:12]}"
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)  # not a worker node
    registry = ray.remote(num_cpus=0)(PlacementRegistry).options(
        name=registry_name, namespace="rayvl", get_if_exists=True, scheduling_strategy=here).remote()
    release = _release_callback(registry_name)
    space = _param_space(sweep, overrides, sweep_dir, registry_name)
    if resume:  # Tune's saved state brings back the trials, the scheduler and the RunConfig with its callbacks
        tuner = tune.Tuner.restore(posixpath.join(inner, name), trainable, resume_unfinished=True,
                                   resume_errored=False, storage_filesystem=fs, param_space=space)
    else:
        tuner = tune.Tuner(trainable, param_space=space, tune_config=tune.TuneConfig(
            metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples, scheduler=_scheduler(sweep, base),
            max_concurrent_trials=_concurrency(sweep, base, fixed_size)), run_config=tune.RunConfig(
            name=name, storage_path=inner, storage_filesystem=fs, verbose=1, callbacks=[release]))
    try:
        return sweep_dir, tuner.fit()
    finally:
        ray.kill(registry)  # every trial has ended and been released


def _param_space(sweep: Sweep, overrides: list[str], sweep_dir: str, registry: str) -> dict:
    from ray import tune

    space = {"set": {k: _tune_domain(d) for k, d in sweep.space.items()}, "recipe": sweep.recipe,
             "fixed": sweep.fixed + list(overrides), "metric": sweep.metric,
             "storage": storage.join(sweep_dir, "runs"), "registry": registry, "after": sweep.after,
             "after_kwargs": sweep.after_kwargs}
    if sweep.variants:
        space.update(variant=tune.grid_search(list(sweep.variants)), variants=sweep.variants)
    return space


def _concurrency(sweep: Sweep, cfg: RayvlConfig, fixed_size: bool) -> int:
    """Tune's limit on trials at once: the space's max_concurrent_trials, else as many as the cluster holds at its
    largest (session.largest_cluster: its autoscaler's node types at their max_workers). Trials beyond the nodes
    there are now wait for their Train placement groups, whose demand is what makes the autoscaler add nodes, and
    run as the nodes arrive."""
    from rayvl import session

    if sweep.max_concurrent_trials:
        return sweep.max_concurrent_trials
    largest, autoscaled = session.largest_cluster()
    n = concurrent_trials(cfg, largest)
    if n >= 1:
        if autoscaled:
            print(f"rayvl tune: up to {n} trials at once, what the cluster holds at its largest: {_shown(largest)}")
        return n
    worker, data = trial_bundles(cfg)[0], trial_bundles(cfg)[-1]
    message = (f"one trial needs {{{_shown(cfg.tune.driver_bundle())}}} for its driver (tune.driver_cpus / "
               f"tune.driver_resources), {cfg.train.num_workers} × {{{_shown(worker)}}} for its Train workers and "
               f"{{{_shown(data)}}} for Ray Data, more than the cluster {'can grow to' if autoscaled else 'has'}: "
               f"{{{_shown(largest)}}}")
    if fixed_size or autoscaled:
        raise SweepError(message)
    print(f"rayvl tune: warning: {message}; running one trial at a time (no autoscaler config found on this node)")
    return 1


def _shown(resources: dict) -> str:
    """A cluster's resources as a person reads them: CPUs, GPUs and custom resources, not memory or node ids."""
    hidden = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if not k.startswith(hidden)) or "none"


# ----------------------------------------------------------------------------- what a finished sweep leaves

SWEEP_FILE = "rayvl_sweep.json"  # the sweep's settings, so `rayvl tune --report DIR` needs nothing else


def save_settings(sweep: Sweep, sweep_dir: str, overrides: list[str] = ()) -> None:
    import json

    base = sweep.base_config(overrides)
    storage.write_text(storage.join(sweep_dir, SWEEP_FILE), json.dumps({
        "space_file": sweep.path, "recipe": sweep.recipe, "fixed": sweep.fixed + list(overrides),
        "metric": sweep.metric, "mode": sweep.mode, "keys": list(sweep.space), "max_steps": base.train.max_steps,
        "variants": sweep.variants, "after": sweep.after, "rows": sweep.rows, "parts": sweep.parts}, indent=2))


def trial_rows(sweep_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(the sweep's settings, one row per trial: its values, final and best metric, steps, status, error),
    best first. Works on a finished or an interrupted sweep (Tune's experiment state on disk)."""
    import json

    from ray.tune import ExperimentAnalysis

    sweep_dir = storage.normalize(sweep_dir)
    settings = json.loads(storage.read_text(storage.join(sweep_dir, SWEEP_FILE)))
    metric, sign = settings["metric"], 1 if settings["mode"] == "max" else -1
    fs, inner = storage.filesystem(sweep_dir)
    analysis = ExperimentAnalysis(inner, storage_filesystem=fs)
    frames = analysis.trial_dataframes
    rows = []
    for t in analysis.trials:
        frame = frames.get(t.trial_id)
        series = frame[metric].dropna() if frame is not None and metric in frame else None
        last = t.last_result or {}
        steps = int(last.get("step", 0) or 0)
        status = t.status
        if status == "TERMINATED" and steps < settings["max_steps"]:
            status = "STOPPED EARLY"  # a scheduler's decision, not a failure
        rows.append({"trial": t.trial_id, **({"variant": t.config.get("variant")} if settings.get("variants") else {}),
                     **{k: t.config["set"].get(k) for k in settings["keys"]},
                     "final": last.get(metric), "best": None if series is None or series.empty
                     else float(series.max() if sign > 0 else series.min()), "steps": steps, "status": status,
                     "error": _error_line(sweep_dir, t), "curve": [] if series is None else
                     list(zip(frame.loc[series.index, "step"].tolist(), series.tolist()))})
    rows.sort(key=lambda r: (r["final"] is None, -sign * (r["final"] or 0.0)))
    return settings, rows


def columns(settings: dict) -> list[str]:
    """What tells a sweep's trials apart: the variant (a comparison's) and the searched keys."""
    return (["variant"] if settings.get("variants") else []) + settings["keys"]


def _error_line(sweep_dir: str, t) -> str:
    """The last line of a failed trial's traceback, from the sweep's storage: ``t.error_file`` names the staging
    folder of the Ray session the trial failed in, gone once that session ended (a trial that failed before an
    interruption, read by the resumed sweep)."""
    if t.status != "ERROR":
        return ""
    path = storage.join(sweep_dir, Path(t.path).name, "error.txt")
    text = storage.read_text(path) if storage.is_file(path) else ""
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def format_trials(settings: dict, rows: list[dict]) -> str:
    keys, metric = columns(settings), settings["metric"]
    head = ["#", "trial", *keys, f"final {metric}", f"best {metric}", "steps", "status"]
    shown = [[str(i + 1), r["trial"], *(str(r[k]) for k in keys), _num(r["final"]), _num(r["best"]),
              str(r["steps"]), r["status"] + (f": {r['error']}" if r["error"] else "")] for i, r in enumerate(rows)]
    widths = [max(len(x) for x in col) for col in zip(head, *shown)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *shown])


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def write_report(sweep_dir: str | os.PathLike) -> tuple[str, list[str]]:
    """trials.csv, one PNG of the metric against each swept key, learning_curves.png, best_config.yaml in the
    sweep directory (local or a URL); returns the printed table and the files' names."""
    import tempfile

    sweep_dir = storage.normalize(sweep_dir)
    settings, rows = trial_rows(sweep_dir)
    local = storage.local_path(sweep_dir)
    with tempfile.TemporaryDirectory(prefix="rayvl-sweep-report-") as staging:
        out = local or Path(staging)  # object storage: written here, then uploaded
        _report_files(out, settings, rows)
        names = sorted(p.name for p in out.iterdir() if p.suffix in (".csv", ".png", ".yaml"))
        if local is None:
            for n in names:
                storage.write_bytes(storage.join(sweep_dir, n), (out / n).read_bytes())
    return format_trials(settings, rows), names


def _report_files(sweep_dir: Path, settings: dict, rows: list[dict]) -> None:
    import csv

    fields = ["trial", *columns(settings), "final", "best", "steps", "status", "error"]
    with open(sweep_dir / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    _plots(sweep_dir, settings, rows)
    best = next((r for r in rows if r["final"] is not None), None)
    if best is not None:
        _best_recipe(sweep_dir / "best_config.yaml", settings, best)


def _plots(sweep_dir: Path, settings: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    metric = settings["metric"]
    scored = [r for r in rows if r["final"] is not None]
    for key in columns(settings):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        labels = sorted({str(r[key]) for r in scored}, key=lambda v: (_as_float(v) is None, _as_float(v) or 0, v))
        ax.scatter([labels.index(str(r[key])) for r in scored], [r["final"] for r in scored])
        ax.set_xticks(range(len(labels)), labels)
        ax.set(xlabel=key, ylabel=f"final {metric}", title=f"{metric} against {key}")
        fig.tight_layout()
        fig.savefig(sweep_dir / f"{metric.replace('@', 'at')}_vs_{key}.png", dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["curve"]:
            steps, values = zip(*r["curve"])
            ax.plot(steps, values, marker="o", label=", ".join(f"{k.split('.')[-1]}={r[k]}" for k in columns(settings)))
    ax.set(xlabel="step", ylabel=metric, title="learning curves (each trial)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sweep_dir / "learning_curves.png", dpi=120)
    plt.close(fig)


def _as_float(v: str):
    try:
        return float(v)
    except ValueError:
        return None


def _best_recipe(path: Path, settings: dict, best: dict) -> None:
    """The best trial's full config as a recipe YAML (`jobs/laion_adapt.py --config` takes it)."""
    cfg = trial_config(settings["recipe"], settings["fixed"], {k: best[k] for k in settings["keys"]},
                       settings.get("variants", {}).get(best.get("variant"), []))
    values = _plain(cfg.to_dict())
    values["train"].update(run_name="", resume=False)
    header = (f"# best trial {best['trial']} of the sweep {settings['space_file']}: final {settings['metric']} "
              f"{best['final']:.4g}\n")
    path.write_text(header + yaml.safe_dump(values, sort_keys=False))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def sweep_and_report(sweep: Sweep, overrides: list[str] = (), name: str = "", resume: bool = False) -> str:
    """Run the sweep, then print the trial table and write the CSV, the plots and the best recipe next to it."""
    sweep_dir, results = run_sweep(sweep, overrides, name, resume)
    print(f"\n== sweep {sweep_dir.rstrip('/').rsplit('/', 1)[-1]}: {len(results)} trials, "
          f"{results.num_errors} failed ==")
    table, files = write_report(sweep_dir)
    print(table)
    print(f"\nsweep directory: {sweep_dir}\n  table:  {storage.join(sweep_dir, 'trials.csv')}\n  plots:  "
          + ", ".join(n for n in files if n.endswith(".png"))
          + f"\n  best:   {storage.join(sweep_dir, 'best_config.yaml')} (python jobs/laion_adapt.py --config ...)")
    return sweep_dir
