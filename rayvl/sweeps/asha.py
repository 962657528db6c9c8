"""Ray Tune's ASHA (asynchronous successive halving), with one change: a trial at its run's last step is never
stopped. Stopping it buys no compute, and Tune stops a trial by ending its driver, which cuts the run while it
ends — its final metrics, data report and evaluation record unwritten, its run.json "running" for good. ASHA puts
its last rung at ``max_t`` and stops the trials that reach it (``stop_last_trials``), so without this every trial
of a sweep whose ``max_t`` is its budget (rayvl's default) would end cut."""
from __future__ import annotations

import math

from ray.tune.schedulers import ASHAScheduler

from rayvl.sweeps.trials import LAST_STEP


class FinishingASHA(ASHAScheduler):
    """ASHAScheduler whose decision on a result at its trial's last step (the result's LAST_STEP, which rayvl's
    trials report: each trial's own) is always to continue: the run then ends by itself. Its rungs and their
    records are ASHA's own (the result is still recorded at its rung)."""

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        if action == self.STOP and result.get(self._time_attr, 0) >= result.get(LAST_STEP, math.inf):
            self._num_stopped -= 1  # ASHA counted it
            return self.CONTINUE
        return action
