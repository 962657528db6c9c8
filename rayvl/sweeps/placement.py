"""Giving back what a finished trial's Train run leaves behind. Train V2 creates the workers' placement group in its
controller actor, so the group outlives the trial (a placement group lives as long as its job); Train's own cleaner
asks the State API whether the controller is alive, and here that timed out ("Timed out while waiting for GCS"), so
every early-stopped trial kept its CPUs and the next trials' Ray Data starved (Ray issue #54305 is the same leak).
Rank 0 of each trial's run registers its group in a named actor (rayvl.train.loop); a Tune callback removes the
group of every trial that completes or fails."""
from __future__ import annotations

import hashlib


class PlacementRegistry:
    """Which placement group each trial's Train run holds (rank 0 registers it, by run name)."""

    def __init__(self):
        self.groups: dict[str, str] = {}

    def register(self, run_name: str, group_id: str) -> None:
        self.groups[run_name] = group_id

    def group(self, run_name: str) -> str | None:
        return self.groups.get(run_name)


def registry_name(sweep_dir: str) -> str:
    """Named after the sweep directory, so the trial configs and the callback a resumed sweep restores still find
    it."""
    return f"rayvl-placement-{hashlib.sha1(sweep_dir.encode()).hexdigest()[:12]}"


def start_registry(name: str):
    """The registry actor, on this (the sweep driver's) node, never on a worker node that may go away."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(PlacementRegistry).options(
        name=name, namespace="rayvl", get_if_exists=True, scheduling_strategy=here).remote()


def release_callback(registry: str):
    """A Tune callback that removes a finished, stopped or failed trial's worker placement group if Train left it.
    It holds the registry's name, not a handle: Tune saves its callbacks with the sweep's state, and a resumed
    sweep runs in another Ray session."""
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
