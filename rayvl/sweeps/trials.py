"""One Tune trial. Train V2's pattern: each trial runs a small driver function that builds and fits the same
TorchTrainer `rayvl train` builds (``rayvl.train.trainer.train``), with a Train run named after the trial id (so a
restored sweep finds the trial's checkpoints and resumes it) and a report callback that hands rank 0's reports
carrying the sweep metric to Tune. When the run ends the trial writes its final numbers next to it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rayvl import storage
from rayvl.sweeps.directory import FINAL_METRICS
from rayvl.sweeps.spaces import trial_config


@dataclass(frozen=True)
class After:
    """What each trial calls on its finished run for more metrics (e.g. a held-out evaluation): a "module:function"
    — a name, because the trial runs in another process, and a resumed sweep in another Ray session — called with
    the run's result and ``kwargs``."""

    function: str = ""
    kwargs: dict = field(default_factory=dict)


def trial(config: dict) -> None:
    """The trial's driver: the sweep's recipe with this trial's values (``config``: Tune's parameter space, as
    rayvl.sweeps.runner builds it), trained by the trainer `rayvl train` runs."""
    import dataclasses

    from ray import tune

    from rayvl.checkpoints import latest_checkpoint_dir
    from rayvl.train.trainer import train

    # Tune runs a trial in its own folder: back to the sweep command's (where it exists on this node), so what the
    # trial reads by a relative name — a shard list's lines, a comparison hook's files — is what the command meant
    if config.get("cwd") and os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])
    variant = config.get("variant", "")
    cfg = trial_config(config["recipe"], config["fixed"], config["set"], config.get("variants", {}).get(variant, []),
                       config.get("cwd"))
    name = f"trial-{tune.get_context().get_trial_id()}"
    resume = latest_checkpoint_dir(storage.join(config["storage"], name)) is not None
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_name=name, resume=resume,
                                                             storage_path=config["storage"]))
    result = train(cfg, callbacks=[_metric_report(config["metric"])], placement_registry=config["registry"])
    after = After(config.get("after", ""), config.get("after_kwargs", {}))
    write_final_metrics(result, variant, config["set"], after)


def hook(spec: str):
    """The function a "module:function" name names — in a module the core once held and a method holds now
    (``moved``) if the name is no longer there."""
    import importlib

    module, function = spec.split(":")
    return getattr(importlib.import_module(module if _exists(module) else moved(module)), function)


def _exists(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is gone too
        return False


CORE_BEFORE = "rayvl.eval."  # where the modules the methods took (pseudo captions, contexts, class splits) were


def moved(module: str) -> str:
    """Where a module of the core went when a method took it (``rayvl.eval.<name>`` →
    ``rayvl.methods.<method>.<name>``): a trial's config may still name the old place, as Tune restores a resumed
    sweep's trials with the configs they started with."""
    from rayvl import plugins

    if not module.startswith(CORE_BEFORE):  # another module that is not there: importing it says so
        return module
    name = module[len(CORE_BEFORE):]
    found = [c for c in (f"{plugins.PACKAGE}.{m.name}.{name}" for m in plugins.methods()) if _exists(c)]
    return found[0] if len(found) == 1 else module  # a name several methods use was never the core's


def write_final_metrics(result, variant: str, values: dict, after: After = After()) -> dict:
    """The trial's final numbers in its run directory: the last report's metrics, the caption statistics of its data
    report and what ``after`` adds."""
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update(result.data_report["captions"])  # caption_stats, computed by train()
    metrics["samples_kept"] = result.data_report["counts"].get("samples_kept", 0)
    if after.function:
        metrics.update(hook(after.function)(result, **after.kwargs))
    record = {"variant": variant, "values": values, "metrics": metrics, "checkpoint": result.checkpoint_dir}
    storage.write_text(storage.join(result.uri, FINAL_METRICS), json.dumps(record, indent=2))
    return record


LAST_STEP = "rayvl_last_step"  # in each result a trial hands Tune: the step its run ends at (rayvl.sweeps.asha)


def _metric_report(metric: str):
    """Tune's TuneReportCallback for the reports that carry the sweep metric (Tune checks every result for it;
    eval metrics come only every eval.every_steps), each with the step this trial's run ends at (LAST_STEP): its
    own, as its plan resolved it (a trial's max_steps may differ from the sweep's: set by the space, a variant, or
    train.max_passes over its own batch size)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class MetricReport(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metric in metrics[0]:
                end = run_context.train_loop_config["setup"].config.train.end_step
                metrics = [{**metrics[0], LAST_STEP: end}, *metrics[1:]]
                super().after_report(run_context, metrics, checkpoint)

    return MetricReport()
