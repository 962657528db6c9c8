"""How many trials run at once. Tune counts only each trial's driver bundle: Train V2 workers take their own
placement group outside Tune's accounting and Ray Data's tasks take none, so rayvl adds them up itself and sets
``max_concurrent_trials`` (Train V2's Tune integration asks the caller to)."""
from __future__ import annotations

from rayvl.config import RayvlConfig
from rayvl.sweeps.spaces import Sweep, SweepError


def trial_bundles(cfg: RayvlConfig) -> list[dict]:
    """What one trial takes besides its driver: a bundle per Train worker and a CPU for Ray Data."""
    t = cfg.train
    worker = {"CPU": t.cpus_per_worker, **({"GPU": 1.0} if t.use_gpu else {})}
    # a whole CPU per trial for Ray Data, whatever data.read_cpus says: besides its read tasks, each trial's
    # streaming-split coordinator runs the executor loop, and two trials sharing less starved each other
    return [dict(worker) for _ in range(t.num_workers)] + [{"CPU": max(1.0, cfg.data.read_cpus)}]


def concurrent_trials(cfg: RayvlConfig, resources: dict) -> int:
    """How many trials ``resources`` (a cluster's totals) hold at once: drivers, Train workers and Ray Data."""
    need: dict[str, float] = {}
    for bundle in [cfg.tune.driver_bundle(), *trial_bundles(cfg)]:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    return min(int(resources.get(name, 0.0) // amount) for name, amount in need.items() if amount > 0)


def trials_at_once(sweep: Sweep, cfg: RayvlConfig, fixed_size: bool) -> int:
    """Tune's limit on trials at once: the space's max_concurrent_trials, else as many as the cluster holds at its
    largest (session.largest_cluster: its autoscaler's node types at their max_workers). Trials beyond the nodes
    there are now wait for their Train placement groups, whose demand is what makes the autoscaler add nodes, and
    run as the nodes arrive. A trial that can never fit is refused before any starts."""
    from rayvl import session

    if sweep.max_concurrent_trials:
        return sweep.max_concurrent_trials
    largest, autoscaled = session.largest_cluster()
    n = concurrent_trials(cfg, largest)
    if n >= 1:
        if autoscaled:
            print(f"rayvl tune: up to {n} trials at once, what the cluster holds at its largest: {shown(largest)}")
        return n
    worker, data = trial_bundles(cfg)[0], trial_bundles(cfg)[-1]
    message = (f"one trial needs {{{shown(cfg.tune.driver_bundle())}}} for its driver (tune.driver_cpus / "
               f"tune.driver_resources), {cfg.train.num_workers} × {{{shown(worker)}}} for its Train workers and "
               f"{{{shown(data)}}} for Ray Data, more than the cluster {'can grow to' if autoscaled else 'has'}: "
               f"{{{shown(largest)}}}")
    if fixed_size or autoscaled:
        raise SweepError(message)
    print(f"rayvl tune: warning: {message}; running one trial at a time (no autoscaler config found on this node)")
    return 1


def shown(resources: dict) -> str:
    """A cluster's resources as a person reads them: CPUs, GPUs and custom resources, not memory or node ids."""
    hidden = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if not k.startswith(hidden)) or "none"
