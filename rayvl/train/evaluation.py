"""Evaluation inside the training loop: the tasks of ``rayvl.eval.tasks`` with the model being trained, every rank
embedding an equal slice (``ModelEmbedder``). Every rank reads the whole held-out split, so all ranks evaluate the
same data in the same (key) order, as ``rayvl eval`` does. Each rank searches with faiss on its own model's GPU
(CPU on CPU ranks): a Ray Train worker sees every GPU of its node, and faiss would otherwise copy each rank's index
to all of them."""
from __future__ import annotations

import time

import torch

from rayvl.config import RayvlConfig, precision
from rayvl.errors import DataPlaneError
from rayvl.eval import knn
from rayvl.eval.data import EvalData, from_batches
from rayvl.eval.embed import ModelEmbedder, batch_size
from rayvl.eval.tasks import evaluate as evaluate_tasks
from rayvl.models.precision import autocast_dtype


def load_eval_data(shard, files: dict, cfg: RayvlConfig) -> EvalData:
    """The held-out split from this rank's Ray Data shard, with the class list and the text sets of the tasks."""
    data = from_batches(list(shard.iter_batches(batch_size=256, batch_format="numpy")))
    tasks = cfg.eval.tasks
    return data.with_text_sets(files.get("classes_file", ""),
                               files.get("paraphrases_file", "") if "paraphrase" in tasks else "",
                               files.get("sts_file", "") if "sts" in tasks else "")


@torch.no_grad()
def evaluate(model, data: EvalData, cfg: RayvlConfig, tokenizer_path: str, rank: int, world: int,
             tasks: list[str] | None = None) -> dict:
    """Every task's metrics in one flat dict (their names do not collide), plus ``eval_images``."""
    was_training = model.training
    model.eval()
    knn.use_gpus(knn.device_gpus(next(model.parameters()).device))  # the GPU this rank computes on, or CPU
    # on a GPU, in the precision the run trains in: stage 0 keeps fp32 weights and trains them under autocast, which
    # its evaluation (and TOnICS's refresh, which reads it) now shares; ZeRO's bf16 / fp16 weights compute in their
    # dtype either way
    on_gpu = next(model.parameters()).device.type == "cuda"
    embedder = ModelEmbedder(model, tokenizer_path, cfg.data.max_text_tokens,
                             batch_size(cfg.eval.batch_size, on_gpu, cfg.train.micro_batch_size), rank, world,
                             autocast_dtype(precision(cfg.train)))
    results, _ = evaluate_tasks(tasks or cfg.eval.tasks, data, embedder, cfg.eval.paraphrase_k)
    model.train(was_training)
    return {"eval_images": data.size, **{k: v for metrics in results.values() for k, v in metrics.items()}}


def held_out_retrieval(model, data: EvalData, n: int, cfg: RayvlConfig, tokenizer_path: str, rank: int,
                       world: int) -> float:
    """Text→image R@1 (%) over the first n held-out instances: TOnICS' refresh signal ([TOnICS] §3, App. A.2:
    100 instances). Split across ranks and gathered, so every rank gets the same number."""
    head = data.head(n)
    if not head.captions:  # the method's data part refuses a CLIP_benchmark classification set before Ray starts
        raise DataPlaneError("data.eval: the held-out split has no captions, which this held-out check ranks")
    return evaluate(model, head, cfg, tokenizer_path, rank, world, ["retrieval"])["t2i_R@1"]


class Evaluation:
    """The held-out evaluation of one worker: loaded once from its "eval" dataset shard (``load``), run every
    ``eval.every_steps`` and at the last step (``due``), or on its first instances only (``retrieval``)."""

    def __init__(self, cfg: RayvlConfig, files: dict, tokenizer_path: str, rank: int, world: int):
        self.cfg, self.files, self.rank, self.world = cfg, files, rank, world
        self.tokenizer_path = tokenizer_path
        self.data: EvalData | None = None

    def load(self, shard) -> None:
        if self.cfg.eval.tasks:
            self.data = load_eval_data(shard, self.files, self.cfg)

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.eval.every_steps
        return self.data is not None and (last or bool(every and step % every == 0))

    def run(self, model) -> dict:
        """The evaluation's metrics and ``evaluation_s``, how long it paused training (its embeddings are read back
        at its end, so on a GPU too this is the whole evaluation; not ``eval_``: a model's metrics are named so)."""
        started = time.perf_counter()
        metrics = evaluate(model, self.data, self.cfg, self.tokenizer_path, self.rank, self.world)
        return {**metrics, "evaluation_s": time.perf_counter() - started}

    def retrieval(self, model, n: int) -> float:
        """Text→image R@1 (%) over the first ``n`` held-out instances (held_out_retrieval)."""
        return held_out_retrieval(model, self.data, n, self.cfg, self.tokenizer_path, self.rank, self.world)
