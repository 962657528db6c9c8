"""Running a sweep: Ray Tune's Tuner over ``rayvl.sweeps.trials.trial``, with the space's domains, its scheduler, the
number of trials at once, the placement-group release callback and the sweep directory; ``resume`` restores an
interrupted sweep from Tune's saved state."""
from __future__ import annotations

import json
import os
import posixpath

from rayvl import storage
from rayvl.sweeps import capacity, directory, placement
from rayvl.sweeps.spaces import Sweep, SweepError, asha_max_t, grace_period, longest_budget, override_key
from rayvl.sweeps.trials import After, trial


def run_sweep(sweep: Sweep, overrides: list[str] = (), name: str = "", resume: bool = False,
              after: After = After()):
    """Start (or with ``resume`` continue) the sweep; returns (sweep directory, Tune's ResultGrid). ``after``:
    what each trial adds to its final numbers when its run ends."""
    import ray
    from ray import tune

    from rayvl import session

    base = sweep.base_config(overrides)
    name = directory.sweep_name(sweep, name)
    sweep_dir = directory.sweep_directory(base, name)
    wanted = settings(sweep, overrides)
    check_start(sweep, sweep_dir, wanted, resume)
    fs, inner = storage.filesystem(storage.normalize(base.tune.storage_path), patient=True)  # Tune's state
    session.check_local_gpus(base)
    fixed_size = session.connect(base.ray_address, base.local_num_cpus)
    session.check_storage(base, key="tune.storage_path")  # the trials' runs go under it
    session.check_gpus(base, fixed_size)
    at_once = 0 if resume else capacity.trials_at_once(sweep, base, fixed_size)
    trainable = tune.with_resources(trial, base.tune.driver_bundle())
    registry_name = placement.registry_name(sweep_dir)
    registry = placement.start_registry(registry_name)
    space = _param_space(sweep, overrides, sweep_dir, registry_name, after)
    if resume:  # Tune's saved state brings back the trials, the scheduler and the RunConfig with its callbacks
        tuner = tune.Tuner.restore(posixpath.join(inner, name), trainable, resume_unfinished=True,
                                   resume_errored=False, storage_filesystem=fs, param_space=space)
    else:
        # after every check: a start refused before it leaves settings without Tune's state, which a plain run
        # starts again (check_start)
        directory.save_settings(sweep_dir, wanted)
        tuner = tune.Tuner(trainable, param_space=space, tune_config=tune.TuneConfig(
            metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples,
            scheduler=_scheduler(sweep, overrides), max_concurrent_trials=at_once), run_config=tune.RunConfig(
            name=name, storage_path=inner, storage_filesystem=fs, verbose=1,
            callbacks=[placement.release_callback(registry_name)]))
    try:
        return sweep_dir, tuner.fit()
    finally:
        ray.kill(registry)  # every trial has ended and been released


def settings(sweep: Sweep, overrides: list[str] = ()) -> dict:
    """What the sweep's report needs, and what a resume must find unchanged (RESUMED_AS_STARTED), saved with it
    (rayvl.sweeps.directory)."""
    return {"space_file": sweep.path, "recipe": sweep.recipe, "fixed": sweep.fixed + list(overrides),
            "metric": sweep.metric, "mode": sweep.mode, "keys": list(sweep.space), "space": sweep.space,
            "num_samples": sweep.num_samples, "scheduler": sweep.scheduler,
            "max_steps": longest_budget(sweep, overrides), "variants": sweep.variants,
            "max_t": int(sweep.scheduler.get("max_t") or 0), "max_concurrent_trials": sweep.max_concurrent_trials}


# what Tune's saved state keeps from a sweep's first start (its trials' configs, its search and scheduler): a resume
# with another would run the old ones, or fail inside Tune after Ray started (a key added to the space)
RESUMED_AS_STARTED = ("space", "metric", "mode", "fixed", "variants", "scheduler", "num_samples",
                      "max_concurrent_trials")
OLDER_FIELDS = {"space": "keys", "scheduler": "max_t"}  # what a settings file of an earlier rayvl has in their place
# --set keys that say where the sweep runs, not what its trials do: a resume on a re-launched cluster gives new ones
WHERE_IT_RUNS = frozenset({"ray_address", "local_num_cpus", "tune.storage_path"})


def check_start(sweep: Sweep, sweep_dir: str, wanted: dict, resume: bool) -> None:
    """Whether this run may start the sweep at ``sweep_dir`` (or, ``resume``, continue it), before Ray starts. It
    has begun once Tune saved its state there (directory.begun); its settings alone are a first start that a check
    stopped, which a plain run starts afresh. A resume continues the sweep as it started (``wanted``: this run's
    settings)."""
    begun = directory.begun(sweep_dir)
    if begun and not resume:
        raise SweepError(f"{sweep.path}: sweep {sweep_dir!r} exists: pass --resume to continue it, or --name another")
    if resume and not begun:
        why = ("has settings but no trial state: its first start stopped before any trial began, so nothing was "
               "started" if directory.has_settings(sweep_dir) else "has no state to resume")
        raise SweepError(f"{sweep.path}: sweep {sweep_dir!r} {why}: drop --resume")
    if resume and directory.has_settings(sweep_dir):
        saved, now = directory.read_settings(sweep_dir), json.loads(json.dumps(wanted))  # compared as saved
        for settings_ in (saved, now):
            settings_["fixed"] = [o for o in settings_.get("fixed", []) if override_key(o) not in WHERE_IT_RUNS]
        if "space" not in saved:  # an earlier rayvl saved the variants without the --set values pinned after them
            now["variants"] = {name: _unpinned(v, sweep.pinned) for name, v in now["variants"].items()}
        fields = [key if key in saved else OLDER_FIELDS.get(key, key) for key in RESUMED_AS_STARTED]
        changed = [f"{key} ({_difference(saved[key], now[key])})" for key in fields
                   if key in saved and saved[key] != now[key]]
        if changed:
            raise SweepError(f"{sweep.path}: --resume: sweep {sweep_dir!r} started with another "
                             f"{'; '.join(changed)}: Tune would resume the sweep it started. Resume it with the space "
                             f"and --set it started with, or start a new sweep with --name")


def _unpinned(variant: list[str], pinned: list[str]) -> list[str]:
    """A variant's overrides without the --set values pinned_variants appended: one for each key it shares."""
    appended = len({override_key(o) for o in variant} & {override_key(o) for o in pinned})
    return variant[:len(variant) - appended]


def _difference(old, new) -> str:
    """What changed between two saved values, as a person reads it: the keys of a mapping, the items of a list."""
    if isinstance(old, dict) and isinstance(new, dict):
        return ", ".join(f"{k}: " + ("added" if k not in old else "removed" if k not in new
                                     else _difference(old[k], new[k]))
                         for k in {**old, **new} if old.get(k) != new.get(k))
    if isinstance(old, list) and isinstance(new, list):
        gone, added = [x for x in old if x not in new], [x for x in new if x not in old]
        return ", ".join([f"without {json.dumps(x)}" for x in gone] + [f"with {json.dumps(x)}" for x in added]) \
            or "in another order"
    return f"{json.dumps(old)}, now {json.dumps(new)}"


def _param_space(sweep: Sweep, overrides: list[str], sweep_dir: str, registry: str, after: After) -> dict:
    from ray import tune

    space = {"set": {k: _tune_domain(d) for k, d in sweep.space.items()}, "recipe": sweep.recipe,
             "fixed": sweep.fixed + list(overrides), "metric": sweep.metric,
             "storage": storage.join(sweep_dir, "runs"), "registry": registry, "after": after.function,
             "cwd": os.getcwd(),  # what the command line's relative paths are relative to (trials run elsewhere)
             "after_kwargs": after.kwargs}
    if sweep.variants:  # the named override sets: one more grid dimension
        space.update(variant=tune.grid_search(list(sweep.variants)), variants=sweep.variants)
    return space


def _tune_domain(domain: dict):
    from ray import tune

    kind, args = next(iter(domain.items()))
    return {"grid": lambda: tune.grid_search(args), "choice": lambda: tune.choice(args),
            "uniform": lambda: tune.uniform(*args), "loguniform": lambda: tune.loguniform(*args),
            "randint": lambda: tune.randint(*args)}[kind]()


def _scheduler(sweep: Sweep, overrides: list[str] = ()):
    from ray.tune.schedulers import FIFOScheduler

    from rayvl.sweeps.asha import FinishingASHA

    s = sweep.scheduler
    if s.get("kind", "fifo") == "fifo":
        return FIFOScheduler()
    # time is the optimizer step every report carries, so rungs are in steps whatever eval.every_steps is
    return FinishingASHA(time_attr="step", max_t=asha_max_t(sweep, overrides),
                         grace_period=grace_period(s, sweep.base_config(overrides)),
                         reduction_factor=float(s.get("reduction_factor") or 2))


def sweep_and_report(sweep: Sweep, overrides: list[str] = (), name: str = "", resume: bool = False) -> str:
    """`rayvl tune`: run the sweep, then print the trial table and write the CSV, the plots and the best recipe
    next to it."""
    from rayvl.sweeps.reports import write_report

    sweep_dir, results = run_sweep(sweep, overrides, name, resume)
    print(f"\n== sweep {sweep_dir.rstrip('/').rsplit('/', 1)[-1]}: {len(results)} trials, "
          f"{results.num_errors} failed ==")
    table, files = write_report(sweep_dir)
    print(table)
    print(f"\nsweep directory: {sweep_dir}\n  table:  {storage.join(sweep_dir, 'trials.csv')}\n  plots:  "
          + ", ".join(n for n in files if n.endswith(".png"))
          + f"\n  best:   {storage.join(sweep_dir, 'best_config.yaml')} (python jobs/laion_adapt.py --config ...)")
    return sweep_dir
