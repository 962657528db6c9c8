"""The per-worker training loop: build, then step (rayvl.train.step: one optimizer step, all of it), log,
evaluate, checkpoint. What each paper changes comes from the enabled methods' training parts (rayvl.train.parts,
registered in rayvl.plugins); the data position from rayvl.train.resume."""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import ray
import ray.train
import torch

from rayvl.config import RayvlConfig
from rayvl.export import weights
from rayvl.models.dual_encoder import build_model
from rayvl.train import devices, flops, resume
from rayvl.train.batches import batch_stream
from rayvl.train.engine import build_engine
from rayvl.train.evaluation import Evaluation
from rayvl.train.faults import fail_here
from rayvl.train.parts import train_parts
from rayvl.train.profiling import StartupProfile, StepProfiler
from rayvl.train.resume import DataResume, aligned_buffers, decay_rule
from rayvl.train.startup import Startup
from rayvl.train.state import Progress, TrainState
from rayvl.train.step import Step
from rayvl.train.window import Window
from rayvl.train.worker import Worker


def train_loop_per_worker(config: dict) -> None:
    entered, setup = time.time(), config["setup"]
    cfg, ctx = setup.config, ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    startup_profile = StartupProfile.from_env(rank)  # where the start's time goes, by function (RAYVL_PROFILE_STARTUP)
    device = _device(cfg)
    # the data position first (read tasks plan from it); the held-out set, then the batch source, beside the engine
    data_resume = DataResume(setup, rank, world)
    saved, begin = data_resume.restore()
    startup = Startup.on_worker(setup.startup, entered, resumed=saved is not None)
    evaluation = Evaluation(cfg, setup.eval_files, setup.tokenizer_path, rank, world)
    parts = train_parts(Worker(setup, cfg, rank, world, device, begin, evaluation))
    data = _in_thread(_data_sources, parts, cfg, rank, begin, device, evaluation)
    startup.mark("setup")
    _register_placement_group(setup.placement_registry if rank == 0 else "", cfg.train.run_name)  # before any wait
    engine, speed = _engine(cfg, world, setup.init_from if saved is None else "", device, parts, startup)
    next_batch = data.result()  # raises what the thread raised; the parts' sources (and their state) exist now
    state = _train_state(parts, data_resume)
    if resume.restore(engine, state, saved):
        state.progress.resumed_at.append(state.progress.step)
    startup.mark("restore")
    # a restart record: the first window after a resume says which checkpoint step the group continued from
    t, progress = cfg.train, state.progress
    window = Window(first_step=progress.step + 1,
                    resumed_from=progress.resumed_at[-1] if progress.resumed_at else None, **speed)
    train_step = Step(engine, parts, cfg, data_resume, rank, world, window)

    end = t.end_step  # a stop ends this invocation as the last step would
    profiler = StepProfiler.from_env(rank)
    while progress.step < end:
        profiler.before(progress.step + 1)
        train_step(next_batch, progress.step + 1)  # rayvl.train.step: the whole step, in one file
        progress.step = step = progress.step + 1
        profiler.after(step)
        if startup is not None:  # the first step of this start: its report says where the time before it went
            startup.mark("first_step")
            window.startup, startup = startup.metrics(window.wait), None
            startup_profile.stop()
        fail_here("step", progress)
        noted = [part.after_step(engine, step) for part in parts]

        last = step == end
        do_eval, do_ckpt = evaluation.due(step, last), last or step % t.checkpoint_every == 0
        if not (do_eval or do_ckpt or any(noted) or step % t.log_every == 0):
            continue
        metrics = window.metrics(step, engine, setup.report_name or None)
        for part in parts:
            metrics.update(part.metrics(engine.device))
        if do_eval:
            metrics.update(evaluation.run(engine.module))
        progress.history.append(metrics)
        if do_ckpt:
            metrics.update(data_resume.settle())
            with resume.saved(engine, state, cfg.to_dict(), final=last) as ckpt:
                ray.train.report(metrics, checkpoint=ckpt)
        else:
            ray.train.report(metrics)
        window = train_step.window = Window(first_step=step + 1, start=window.end + metrics.get("evaluation_s", 0.0),
                                            **speed)


def _train_state(parts, data_resume: DataResume) -> TrainState:
    """The state a checkpoint holds: the progress, the data position and each part's components."""
    components = {name: c for part in parts for name, c in part.components().items()}
    added_later = frozenset().union(*(part.added_later for part in parts))
    return TrainState(Progress(), added_later, data_position=data_resume.position, **components)


def _device(cfg: RayvlConfig) -> torch.device:
    """This worker's device, bound in the training thread, with its fast-math settings."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = devices.worker_device(cfg.train.use_gpu)
    devices.check_cuda(device)
    devices.bind(device)
    devices.fast_math(device, cfg.train.tf32)
    return device


def _in_thread(fn, *args) -> Future:
    """``fn(*args)`` run in a thread of its own, its result (or what it raised) in the returned future."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="rayvl-data")
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with fn; nothing more is submitted
    return future


def _data_sources(parts, cfg: RayvlConfig, rank: int, begin, device: torch.device, evaluation: Evaluation):
    """The held-out set read whole, then next_batch(step, micro) → (batch on ``device``, seconds waited): a method's
    source, else the training shard's batches in order. In this order: a training stream started first fills its
    read-ahead and pauses its read tasks (Ray Data's back-pressure), which keep their CPUs; on a cluster with no CPU
    to spare beyond them the held-out read this rank then waits on is never scheduled (ray-project/ray#46783; seen
    here with a locked image tower on 2 CPUs: 7 min, no step). The held-out read ends: its rows go to a list."""
    if cfg.eval.tasks:
        evaluation.load(ray.train.get_dataset_shard("eval"))
    return _batch_source(parts, cfg, rank, begin, device)


def _batch_source(parts, cfg: RayvlConfig, rank: int, begin, device: torch.device):
    """next_batch(step, micro) → (batch on ``device``, seconds waited): a method's source, else the training
    shard's batches in order."""
    for part in parts:
        source = part.batches()
        if source is not None:
            return source
    stream = batch_stream(ray.train.get_dataset_shard("train"), cfg, begin=begin, rank=rank, device=device)
    return lambda step, micro: next(stream)


def _engine(cfg: RayvlConfig, world: int, init_from: str, device: torch.device, parts, startup: Startup):
    """The DeepSpeed engine over the dual encoder on ``device`` and what the MFU of a report needs (Window's
    fields). ``init_from``: a new run starts from those weights (train.init_from; a resumed run restores its own)."""
    model = build_model(cfg.model, cfg.train.seed, weights(init_from)[0] if init_from else None)
    startup.mark("model")
    if device.type == "cuda":  # NHWC images: cuDNN's convolutions run on tensor cores in that layout
        model.vision.channels_last = True
    for part in parts:
        part.model_built(model)
    # before DeepSpeed: ZeRO-3 partitions the weights away
    speed = flops.speed_fields(model, cfg, device, key_encoders=any(part.key_encoders for part in parts))
    checkpoint = ray.train.get_checkpoint()
    engine = build_engine(model, cfg, world, device, aligned_buffers(checkpoint), decay_rule(checkpoint))
    if cfg.train.compile:
        engine.compile(backend=cfg.train.compile)
    startup.mark("engine")
    return engine, speed


def _register_placement_group(registry: str, run_name: str) -> None:
    """Before the model's build and the held-out read (either may wait), rank 0 of a sweep's trial tells the
    sweep's ``registry`` which placement group this run's workers hold (a sweep removes what a stopped trial leaves
    behind; Train V2 creates the group without a name, in its controller, so nothing else can tell one trial's
    group from another's)."""
    if not registry:
        return
    group = ray.util.get_current_placement_group()
    if group is not None:
        ray.get(ray.get_actor(registry, namespace="rayvl").register.remote(run_name, group.id.hex()))
