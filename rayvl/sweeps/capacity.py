"""How many trials run at once. Tune counts only each trial's driver bundle: Train V2 workers take their own
placement group outside Tune's accounting and Ray Data's tasks take none, so rayvl places whole trials on the
cluster's nodes itself and sets ``max_concurrent_trials`` (Train V2's Tune integration asks the caller to)."""
from __future__ import annotations

from collections import Counter

from rayvl.config import RayvlConfig
from rayvl.sweeps.spaces import Sweep, SweepError


def trial_bundles(cfg: RayvlConfig) -> list[dict]:
    """What one trial takes besides its driver: a bundle per Train worker and a CPU for Ray Data."""
    t = cfg.train
    worker = {"CPU": t.cpus_per_worker, **({"GPU": 1.0} if t.use_gpu else {})}
    # a whole CPU per trial for Ray Data, whatever data.read_cpus says: besides its read tasks, each trial's
    # streaming-split coordinator runs the executor loop, and two trials sharing less starved each other
    return [dict(worker) for _ in range(t.num_workers)] + [{"CPU": max(1.0, cfg.data.read_cpus)}]


def concurrent_trials(cfg: RayvlConfig, nodes: list[dict], totals: dict) -> int:
    """How many trials the cluster holds at once: as many as can be placed on ``nodes`` one after another, and no
    more than ``totals`` hold (the bound a cluster's max_workers sets, which the list of nodes cannot say)."""
    return min(placed_trials(cfg, nodes), summed_trials(cfg, totals))


def placed_trials(cfg: RayvlConfig, nodes: list[dict]) -> int:
    """How many trials fit on ``nodes`` (each node's resources), one after another, each placed in the order Ray
    places it: its driver's bundle (Tune's placement group of one), its Train workers' bundles as
    train.placement_strategy places them, then Ray Data's CPU (its tasks run on any node, kept off GPU nodes). A
    bundle's policy does not keep the driver off a GPU node, so a trial counts only if its workers and Ray Data fit
    wherever its driver may land: one that does not would wait for ever (Train V2 retries the start of its worker
    group without a limit)."""
    from rayvl import session

    *workers, data = trial_bundles(cfg)
    driver = cfg.tune.driver_bundle()
    free, placed = list(nodes), 0
    while True:  # each trial takes at least Ray Data's CPU: the nodes run out
        landed = [session.place_bundles(free, [driver], "STRICT_PACK", on=i) for i in range(len(free))]
        outcomes = []
        for after in filter(None, landed):  # each node the driver fits on
            after = session.place_bundles(after, workers, cfg.train.placement_strategy)
            outcomes.append(after and session.place_bundles(after, [data], "PACK"))
        if not outcomes or not all(outcomes):
            return placed
        free, placed = outcomes[0], placed + 1


def summed_trials(cfg: RayvlConfig, resources: dict) -> int:
    """How many trials ``resources`` (a cluster's totals) hold at once: drivers, Train workers and Ray Data."""
    need: dict[str, float] = {}
    for bundle in [cfg.tune.driver_bundle(), *trial_bundles(cfg)]:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    # a hair over the floor: sums of tenths of CPUs are not exact in binary (3.9 // 1.3 is 2)
    return min(int(resources.get(name, 0.0) / amount + 1e-9) for name, amount in need.items() if amount > 0)


def trials_at_once(sweep: Sweep, cfg: RayvlConfig, fixed_size: bool) -> int:
    """Tune's limit on trials at once: the space's max_concurrent_trials, else as many as the cluster holds at its
    largest (session.largest_nodes: its autoscaler's node types at their max_workers). Trials beyond the nodes
    there are now wait for their Train placement groups, whose demand is what makes the autoscaler add nodes, and
    run as the nodes arrive. A trial that fits on no node is refused before any starts, whatever the limit."""
    from rayvl import session

    nodes, totals, autoscaled = session.largest_nodes()
    placed = placed_trials(cfg, nodes)
    n = min(placed, summed_trials(cfg, totals))
    if n >= 1:
        if autoscaled and not sweep.max_concurrent_trials:
            print(f"rayvl tune: up to {n} trials at once, what the cluster holds at its largest: {shown(totals)}")
        return sweep.max_concurrent_trials or n
    t = cfg.train
    worker, data = trial_bundles(cfg)[0], trial_bundles(cfg)[-1]
    message = (f"one trial needs {{{shown(cfg.tune.driver_bundle())}}} for its driver (tune.driver_cpus / "
               f"tune.driver_resources), {t.num_workers} × {{{shown(worker)}}} for its Train workers "
               f"(train.placement_strategy={t.placement_strategy}) and {{{shown(data)}}} for Ray Data, " + (
                   f"more than the cluster's max_workers let it grow to: {{{shown(totals)}}} in all, though its node "
                   f"types ({shown_nodes(nodes)}) would hold it" if placed else
                   f"which do not fit on the nodes the cluster {'can grow to' if autoscaled else 'has'}: "
                   f"{{{shown(totals)}}} in all, as {shown_nodes(nodes)} — wherever the driver may land (Tune places "
                   f"it first, on any node that holds it: tune.driver_resources can keep it on nodes that declare a "
                   f"resource, or leave its share beside the workers)"))
    if fixed_size or autoscaled:
        raise SweepError(f"{sweep.path}: {message}")
    at_once = sweep.max_concurrent_trials or 1
    print(f"rayvl tune: warning: {message}; running {'one trial' if at_once == 1 else f'{at_once} trials'} at a time "
          f"(no autoscaler config found on this node)")
    return at_once


def shown(resources: dict) -> str:
    """A cluster's resources as a person reads them: CPUs, GPUs and custom resources, not memory or node ids."""
    hidden = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if not k.startswith(hidden)) or "none"


def shown_nodes(nodes: list[dict]) -> str:
    """Nodes as a person reads them: alike ones counted, ``2 × {CPU 8}, 1 × {CPU 0, on_demand 1000}``."""
    alike = Counter(shown(node) for node in nodes)
    return ", ".join(f"{n} × {{{resources}}}" for resources, n in alike.items()) or "no node"
