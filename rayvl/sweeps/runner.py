"""Running a sweep: Ray Tune's Tuner over ``rayvl.sweeps.trials.trial``, with the space's domains, its scheduler, the
number of trials at once, the placement-group release callback and the sweep directory; ``resume`` restores an
interrupted sweep from Tune's saved state."""
from __future__ import annotations

import posixpath
from pathlib import Path

from rayvl import storage
from rayvl.config import RayvlConfig
from rayvl.sweeps import capacity, directory, placement
from rayvl.sweeps.spaces import Sweep, SweepError, budget_steps, grace_period
from rayvl.sweeps.trials import After, trial


def run_sweep(sweep: Sweep, overrides: list[str] = (), name: str = "", resume: bool = False,
              after: After = After()):
    """Start (or with ``resume`` continue) the sweep; returns (sweep directory, Tune's ResultGrid). ``after``:
    what each trial adds to its final numbers when its run ends."""
    import ray
    from ray import tune

    from rayvl import session

    base = sweep.base_config(overrides)
    name = name or sweep.name or Path(sweep.path).stem
    sweep_dir = directory.sweep_directory(base, name)
    if resume != directory.begun(sweep_dir):
        raise SweepError(f"{sweep.path}: sweep {sweep_dir!r} {'has no state to resume' if resume else 'exists'}"
                         f": {'drop --resume' if resume else 'pass --resume to continue it, or --name another'}")
    if not resume:
        directory.save_settings(sweep_dir, settings(sweep, overrides))
    fs, inner = storage.filesystem(storage.normalize(base.tune.storage_path), patient=True)  # Tune's state
    session.check_local_gpus(base)
    fixed_size = session.connect(base.ray_address, base.local_num_cpus)
    session.check_storage(base)
    session.check_gpus(base, fixed_size)
    trainable = tune.with_resources(trial, base.tune.driver_bundle())
    registry_name = placement.registry_name(sweep_dir)
    registry = placement.start_registry(registry_name)
    space = _param_space(sweep, overrides, sweep_dir, registry_name, after)
    if resume:  # Tune's saved state brings back the trials, the scheduler and the RunConfig with its callbacks
        tuner = tune.Tuner.restore(posixpath.join(inner, name), trainable, resume_unfinished=True,
                                   resume_errored=False, storage_filesystem=fs, param_space=space)
    else:
        tuner = tune.Tuner(trainable, param_space=space, tune_config=tune.TuneConfig(
            metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples, scheduler=_scheduler(sweep, base),
            max_concurrent_trials=capacity.trials_at_once(sweep, base, fixed_size)), run_config=tune.RunConfig(
            name=name, storage_path=inner, storage_filesystem=fs, verbose=1,
            callbacks=[placement.release_callback(registry_name)]))
    try:
        return sweep_dir, tuner.fit()
    finally:
        ray.kill(registry)  # every trial has ended and been released


def settings(sweep: Sweep, overrides: list[str] = ()) -> dict:
    """What the sweep's report needs, saved with it (rayvl.sweeps.directory)."""
    return {"space_file": sweep.path, "recipe": sweep.recipe, "fixed": sweep.fixed + list(overrides),
            "metric": sweep.metric, "mode": sweep.mode, "keys": list(sweep.space),
            "max_steps": budget_steps(sweep, sweep.base_config(overrides)), "variants": sweep.variants,
            "max_t": int(sweep.scheduler.get("max_t") or 0)}


def _param_space(sweep: Sweep, overrides: list[str], sweep_dir: str, registry: str, after: After) -> dict:
    from ray import tune

    space = {"set": {k: _tune_domain(d) for k, d in sweep.space.items()}, "recipe": sweep.recipe,
             "fixed": sweep.fixed + list(overrides), "metric": sweep.metric,
             "storage": storage.join(sweep_dir, "runs"), "registry": registry, "after": after.function,
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


def _scheduler(sweep: Sweep, base: RayvlConfig):
    from ray.tune.schedulers import FIFOScheduler

    from rayvl.sweeps.asha import FinishingASHA

    s = sweep.scheduler
    if s.get("kind", "fifo") == "fifo":
        return FIFOScheduler()
    # time is the optimizer step every report carries, so rungs are in steps whatever eval.every_steps is
    return FinishingASHA(time_attr="step", max_t=int(s.get("max_t") or budget_steps(sweep, base)),
                         grace_period=grace_period(s, base), reduction_factor=float(s.get("reduction_factor", 2)))


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
