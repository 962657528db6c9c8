"""Driver side, wiring only: the run's plan (rayvl.train.run_plan) → Ray Datasets → TorchTrainer(DeepSpeed) → the run
directory."""
from __future__ import annotations

import contextlib
import signal
import threading
import uuid

import ray
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from rayvl import assets, session
from rayvl import storage as store
from rayvl.config import RayvlConfig
from rayvl.data.report import caption_stats, create_report, position_report, release_reports, snapshot
from rayvl.train import datasets
from rayvl.train.layout import resolve
from rayvl.train.resume import restored_state
from rayvl.train.loop import train_loop_per_worker
from rayvl.train.progress import ProgressPrinter, log
from rayvl.train.run_dir import RunResult, continue_records, failed, finish, log_dir, mlflow_uri, run_record
from rayvl.train.run_log import RunLog
from rayvl.train.run_plan import plan_run
from rayvl.train.startup import Startup
from rayvl.train.worker import WorkerSetup


def _say_what_runs(cfg: RayvlConfig, layout) -> None:
    """On the console, before the workers start: the engine's layout and a whole CLIP the workers will load."""
    if layout is not None:
        log.info(f"engine: {layout.line()}")
    if cfg.model.init_from_clip:
        from rayvl.models.whole_clip import describe

        log.info(describe(cfg.model.clip, cfg.model.init_from_clip))


def train(cfg: RayvlConfig, callbacks: list = (), placement_registry: str = "", progress: bool = False,
          verbose: bool = True, finished_ok: bool = True) -> RunResult:
    """Run one training job end to end and return where everything is. ``callbacks``: Ray Train UserCallbacks
    (a Tune trial passes its report callback); ``placement_registry``: the named actor a sweep collects the runs'
    placement groups in; ``progress``: log a progress line per report (rayvl.train.progress); ``verbose=False``:
    the workers' and Ray's own output stay in Ray's log files; ``finished_ok=False``: a resume of a finished run is
    refused (a user's ``--resume``)."""
    startup = Startup()
    planned = plan_run(cfg, finished_ok)  # once: nothing below resolves a spec or the run's paths again
    data, cfg = planned.data, planned.cfg  # as the run's data adjusts it (evaluation off, the methods' values)
    name = planned.name
    session.check_local_gpus(cfg)
    local_cpus = session.planned_local_cpus(cfg)
    if local_cpus is not None:  # the local Ray's size is final and known: an impossible plan fails before it starts
        session.check_resources(cfg, fixed_size=True, node_cpus=[local_cpus])
    started_here = session.connect(cfg.ray_address, cfg.local_num_cpus, verbose=verbose)
    if local_cpus is None:  # a cluster (may still autoscale) or a local Ray of this machine's CPUs: read its nodes
        session.check_resources(cfg, fixed_size=started_here)
    if not placement_registry:  # a sweep's driver checked the cluster; a trial's driver may sit on another node
        session.check_gpus(cfg, fixed_size=started_here)
    session.check_storage(cfg)
    layout = planned.layout
    if cfg.train.zero_stage == "auto":  # GPUs on a cluster: their memory is known now, from Ray's accelerator types
        # of the nodes up now, beside what an autoscaler can add
        cfg, layout = resolve(cfg, cluster={**ray.cluster_resources(), **session.largest_cluster()[0]})
    if verbose:
        _say_what_runs(cfg, layout)
    startup.mark("ray")
    report_name = f"rayvl-data-report-{name}-{uuid.uuid4().hex[:8]}"
    reports = data.reports(report_name)
    try:
        for r in reports.values():
            create_report(r)
        return _run(cfg, planned, startup, reports, callbacks, placement_registry, progress)
    finally:
        release_reports(reports.values())


def _run(cfg: RayvlConfig, planned, startup: Startup, reports: dict[str, str], callbacks: list,
         placement_registry: str, progress: bool):
    """The run itself, once Ray is up and its data reports exist: the datasets, the run's records, the trainer."""
    data, storage, name, report_name = planned.data, planned.storage, planned.name, reports["train"]
    run_dir = planned.run_dir
    built = datasets.build(data, run_dir, report_name, planned.passes)
    sets = built.datasets
    startup.mark("data")
    logs = log_dir(storage, name)
    continue_records(run_dir, logs, cfg.train.resume)
    run_log = RunLog(str(logs), run_record(cfg, run_dir, name, data.train_shards), cfg.train.report_to,
                     mlflow_uri(cfg, logs) if "mlflow" in cfg.train.report_to else "", cfg.train.sync_every_s)
    streams = {stream: name for stream, name in reports.items() if stream not in ("train", "eval")}
    setup = WorkerSetup(cfg, report_name=report_name, stream_reports=streams,
                        tokenizer_path=str(assets.text_model_path(cfg.model.text)), train_shards=data.train_slots,
                        train_mix=data.train_mix.signature, init_from=planned.init_from, eval_files=data.files,
                        placement_registry=placement_registry, method_inputs=built.worker_inputs, startup=startup)
    startup.mark("fit")  # before the trainer, which may serialize its setup
    trainer = _trainer(cfg, storage, name, sets, [run_log, *callbacks], setup, planned.read_ahead_bytes)
    try:
        with _sigint_restored(), session.report_polls():
            result = _fit(trainer, logs, cfg) if progress else trainer.fit()
    except BaseException as e:  # the records say how the invocation ended, and land in the run directory
        failed(run_dir, logs, e)
        raise
    return finish(run_dir, logs, result, _data_report(reports, planned, result),
                  stopped=(result.metrics or {}).get("step", 0) < cfg.train.max_steps,
                  log_artifacts=run_log.log_artifacts)


def _data_report(reports: dict[str, str], planned, result) -> dict:
    """data_report.json: every stream's counts, the pass size and how it was found, caption statistics, and what
    the run trained on, per pass, across its resumes."""
    report = {**snapshot(reports["train"]), "img2dataset_successes_per_pass": planned.pass_size,
              "pass_size_from": planned.pass_size_from,
              **{stream: snapshot(name) for stream, name in reports.items() if stream != "train"}}
    report["captions"] = caption_stats(report["counts"])
    if result.checkpoint is not None:
        state = restored_state(result.checkpoint)
        report["position"] = position_report(state["data_position"], state["progress"]["resumed_at"])
    return report


@contextlib.contextmanager
def _sigint_restored():
    """Ray Train's fit() in the main thread installs a Ctrl-C handler that aborts its run, and leaves it installed:
    the handler holds the run's controller actor, which then outlives the run (with its dataset coordinators and
    placement-group cleaner) until the next fit() replaces it. The handler from before is put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _fit(trainer: TorchTrainer, logs, cfg: RayvlConfig):
    """fit() with a progress line per report on this driver's terminal."""
    from rayvl.checkpoints import METRICS_FILE

    printer = ProgressPrinter(logs / METRICS_FILE, cfg.train.end_step,
                              cfg.train.num_workers)
    log.info(f"training {cfg.recipe} → {logs} ({cfg.train.num_workers} workers, {cfg.train.max_steps} steps)")
    printer.start()
    try:
        return trainer.fit()
    finally:
        printer.stop()


def _trainer(cfg: RayvlConfig, storage: str, name: str, sets: dict, callbacks: list,
             setup: WorkerSetup, read_ahead_bytes: int | None = None) -> TorchTrainer:
    t = cfg.train
    fs, inner = store.filesystem(storage, patient=True)  # Ray Train's checkpoints: a blip is waited out
    return TorchTrainer(
        train_loop_per_worker, train_loop_config={"setup": setup},
        scaling_config=ScalingConfig(
            num_workers=t.num_workers, use_gpu=t.use_gpu, placement_strategy=t.placement_strategy,
            resources_per_worker={"CPU": t.cpus_per_worker, **({"GPU": 1} if t.use_gpu else {})}),
        # the filesystem resolved once, as rayvl reads it back (an fsspec-only scheme works too)
        run_config=RunConfig(name=name, storage_path=inner, storage_filesystem=fs, callbacks=callbacks,
                             checkpoint_config=CheckpointConfig(num_to_keep=t.checkpoints_to_keep),
                             failure_config=FailureConfig(max_failures=t.max_failures)),
        datasets=sets,
        dataset_config=DataConfig(datasets_to_split=[k for k in ("train", "labeled") if k in sets],
                                  execution_options=ingest_options(cfg, sets, read_ahead_bytes)))


def ingest_options(cfg: RayvlConfig, sets: dict, read_ahead_bytes: int | None = None) -> dict:
    """Ray Data's execution options for each of the run's datasets: Ray Train's defaults, in block order with
    data.deterministic, the training stream's object-store budget ``read_ahead_bytes``
    (datasets.read_ahead_bytes)."""
    options = {}
    for name in sets:
        o = DataConfig.default_ingest_options()
        # in order, the split to ranks is a function of the blocks' order and sizes alone (Ray's OutputSplitter
        # then drops its locality hints), and each rank's iterator restores the order its format threads scramble
        o.preserve_order = o.preserve_order or cfg.data.deterministic
        if name == "train" and read_ahead_bytes:
            o.resource_limits = o.resource_limits.copy(object_store_memory=read_ahead_bytes)
        options[name] = o
    return options
