"""The per-worker training loop: restore → while step < max: step, refresh, evaluate, report, checkpoint."""
from __future__ import annotations

import os
import uuid

import ray
import ray.train
import torch
import torch.nn.functional as F

from rayvl.config import RayvlConfig, from_dict
from rayvl.data.position import DataPosition
from rayvl.data.report import report_actor
from rayvl.data.tonics import SAMPLER_COUNTS, Curriculum, SamplerTotals
from rayvl.export import weights
from rayvl.losses import clip_loss, gather_features, unicl_loss
from rayvl.models.dual_encoder import build_model
from rayvl.models.memory_bank import MemoryBank
from rayvl.train import checkpoint, devices, flops
from rayvl.train.batches import ROW, TonicsBatches, TrainedRows, batch_stream, mixed_stream
from rayvl.train.engine import broadcast_buffers, build_engine
from rayvl.train.faults import fail_here
from rayvl.train.evaluation import evaluate, held_out_retrieval, load_eval_data
from rayvl.train.state import Progress, TrainState
from rayvl.train.window import Window


def train_loop_per_worker(config: dict) -> None:
    cfg = from_dict(config["rayvl"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = _device(cfg)
    # the data position first (read tasks plan from it), then the data streams: Ray Data warms up while the
    # model and the engine are built
    position = DataPosition(config.get("train_shards", 0))
    saved, begin = _restore_position(position, config.get("report_name"), config.get("label_report"), rank)
    next_batch, curriculum, tonics = _batches(cfg, config.get("tonics_sizes"), rank, begin, device)
    engine, bank, speed = _engine(cfg, world, config.get("init_from", "") if saved is None else "", device)
    state = _train_state(config, position, curriculum, tonics, bank)
    if checkpoint.restore(engine, state, saved):
        state.progress.resumed_at.append(state.progress.step)
    if config.get("placement_registry") and rank == 0:  # a sweep removes what a stopped trial leaves behind
        _register_placement_group(config["placement_registry"], cfg.train.run_name)
    eval_data = load_eval_data(ray.train.get_dataset_shard("eval"), config, cfg) if cfg.eval.tasks else None
    evaluating = dict(cfg=cfg, tokenizer_path=config["tokenizer_path"], rank=rank, world=world)
    # a restart record: the first window after a resume says which checkpoint step the group continued from
    window = Window(first_step=state.progress.step + 1,
                    resumed_from=state.progress.resumed_at[-1] if state.progress.resumed_at else None, **speed)
    trained = TrainedRows()  # row ids stay on the device until a checkpoint needs them

    end = cfg.train.stop_at_step or cfg.train.max_steps  # a stop ends this invocation as the last step would
    while state.progress.step < end:
        for micro in range(cfg.train.grad_accumulation):
            batch, waited = next_batch(state.progress.step + 1, micro)
            trained.add(batch)
            loss = _loss(engine, batch, cfg, bank, (state.progress.step * cfg.train.grad_accumulation + micro)
                         * world + rank)
            engine.backward(loss)
            window.add(loss.detach() / cfg.train.grad_accumulation, waited, batch, world, grad_norm=_step(engine))
        broadcast_buffers(engine.module)  # one set of BatchNorm statistics, as DDP keeps it
        if bank is not None:  # MoCo: the key encoders follow the trained ones once per optimizer step
            bank.update(engine.module)
        state.progress.step = step = state.progress.step + 1
        window.steps += 1
        fail_here("step", state.progress)

        last = step == end
        do_refresh = curriculum is not None and step % cfg.tonics.refresh_every == 0
        if do_refresh:
            _refresh(curriculum, step, held_out_retrieval(engine.module, eval_data, cfg.tonics.refresh_instances,
                                                          **evaluating), cfg, rank)
        do_eval = eval_data is not None and (last or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0))
        do_ckpt = last or step % cfg.train.checkpoint_every == 0
        if not (do_eval or do_ckpt or do_refresh or step % cfg.train.log_every == 0):
            continue
        metrics = window.metrics(step, engine, config.get("report_name"))
        if curriculum is not None:
            metrics.update(_tonics_metrics(curriculum, tonics, engine.device))
        if do_eval:
            metrics.update(evaluate(engine.module, eval_data, **evaluating))
        state.progress.history.append(metrics)
        if do_ckpt:
            _checkpoint(engine, state, metrics, config, final=last, trained=trained)
        else:
            ray.train.report(metrics)
        window = Window(first_step=step + 1, **speed)


def _device(cfg: RayvlConfig) -> torch.device:
    """This worker's device, bound in the training thread, with its fast-math settings."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = devices.worker_device(cfg.train.use_gpu)
    devices.check_cuda(device)
    devices.bind(device)
    devices.fast_math(device, cfg.train.tf32)
    return device


def _train_state(config: dict, position: DataPosition, curriculum, tonics, bank) -> TrainState:
    return TrainState(Progress(), curriculum=curriculum, memory_bank=bank, data_position=position,
                      tonics_sampler=tonics.totals if tonics is not None else None)


def _engine(cfg: RayvlConfig, world: int, init_from: str, device: torch.device):
    """The DeepSpeed engine over the dual encoder on ``device``, the memory bank (None without one) on it, and what
    the MFU of a report needs (Window's fields). ``init_from``: a new run starts from those weights
    (train.init_from; a resumed run restores its own)."""
    model = build_model(cfg.model, cfg.train.seed)
    if init_from:
        model.load_state_dict(weights(init_from)[0], strict=True)
    if device.type == "cuda":  # NHWC images: cuDNN's convolutions run on tensor cores in that layout
        model.vision.channels_last = True
    bank = MemoryBank(model, cfg.memory_bank.size, cfg.model.embed_dim, cfg.memory_bank.momentum) \
        if cfg.memory_bank.size else None
    speed = _speed(model, cfg, device)  # before DeepSpeed: ZeRO-3 partitions the weights away
    engine = build_engine(model, cfg, world, device)
    if bank is not None:
        bank.to(engine.device)
    if cfg.train.compile:
        engine.compile(backend=cfg.train.compile)
    return engine, bank, speed


def _speed(model, cfg: RayvlConfig, device: torch.device) -> dict:
    """Window's MFU fields: the FLOPs of a sample and the device's peak at the run's precision ({} where the peak
    is unknown — a CPU unless RAYVL_PEAK_TFLOPS names one)."""
    peak = flops.peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                            flops.table_precision(cfg.train, device.type == "cuda"))
    if peak is None:
        return {}
    return {"peak_flops": peak, "flops_per_sample": flops.model_flops_per_sample(
        model, cfg.data.image_size, cfg.data.max_text_tokens, key_encoders=cfg.memory_bank.size > 0)}


def _checkpoint(engine, state: TrainState, metrics: dict, config: dict, final: bool, trained: TrainedRows) -> None:
    """Settle the data position (every rank's rows since the last checkpoint), then save and report."""
    ctx = ray.train.get_context()
    position = state.components["data_position"]
    trained.flush(position)
    _gather_position(position, config.get("report_name"), ctx.get_world_rank(), ctx.get_world_size())
    metrics.update(position.summary())
    with checkpoint.saved(engine, state, config["rayvl"], final=final) as ckpt:
        ray.train.report(metrics, checkpoint=ckpt)


def _restore_position(position: DataPosition, report_name: str | None, label_report: str | None, rank: int):
    """Before any stream starts: the data position of the checkpoint Ray Train restores (or none) goes to the
    run's data report, where read tasks plan from it (data/position.py); the image-label report starts again.
    Returns (that checkpoint's train state, read once here for checkpoint.restore, or None;
    the callback that numbers the passes of a further Ray Data execution, batches._epochs)."""
    import torch.distributed as dist

    ckpt = ray.train.get_checkpoint()
    saved = checkpoint.restored_state(ckpt) if ckpt is not None else None
    restored = saved.get("data_position") if saved is not None else None
    if restored is not None:
        position.load_state_dict(restored)
    if not report_name:
        return saved, None
    actor, token = report_actor(report_name), uuid.uuid4().hex
    if rank == 0:  # a new token per worker group: what the lost group's reads counted is dropped
        ray.get(actor.restore.remote(token, restored, position.n_shards))
        if label_report:  # no position: read again from its start, counted again from 0
            ray.get(report_actor(label_report).restore.remote(token, None, 0))
    if dist.is_initialized():
        dist.barrier()
    first = position.execution  # rank 0's position.execution moves on at checkpoints; the count starts here
    return saved, lambda n: ray.get(actor.begin_execution.remote(first + n))


def _gather_position(position: DataPosition, report_name: str | None, rank: int, world: int) -> None:
    """Every rank's rows trained on since the last checkpoint go to rank 0, which settles the shards now finished
    and their counts (data/position.py). Rows travel as runs (position.RowSet), and to rank 0 only: no other rank
    needs them."""
    import torch.distributed as dist

    mine = position.take_trained()
    parts = [mine]
    if dist.is_initialized():
        parts = [None] * world if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
    if rank != 0 or not report_name:
        return
    actor = report_actor(report_name)
    position.merge(*parts)
    done = position.settle(ray.get(actor.unit_rows.remote(list(position.partial))))
    position.report, position.execution = ray.get(actor.settle.remote(done, position.open_pass()))


def _batches(cfg: RayvlConfig, tonics_sizes: list[int] | None, rank: int, begin, device: torch.device):
    """(next_batch(step, micro) → (batch on ``device``, seconds waited), TOnICS curriculum or None, TOnICS source
    or None)."""
    shard = ray.train.get_dataset_shard("train")
    if cfg.tonics.enabled:  # [TOnICS] §3: the node of step s is drawn from (seed, s), the same on every rank
        x = cfg.tonics
        curriculum = Curriculum(tonics_sizes, x.alpha, x.beta, x.threshold, cfg.train.seed, moves=x.curriculum)
        source = TonicsBatches(shard, cfg, rank, begin, device)
        return (lambda step, micro: source.next(curriculum.node(step), step, micro)), curriculum, source
    if cfg.image_label.data and cfg.image_label.weight < 1.0:  # [UniCL] App. B.2: balanced batches
        stream = mixed_stream(shard, ray.train.get_dataset_shard("labeled"), cfg, begin, rank=rank, device=device)
    else:
        stream = batch_stream(shard, cfg, begin=begin, rank=rank, device=device)
    return (lambda step, micro: next(stream)), None, None


def _register_placement_group(registry: str, run_name: str) -> None:
    """Tell the sweep's registry which placement group this run's workers hold (Train V2 creates it without a name,
    in its controller, so nothing else can tell one trial's group from another's)."""
    group = ray.util.get_current_placement_group()
    if group is not None:
        ray.get(ray.get_actor(registry, namespace="rayvl").register.remote(run_name, group.id.hex()))


def _refresh(curriculum: Curriculum, step: int, accuracy: float, cfg: RayvlConfig, rank: int) -> None:
    refreshed = curriculum.update(step, accuracy)
    if rank == 0:
        print(f"rayvl: TOnICS step {step}: held-out t2i R@1 {accuracy:.1f}% "
              f"{'≥' if refreshed else '<'} {cfg.tonics.threshold:g}% → P_S(root) {curriculum.p[0]:.3f}"
              f"{' (refreshed)' if refreshed else ''}", flush=True)


def training_labels(batch: dict, batch_index: int, tonics: bool) -> torch.Tensor:
    """TargetM ([UniCL] Algorithm 1): image-label rows keep their class id (≥ 0); every image-text row gets a label
    of its own, unique across ranks, steps and so across the queue. TOnICS rows of one pair (one per aligned class,
    the same image and caption) share their pair's label — the same pair twice in a batch is a positive, not a
    false negative; with no pair repeated this is the CLIP loss."""
    b = batch["label"].shape[0]
    if tonics:
        return -2 - batch[ROW]  # row ids are ≥ 0 and unique per (pass, shard, sample): one label per pair
    unique = -1 - (batch_index * b + torch.arange(b, device=batch["label"].device))
    return torch.where(batch["label"] >= 0, batch["label"], unique)


def _loss(engine, batch: dict, cfg, bank: MemoryBank | None, batch_index: int) -> torch.Tensor:
    """InfoNCE or UniCL over the gathered batch, or against the EMA keys + queue when a memory bank is on."""
    # the loss in fp32 whatever the towers' precision: bf16 logits lose the ranking between near keys, and the
    # memory bank's EMA keys and queue are fp32
    image_features, text_features, scale = (t.float() for t in engine(batch["image"], batch["input_ids"],
                                                                      batch["attention_mask"]))
    if cfg.loss.kind == "ce":  # [UniCL] eq. (4): the text side is the class-embedding matrix
        return F.cross_entropy(scale * image_features @ text_features.T, batch["label"])
    if bank is None and cfg.loss.kind == "clip" and not cfg.tonics.enabled:
        return clip_loss(image_features, text_features, scale, cfg.loss.gather_with_grad)
    labels = training_labels(batch, batch_index, cfg.tonics.enabled)
    if bank is None:
        return unicl_loss(image_features, text_features, scale, labels, cfg.loss.gather_with_grad)
    keys = [gather_features(k, with_grad=False) for k in (*bank.encode(batch["image"], batch["input_ids"],
                                                                        batch["attention_mask"]), labels)]
    mb = cfg.memory_bank
    # a fill on the device, not a copy from the host: a pageable host-to-device copy waits for the GPU
    bank_scale = scale if mb.learn_temperature else torch.full((), 1.0 / mb.temperature, device=scale.device)
    image_keys, text_keys, key_labels = bank.keys(*keys)  # [BoW] eq. (1)–(2): EMA positives + queue
    loss = unicl_loss(image_features, text_features, bank_scale, labels, image_keys=image_keys,
                      text_keys=text_keys, key_labels=key_labels)
    bank.enqueue(*keys)
    return loss


def _tonics_metrics(curriculum: Curriculum, source: TonicsBatches, device) -> dict:
    """P_S(root), the last refresh, and the sampler's counts summed over ranks (fallbacks happen per rank) and
    over the run's resumes (SamplerTotals)."""
    import torch.distributed as dist

    counts = torch.tensor([source.sampler.counts[n] for n in SAMPLER_COUNTS], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)  # a device tensor: NCCL refuses CPU tensors
    out = dict(source.totals.add(dict(zip(SAMPLER_COUNTS, counts.tolist()))))
    out["tonics_p_root"] = float(curriculum.p[0])
    out["tonics_refreshes"] = sum(h["refreshed"] for h in curriculum.history)
    if curriculum.history:
        out["tonics_last_refresh_accuracy"] = curriculum.history[-1]["accuracy"]
        out["tonics_last_refresh_step"] = curriculum.history[-1]["step"]
    return out


def _step(engine) -> torch.Tensor | float | None:
    """``engine.step()``; at an optimizer step, the global gradient norm before clipping (a device tensor where it
    is one: read at log steps only). DeepSpeed keeps it for ZeRO ≥ 1 and bf16; ZeRO-0 fp32 clips without keeping
    it, so there it is taken from the gradients, which are all-reduced (identical on every rank) by then."""
    norm, boundary = None, engine.is_gradient_accumulation_boundary()
    if boundary and engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():
        grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(grads)) if grads else None
    engine.step()
    if norm is None and boundary:
        norm = engine.get_global_grad_norm()
    return norm
