"""The per-worker training loop: restore → while step < max: step, report, checkpoint, evaluate."""
from __future__ import annotations

import os
import time

import ray.train
import torch

from rayvl.config import from_dict
from rayvl.losses import clip_loss
from rayvl.models.dual_encoder import build_model
from rayvl.train import checkpoint
from rayvl.train.batches import batch_stream
from rayvl.train.evaluation import EvalSet, evaluate


def train_loop_per_worker(config: dict) -> None:
    cfg = from_dict(config["rayvl"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from rayvl.train.engine import build_engine

    engine = build_engine(build_model(cfg.model, cfg.train.seed), cfg, world)
    step, history = checkpoint.restore(engine)
    batches = batch_stream(ray.train.get_dataset_shard("train"), cfg)
    eval_set = EvalSet.load(ray.train.get_dataset_shard("eval"), config, cfg) if cfg.eval.tasks else None
    report_name = config.get("report_name")
    window = _new_window()

    while step < cfg.train.max_steps:
        for _ in range(cfg.train.grad_accumulation):
            batch, waited = next(batches)
            image_features, text_features, scale = engine(batch["image"], batch["input_ids"],
                                                          batch["attention_mask"])
            loss = clip_loss(image_features, text_features, scale, cfg.loss.gather_with_grad)
            engine.backward(loss)
            engine.step()
            window["loss"] += loss.item() / cfg.train.grad_accumulation
            window["wait"] += waited
            window["samples"] += batch["image"].shape[0] * world
        step += 1
        window["steps"] += 1

        last = step == cfg.train.max_steps
        do_eval = eval_set is not None and (last or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0))
        do_ckpt = last or step % cfg.train.checkpoint_every == 0
        if not (do_eval or do_ckpt or step % cfg.train.log_every == 0):
            continue
        metrics = _window_metrics(window, step, engine, report_name)
        if do_eval:
            metrics.update(evaluate(engine.module, eval_set, cfg, rank, world))
        history.append(metrics)
        if do_ckpt:
            with checkpoint.saved(engine, step, history, config["rayvl"], final=last) as ckpt:
                ray.train.report(metrics, checkpoint=ckpt)
        else:
            ray.train.report(metrics)
        window = _new_window()


def _new_window() -> dict:
    return {"loss": 0.0, "wait": 0.0, "samples": 0, "steps": 0, "start": time.perf_counter()}


def _window_metrics(window: dict, step: int, engine, report_name: str | None) -> dict:
    elapsed = time.perf_counter() - window["start"]
    metrics = {
        "step": step,
        "loss": window["loss"] / max(1, window["steps"]),
        "lr": engine.get_lr()[0],
        "logit_scale": engine.module.scale().item(),
        "samples_per_s": window["samples"] / elapsed,
        "data_wait_share": window["wait"] / elapsed,
    }
    if report_name:
        from rayvl.data.shards import report_actor

        counts = ray.get(report_actor(report_name).snapshot.remote())["counts"]
        metrics.update({k: v for k, v in counts.items()})
    return metrics
