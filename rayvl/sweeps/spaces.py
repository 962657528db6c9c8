"""Search spaces: a ``tune_spaces/*.yaml`` file read into a typed ``Sweep`` and checked against the config tree before
Ray starts — every key, every value of a domain (both ends of a range), every grid combination, the metric and the
scheduler — so a wrong key fails naming the file and the key."""
from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rayvl.config import (ConfigError, RayvlConfig, check_overrides, installed_file, load_config, parse_override,
                          read_yaml, recipe_file)

DOMAINS = ("grid", "choice", "uniform", "loguniform", "randint")
SCHEDULERS = ("asha", "fifo")
FILE_KEYS = {"recipe", "metric", "mode", "num_samples", "scheduler", "set", "demo", "space",
             "max_concurrent_trials", "name", "variants"}
SCHEDULER_KEYS = {"kind", "grace_period", "reduction_factor", "max_t"}
MAX_GRID_CHECKED = 1000  # grid combinations validated one by one before Ray starts
FLOAT_DOMAINS = ("uniform", "loguniform")
FLOATS_HINT = " (uniform and loguniform draw floats; randint or choice gives whole numbers)"
HELD_OUT = "--set data.eval=SHARDS"  # how `rayvl tune` gives held-out shards
# the keys a trial's budget in steps depends on: its own, and with a budget in passes what a step reads
# (rayvl.train.run_plan.steps_for_passes), besides data.*, which decide what a pass holds
BUDGET_KEYS = ("train.max_steps", "train.max_passes")
PASS_KEYS = ("train.micro_batch_size", "train.num_workers", "train.grad_accumulation")


class SweepError(ConfigError):
    """A search space is wrong; the message names the file (or the comparison) and the key."""


@dataclass
class Sweep:
    """A search space, validated: what Tune searches and how it ranks and stops trials."""

    path: str  # the space file, or the title of the comparison that made this grid
    recipe: str  # the recipe YAML the trials apply to
    metric: str
    mode: str  # "max" or "min"
    space: dict[str, dict]  # dotted config key → {domain: arguments}
    fixed: list[str] = field(default_factory=list)  # "key=value" overrides every trial gets (set, demo, --set)
    num_samples: int = 1
    scheduler: dict = field(default_factory=lambda: {"kind": "fifo"})
    max_concurrent_trials: int = 0  # 0 = as many as the cluster holds at its largest (its autoscaler's max_workers)
    name: str = ""
    # named sets of "key=value" overrides, one more grid dimension (each trial gets one set, after ``fixed``)
    variants: dict[str, list[str]] = field(default_factory=dict)
    # the command line's --set (in ``fixed`` too): it wins over a variant's value of the same key (pinned_variants),
    # and a key the space sweeps is refused (the swept values would win over it)
    pinned: list[str] = field(default_factory=list)

    def base_config(self, overrides: list[str] = ()) -> RayvlConfig:
        return load_config(self.recipe, self.fixed + list(overrides))


def trial_config(recipe: str, fixed: list[str], values: dict, variant: list[str] = (),
                 cwd: str | None = None) -> RayvlConfig:
    """The full config of one trial: the recipe, the sweep's fixed overrides, its variant's, then its values; their
    relative paths under ``cwd`` (a trial runs in its own folder: the sweep's command's working directory)."""
    return load_config(recipe, list(fixed) + list(variant) + [f"{k}={as_yaml(v)}" for k, v in values.items()],
                       cwd=cwd)


def load_sweep(path: str | os.PathLike, overrides: list[str] = ()) -> Sweep:
    """Read and validate a space file. Every trial gets its ``set`` (what the question fixes, on any data), then
    on the embedded demo only its ``demo`` (the per-trial budget that fits a laptop), then its variant's overrides;
    ``overrides`` ("key=value", e.g. from --set) win over all of them. A key the space sweeps is not one of them."""
    path = str(installed_file(path, "search space"))  # a path, or a space installed with rayvl by its name
    raw = _read_space(path)
    recipe = _recipe_path(path, raw["recipe"])
    try:  # a mistake of the command line's own is its own, not the space file's
        check_overrides(list(overrides))
    except ConfigError as e:
        raise SweepError(f"--set {e}") from None
    fixed = _overrides(path, raw, "set")
    if on_demo(recipe, fixed + list(overrides)):
        fixed += _overrides(path, raw, "demo")
    scheduler = _mapping(path, "scheduler", raw.get("scheduler") or {"kind": "fifo"}, "{kind: asha, grace_period: 100}")
    sweep = Sweep(path, recipe, str(raw["metric"]), str(raw.get("mode", "max")), raw["space"],
                  fixed + list(overrides), raw.get("num_samples", 1), dict(scheduler),
                  raw.get("max_concurrent_trials", 0), str(raw.get("name", "")),
                  pinned_variants(path, _variants(path, raw), list(overrides)), list(overrides))
    validate(sweep)
    return sweep


def _read_space(path: str) -> dict:
    """The space file's mapping, its keys known and the required ones there."""
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
    return raw


def _mapping(path: str, key: str, value, example: str) -> dict:
    if not isinstance(value, dict):
        raise SweepError(f"{path}: {key}: a mapping, e.g. {example}, got {value!r}")
    return value


def _overrides(path: str, raw: dict, key: str) -> list[str]:
    """A section of config keys and values (``set``, ``demo``) as "key=value" overrides."""
    section = _mapping(path, key, raw.get(key) or {}, "{train.max_steps: 1000, eval.every_steps: 100}")
    return [f"{k}={as_yaml(v)}" for k, v in section.items()]


def on_demo(recipe: str, overrides: list[str]) -> bool:
    """Whether trials read the embedded demo dataset: neither the recipe nor the overrides give data.train."""
    train = ((read_yaml(recipe_file(recipe), "recipe") or {}).get("data") or {}).get("train", "")
    for text in overrides:
        train = parse_override(text).get("data", {}).get("train", train)
    return not train


def _variants(path: str, raw: dict) -> dict[str, list[str]]:
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict) or not all(isinstance(v, dict) or v is None for v in variants.values()):
        raise SweepError(f"{path}: variants: a mapping of names to config overrides, e.g. "
                         f"{{warm: {{train.warmup_steps: 500}}, cold: {{train.warmup_steps: 0}}}}")
    return {str(name): [f"{k}={as_yaml(v)}" for k, v in (overrides or {}).items()]
            for name, overrides in variants.items()}


def pinned_variants(where: str, variants: dict[str, list[str]], pinned: list[str]) -> dict[str, list[str]]:
    """Each variant's overrides, then the --set values (``pinned``) of the keys it sets too: a variant comes after
    the fixed overrides, so its own value would win over --set otherwise. --set that makes two different variants
    the same is an error naming both (``--variants clip,siglip --set loss.kind=siglip``: two SigLIP arms)."""
    pins = {override_key(o): o for o in pinned}
    out = {name: v + [pins[k] for k in dict.fromkeys(map(override_key, v)) if k in pins]
           for name, v in variants.items()}
    seen: dict[tuple, str] = {}
    for name, v in out.items():
        first = seen.setdefault(_settings([*pins.values(), *v]), name)
        if first != name and _settings(variants[first]) != _settings(variants[name]):
            keys = set(pins) & {override_key(o) for o in variants[first] + variants[name]}
            raise SweepError(f"{where}: --set {', '.join(sorted(keys))}: variants {first!r} and {name!r} "
                             f"would be the same")
    return out


def override_key(override: str) -> str:
    """The dotted config key of a "key=value" override."""
    return override.partition("=")[0].strip()


def _settings(overrides: list[str]) -> tuple:
    """What "key=value" overrides set, the last of a key winning, as a comparable value."""
    return tuple(sorted({override_key(o): o.partition("=")[2].strip() for o in overrides}.items()))


def _recipe_path(space_file: str, recipe: str) -> str:
    """A recipe path as written: absolute, relative to the working directory, or to the repository root (of an
    installed space: the installed package, which holds configs/ as well); or an installed recipe's name."""
    for candidate in (Path(recipe).expanduser(), Path(space_file).resolve().parent.parent / recipe,
                      recipe_file(recipe)):
        if candidate.is_file():
            return str(candidate.resolve())  # trials run with their trial directory as working directory
    raise SweepError(f"{space_file}: recipe: {recipe!r} not found")


def as_yaml(value) -> str:
    """A value as the right-hand side of a "key=value" override."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def validate(s: Sweep, extra_metrics: tuple[str, ...] = (), held_out: str = HELD_OUT) -> None:
    """Every key, value, variant and grid combination against the config tree; the metric (one training reports,
    or one of ``extra_metrics``, what each trial adds when it ends) for each variant, the scheduler. ``held_out``:
    how the caller's command line gives held-out shards (check_evaluated)."""
    where = s.path
    if s.mode not in ("max", "min"):
        raise SweepError(f"{where}: mode: {s.mode!r} is not max or min")
    _check_whole(where, "num_samples", s.num_samples, 1)
    _check_whole(where, "max_concurrent_trials", s.max_concurrent_trials, 0)  # 0: as many as the cluster holds
    if not isinstance(s.space, dict) or not (s.space or s.variants):
        raise SweepError(f"{where}: space: a mapping of config keys to domains, e.g. "
                         f"model.alignment_layers: {{grid: [0, 2, 4]}}")
    swept = [k for k in dict.fromkeys(map(override_key, s.pinned)) if k in s.space]
    if swept:  # trial_config applies the values after the fixed overrides: --set would be silently lost
        raise SweepError(f"--set {swept[0]}: {where} sweeps it (space.{swept[0]}): drop one of them")
    try:
        base = s.base_config()
    except ConfigError as e:
        raise SweepError(f"{where}: set: {e}") from None
    for name, overrides in s.variants.items():
        _check(s, {}, f"variants.{name}", overrides)
    for name, cfg in trial_configs(s).items():
        reported = reported_metrics(cfg) | set(extra_metrics)
        if s.metric not in reported:
            raise SweepError(f"{where}: metric: {s.metric!r} is not reported by this recipe's training"
                             f"{f' in variant {name}' if name else ''} (eval.tasks {cfg.eval.tasks}); one of: "
                             f"{', '.join(sorted(reported))}")
    check_evaluated(s, {s.metric: "metric"}, held_out)
    _check_values(s, {key: _domain_values(where, key, domain) for key, domain in s.space.items()})
    _validate_scheduler(s, base)


def _check_whole(where: str, key: str, value, least: int) -> None:
    """A count of the space file: a whole number (YAML's true is not one), at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SweepError(f"{where}: {key}: a whole number ≥ {least}, got {value!r}")


def _in_variant(name: str) -> str:
    return f" (variant {name})" if name else ""


def trial_configs(s: Sweep) -> dict[str, RayvlConfig]:
    """What the trials run before the space's values: each variant's config ({"": the base} without variants)."""
    if not s.variants:
        return {"": s.base_config()}
    return {name: trial_config(s.recipe, s.fixed, {}, overrides) for name, overrides in s.variants.items()}


def _check_values(s: Sweep, values: dict[str, list]) -> None:
    """Each value on its own, on top of the recipe, the fixed overrides and each variant; then every combination of
    the grid keys (one key: its values were checked already), up to MAX_GRID_CHECKED of them."""
    variants = s.variants or {"": []}
    for key, candidates in values.items():
        floats = next(iter(s.space[key])) in FLOAT_DOMAINS
        for value in candidates:
            for name, overrides in variants.items():
                _check(s, {key: value}, f"space.{key}" + _in_variant(name), overrides, floats)
    grid = {k: v for k, v in values.items() if "grid" in s.space[k]}
    if 1 < len(grid) and math.prod(len(v) for v in grid.values()) * len(variants) <= MAX_GRID_CHECKED:
        for combo in itertools.product(*grid.values()):
            for name, overrides in variants.items():
                _check(s, dict(zip(grid, combo)), "space (" + ", ".join(grid) + ")" + _in_variant(name), overrides)


def reported_metrics(cfg: RayvlConfig) -> set[str]:
    """Metric names a training run of this config reports that a sweep can optimise."""
    k = cfg.eval.paraphrase_k
    by_task = {"zeroshot": ["zeroshot_top1", "zeroshot_top5", "zeroshot_mean_per_class_recall",
                            "zeroshot_mean_average_precision"],  # a multilabel held-out set's
               "retrieval": [f"{d}_R@{n}" for d in ("t2i", "i2t") for n in (1, 5, 10)],
               "paraphrase": [f"paraphrase_AO@{k}", f"paraphrase_JS@{k}"], "sts": ["sts_spearman", "sts_pearson"]}
    return {"loss", "lr", "logit_scale", *(m for task in cfg.eval.tasks for m in by_task[task])}


def check_evaluated(s: Sweep, wanted: dict[str, str], held_out: str = HELD_OUT) -> None:
    """``wanted``: metric → what asks for it ("metric", a comparison's "row 'label'"). An evaluation metric needs
    held-out shards: given data.train and no data.eval, training switches its evaluation off
    (rayvl.train.datasets.evaluation_or_off; only the embedded demo brings its own held-out split), so Tune would
    never get the metric and a table would show "-". Checked for the recipe and each variant (a variant may name
    its own data). ``held_out``: how the caller's command line gives them (`rayvl tune` has only --set)."""
    base = s.base_config()
    for name, cfg in trial_configs(s).items():
        if cfg.data.eval or not cfg.data.train or not cfg.eval.tasks:
            continue
        from rayvl.eval.tasks import METRIC_PREFIXES  # what the evaluation's metric names start with (loads torch)

        evaluated = [m for m in wanted if m.startswith(METRIC_PREFIXES)]
        if not evaluated:
            return
        variant = _in_variant(name) if cfg.data.train != base.data.train else ""
        raise SweepError(f"{s.path}: {wanted[evaluated[0]]}: {evaluated[0]!r} is an evaluation metric, but "
                         f"data.train is given without data.eval{variant}: training would not evaluate and never "
                         f"report it; give held-out shards ({held_out})")


def _domain_values(where: str, key: str, domain) -> list:
    """The values a domain can take that are worth checking: every listed value, or both ends of a range (as
    floats where Tune draws floats)."""
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
    return [float(a) for a in args]  # [0, 6] draws 0.0 … 6.0: an integer key refuses every one


def _check(s: Sweep, values: dict, label: str, variant: list[str] = (), floats: bool = False) -> None:
    try:
        trial_config(s.recipe, s.fixed, values, variant)
    except ConfigError as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        # config's message for a float given to an integer key: the domain, not the value, is the mistake
        hint = FLOATS_HINT if floats and "expected an integer" in str(e) else ""
        raise SweepError(f"{s.path}: {label}: {shown}: {e}{hint}") from None


def budget_steps(s: Sweep, base: RayvlConfig) -> int:
    """The steps a trial of the base config trains: train.max_steps, or those train.max_passes resolves to on its
    data (its shards listed and counted as a run's plan does, nothing written)."""
    if not base.train.max_passes:
        return base.train.max_steps
    from rayvl.train.run_plan import plan_run

    key = json.dumps(base.to_dict(), sort_keys=True, default=str)
    if key not in _BUDGETS:  # once a sweep: the check, the scheduler and the report ask (a listing on object storage)
        try:
            _BUDGETS[key] = plan_run(base, dry=True).cfg.train.max_steps
        except ConfigError as e:
            raise SweepError(f"{s.path}: set: {e}") from None
    return _BUDGETS[key]


_BUDGETS: dict[str, int] = {}


def longest_budget(s: Sweep, overrides: list[str] = ()) -> int:
    """The steps the longest trial trains (budget_steps): over the base config, each variant and the values of the
    swept keys a budget depends on (BUDGET_KEYS, and with a budget in passes PASS_KEYS and data.*), their
    combinations too up to MAX_GRID_CHECKED. ASHA's default max_t: a smaller one would stop the longer trials
    before their last step, their final records unwritten."""
    fixed = s.fixed + list(overrides)
    configs = [load_config(s.recipe, fixed)] + [trial_config(s.recipe, fixed, {}, v) for v in s.variants.values()]
    variants = list(s.variants.values()) or [[]]
    in_passes = "train.max_passes" in s.space or any(c.train.max_passes for c in configs)
    keys = [k for k in s.space if k in BUDGET_KEYS or in_passes and (k in PASS_KEYS or k.startswith("data."))]
    steps = [budget_steps(s, c) for c in configs]
    for values in _combinations(s, keys, len(variants)):
        steps += [budget_steps(s, trial_config(s.recipe, fixed, values, v)) for v in variants]
    return max(steps)


def _combinations(s: Sweep, keys: list[str], variants: int) -> list[dict]:
    """Every combination of the values worth checking of ``keys``, or each value alone past MAX_GRID_CHECKED."""
    values = {k: _domain_values(s.path, k, s.space[k]) for k in keys}
    if math.prod(len(v) for v in values.values()) * variants <= MAX_GRID_CHECKED:
        return [dict(zip(values, combo)) for combo in itertools.product(*values.values())] if values else []
    return [{k: v} for k, candidates in values.items() for v in candidates]


def asha_max_t(s: Sweep, overrides: list[str] = ()) -> int:
    """ASHA's last rung in steps: as the space gives it, else the longest trial's budget."""
    return s.scheduler.get("max_t") or longest_budget(s, overrides)


def _validate_scheduler(s: Sweep, base: RayvlConfig) -> None:
    sch = s.scheduler
    unknown = sorted(set(sch) - SCHEDULER_KEYS)
    if unknown:
        raise SweepError(f"{s.path}: scheduler.{unknown[0]}: unknown key (known: {', '.join(sorted(SCHEDULER_KEYS))})")
    if sch.get("kind", "fifo") not in SCHEDULERS:
        raise SweepError(f"{s.path}: scheduler.kind: {sch.get('kind')!r} is not one of {', '.join(SCHEDULERS)}")
    for key in ("grace_period", "max_t"):  # left out (or empty): the defaults below; 0 is no default
        if sch.get(key) is not None:
            _check_whole(s.path, f"scheduler.{key}", sch[key], 1)
    factor = sch.get("reduction_factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 1):
        raise SweepError(f"{s.path}: scheduler.reduction_factor: a number > 1, got {factor!r}")
    if sch.get("kind") != "asha":
        return
    max_t, grace = asha_max_t(s), grace_period(sch, base)
    if not 1 <= grace <= max_t:
        raise SweepError(f"{s.path}: scheduler.grace_period: must be in [1, max_t={max_t}], got {grace}")
    for name, cfg in trial_configs(s).items():
        if not cfg.eval.every_steps and s.metric not in ("loss",):
            raise SweepError(f"{s.path}: scheduler.kind: ASHA stops trials on {s.metric!r}, which training reports "
                             f"only when it evaluates: set eval.every_steps ({f'0 in variant {name}; ' if name else ''}"
                             f"--set eval.every_steps=N)")


def grace_period(scheduler: dict, base: RayvlConfig) -> int:
    """ASHA's first rung in steps: as the space gives it, else the first evaluation (the metric's first value), so
    the rungs follow the budget a run is given."""
    return int(scheduler.get("grace_period") or base.eval.every_steps or 1)
