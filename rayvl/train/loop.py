"""The per-worker training loop: restore → while step < max: step, report, checkpoint, evaluate."""
from __future__ import annotations

import os
import time

import ray.train
import torch
import torch.nn.functional as F

from rayvl.config import from_dict
from rayvl.data.tonics import Curriculum
from rayvl.losses import clip_loss, gather_features, unicl_loss
from rayvl.models.dual_encoder import build_model
from rayvl.models.memory_bank import MemoryBank
from rayvl.train import checkpoint
from rayvl.train.batches import TonicsBatches, batch_stream, mixed_stream
from rayvl.train.evaluation import EvalSet, evaluate, held_out_retrieval


def train_loop_per_worker(config: dict) -> None:
    cfg = from_dict(config["rayvl"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from rayvl.train.engine import build_engine

    model = build_model(cfg.model, cfg.train.seed)
    bank = MemoryBank(model, cfg.memory_bank.size, cfg.model.embed_dim, cfg.memory_bank.momentum) \
        if cfg.memory_bank.size else None
    engine = build_engine(model, cfg, world)
    step, history, client_state = checkpoint.restore(engine)
    if bank is not None:
        bank.to(engine.device)
        if "memory_bank" in client_state:
            bank.load_state_dict(client_state["memory_bank"])
    next_batch, curriculum, source = _batches(cfg, config, rank, client_state)
    eval_set = EvalSet.load(ray.train.get_dataset_shard("eval"), config, cfg) if cfg.eval.tasks else None
    report_name = config.get("report_name")
    window = _new_window()

    while step < cfg.train.max_steps:
        for micro in range(cfg.train.grad_accumulation):
            batch, waited = next_batch(step + 1, micro)
            loss = _loss(engine, batch, cfg, bank, (step * cfg.train.grad_accumulation + micro) * world + rank)
            engine.backward(loss)
            engine.step()
            window["loss"] += loss.item() / cfg.train.grad_accumulation
            window["wait"] += waited
            window["samples"] += batch["image"].shape[0] * world
            window["label_rows"] += int((batch["label"] >= 0).sum()) * world  # image-label share of batches
        if bank is not None:  # MoCo: the key encoders follow the trained ones once per optimizer step
            bank.update(engine.module)
        step += 1
        window["steps"] += 1

        last = step == cfg.train.max_steps
        do_refresh = curriculum is not None and step % cfg.tonics.refresh_every == 0
        if do_refresh:
            accuracy = held_out_retrieval(engine.module, eval_set, cfg.tonics.refresh_instances, cfg, rank, world)
            refreshed = curriculum.update(step, accuracy)
            if rank == 0:
                print(f"rayvl: TOnICS step {step}: held-out t2i R@1 {accuracy:.1f}% "
                      f"{'≥' if refreshed else '<'} {cfg.tonics.threshold:g}% → P_S(root) {curriculum.p[0]:.3f}"
                      f"{' (refreshed)' if refreshed else ''}", flush=True)
        do_eval = eval_set is not None and (last or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0))
        do_ckpt = last or step % cfg.train.checkpoint_every == 0
        if not (do_eval or do_ckpt or do_refresh or step % cfg.train.log_every == 0):
            continue
        metrics = _window_metrics(window, step, engine, report_name)
        if curriculum is not None:
            metrics.update(_tonics_metrics(curriculum, source))
        if do_eval:
            metrics.update(evaluate(engine.module, eval_set, cfg, rank, world))
        history.append(metrics)
        if do_ckpt:
            extra = {"tonics": curriculum.state_dict()} if curriculum else None
            files = {"memory_bank": bank.state_dict()} if bank else None
            with checkpoint.saved(engine, step, history, config["rayvl"], final=last, extra=extra,
                                  rank0_files=files) as ckpt:
                ray.train.report(metrics, checkpoint=ckpt)
        else:
            ray.train.report(metrics)
        window = _new_window()


def _batches(cfg, config: dict, rank: int, client_state: dict):
    """(next_batch(step, micro) → (batch, seconds waited), TOnICS curriculum or None, TOnICS source or None)."""
    shard = ray.train.get_dataset_shard("train")
    if cfg.tonics.enabled:  # seed tonics §3: the node of step s is drawn from (seed, s), the same on every rank
        x = cfg.tonics
        curriculum = Curriculum(config["tonics_sizes"], x.alpha, x.beta, x.threshold, cfg.train.seed)
        if "tonics" in client_state:
            curriculum.load_state_dict(client_state["tonics"])
        source = TonicsBatches(shard, cfg, rank)
        return (lambda step, micro: source.next(curriculum.node(step), step, micro)), curriculum, source
    if cfg.image_label.data and cfg.image_label.weight < 1.0:  # seed unicl App. B.2: balanced batches
        stream = mixed_stream(shard, ray.train.get_dataset_shard("labeled"), cfg)
    else:
        stream = batch_stream(shard, cfg)
    return (lambda step, micro: next(stream)), None, None


def _loss(engine, batch: dict, cfg, bank: MemoryBank | None, batch_index: int) -> torch.Tensor:
    """InfoNCE or UniCL over the gathered batch, or against the EMA keys + queue when a memory bank is on."""
    image_features, text_features, scale = engine(batch["image"], batch["input_ids"], batch["attention_mask"])
    if cfg.loss.kind == "ce":  # seed unicl eq. (4): the text side is the class-embedding matrix
        return F.cross_entropy(scale * image_features @ text_features.T, batch["label"])
    if bank is None and cfg.loss.kind == "clip":
        return clip_loss(image_features, text_features, scale, cfg.loss.gather_with_grad)
    # TargetM (seed unicl Algorithm 1): image-label rows keep their class id (≥ 0); every image-text row gets a
    # label of its own, unique across ranks, steps and so across the queue
    b = batch["label"].shape[0]
    unique = -1 - (batch_index * b + torch.arange(b, device=batch["label"].device))
    labels = torch.where(batch["label"] >= 0, batch["label"], unique)
    if bank is None:
        return unicl_loss(image_features, text_features, scale, labels, cfg.loss.gather_with_grad)
    keys = [gather_features(k, with_grad=False) for k in (*bank.encode(batch["image"], batch["input_ids"],
                                                                        batch["attention_mask"]), labels)]
    mb = cfg.memory_bank
    bank_scale = scale if mb.learn_temperature else torch.tensor(1.0 / mb.temperature, device=scale.device)
    image_keys, text_keys, key_labels = bank.keys(*keys)  # seed bow eq. (1)–(2): EMA positives + queue
    loss = unicl_loss(image_features, text_features, bank_scale, labels, image_keys=image_keys,
                      text_keys=text_keys, key_labels=key_labels)
    bank.enqueue(*keys)
    return loss


def _tonics_metrics(curriculum: Curriculum, source: TonicsBatches) -> dict:
    """P_S(root), the last refresh, and the sampler's counts summed over ranks (fallbacks happen per rank)."""
    import torch.distributed as dist

    names = ["tonics_node_root_batches", "tonics_node_object_batches", "tonics_fallback_batches",
             "tonics_fallback_rows"]
    counts = torch.tensor([float(source.sampler.counts[n]) for n in names])
    if dist.is_initialized():
        dist.all_reduce(counts)
    out = {n: int(v) for n, v in zip(names, counts.tolist())}
    out["tonics_p_root"] = float(curriculum.p[0])
    out["tonics_refreshes"] = sum(h["refreshed"] for h in curriculum.history)
    if curriculum.history:
        out["tonics_last_refresh_accuracy"] = curriculum.history[-1]["accuracy"]
    return out


def _new_window() -> dict:
    return {"loss": 0.0, "wait": 0.0, "samples": 0, "label_rows": 0, "steps": 0, "start": time.perf_counter()}


def _window_metrics(window: dict, step: int, engine, report_name: str | None) -> dict:
    elapsed = time.perf_counter() - window["start"]
    metrics = {
        "step": step,
        "loss": window["loss"] / max(1, window["steps"]),
        "lr": engine.get_lr()[0],
        "logit_scale": engine.module.scale().item(),
        "samples_per_s": window["samples"] / elapsed,
        "data_wait_share": window["wait"] / elapsed,
        "image_label_share": window["label_rows"] / max(1, window["samples"]),
    }
    if report_name:
        from rayvl.data.shards import report_actor

        counts = ray.get(report_actor(report_name).snapshot.remote())["counts"]
        metrics.update({k: v for k, v in counts.items()})
    return metrics
