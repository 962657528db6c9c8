"""TOnICS on every training worker ([TOnICS] §3, App. A): micro-batches drawn from the step's ontology node, the
curriculum refreshed from held-out retrieval, one label per image-caption pair, and the sampler's counts."""
from __future__ import annotations

import numpy as np
import torch

from rayvl.config import RayvlConfig
from rayvl.data.pipeline import TRAIN_COLUMNS
from rayvl.methods.tonics.sampler import SAMPLER_COUNTS, BucketSampler, Curriculum, SamplerTotals
from rayvl.train.batches import CPU, ROW, epochs, prefetched, shuffle_seeds
from rayvl.train.parts import TrainPart
from rayvl.train.worker import Worker


class TonicsBatches:
    """TOnICS micro-batches (sampler.BucketSampler) over this rank's stream of rows with an "object" column, as
    torch tensors on ``device``, with the time spent waiting for the stream."""

    def __init__(self, shard, cfg: RayvlConfig, rank: int, begin=None, device: torch.device = CPU):
        t, x = cfg.train, cfg.tonics
        self.device = device
        self.waited = 0.0
        self.totals = SamplerTotals()  # the counts of self.sampler, over ranks and resumes (a train-state part)
        seeds = shuffle_seeds(cfg, rank)
        rows = prefetched(lambda: epochs(lambda: shard.iter_batches(
            batch_size=t.micro_batch_size, batch_format="numpy", prefetch_batches=cfg.data.prefetch_batches,
            local_shuffle_buffer_size=cfg.data.local_shuffle_buffer or None, local_shuffle_seed=next(seeds)),
            begin), cfg, device)
        self.sampler = BucketSampler(self._timed(rows), TRAIN_COLUMNS + ["object", ROW], t.micro_batch_size,
                                     x.buffer_rows, x.max_wait_rows, t.seed, rank)

    def _timed(self, rows):
        for item, waited in rows:
            self.waited += waited
            yield item

    def next(self, node: int, step: int, micro: int) -> tuple[dict, float]:
        before = self.waited
        return self.sampler.batch(node, step, micro, self._stack), self.waited - before

    def _stack(self, rows: list) -> torch.Tensor:
        """One column of the micro-batch on the device. To a GPU the rows are stacked straight into pinned host
        memory (torch's caching host allocator: reused once its copy is done) and copied without blocking — one
        host copy of the images, where stacking and then pinning made two."""
        if self.device.type != "cuda":
            return torch.from_numpy(np.stack(rows))
        first = np.asarray(rows[0])  # a column's rows share its dtype (one Ray Data column)
        pinned = torch.empty((len(rows), *first.shape), dtype=torch.from_numpy(first).dtype, pin_memory=True)
        np.stack(rows, out=pinned.numpy())
        return pinned.to(self.device, non_blocking=True)


def pair_labels(batch: dict) -> torch.Tensor:
    """TargetM ([UniCL] Algorithm 1) for TOnICS rows: the rows of one pair (one per aligned class, the same image
    and caption) share their pair's label — the same pair twice in a batch is a positive, not a false negative;
    with no pair repeated this is the CLIP loss. Row ids are ≥ 0 and unique per (pass, shard, sample)."""
    return -2 - batch[ROW]


class TonicsPart(TrainPart):
    name = "tonics"
    added_later = frozenset({"tonics_sampler"})  # checkpoints of TOnICS runs before its sampler counts resume

    @staticmethod
    def enabled(cfg: RayvlConfig) -> bool:
        return cfg.tonics.enabled

    def __init__(self, worker: Worker):
        x, self.worker = worker.cfg.tonics, worker
        # [TOnICS] §3: the node of step s is drawn from (seed, s), the same on every rank
        self.curriculum = Curriculum(worker.inputs("tonics")["sizes"], x.alpha, x.beta, x.threshold,
                                     worker.cfg.train.seed, moves=x.curriculum)
        self.source: TonicsBatches | None = None  # its stream starts in batches(), after the held-out read

    def batches(self):
        import ray.train

        w = self.worker
        self.source = TonicsBatches(ray.train.get_dataset_shard("train"), w.cfg, w.rank, w.begin, w.device)
        return lambda step, micro: self.source.next(self.curriculum.node(step), step, micro)

    def targets(self, batch: dict, batch_index: int) -> torch.Tensor:
        return pair_labels(batch)

    def components(self) -> dict:
        return {"curriculum": self.curriculum, "tonics_sampler": self.source.totals}

    def after_step(self, engine, step: int) -> bool:
        """Every tonics.refresh_every steps: held-out text→image R@1 decides the refresh ([TOnICS] App. A.2)."""
        x = self.worker.cfg.tonics
        if step % x.refresh_every:
            return False
        accuracy = self.worker.evaluation.retrieval(engine.module, x.refresh_instances)
        refreshed = self.curriculum.update(step, accuracy)
        if self.worker.rank == 0:
            print(f"rayvl: TOnICS step {step}: held-out t2i R@1 {accuracy:.1f}% "
                  f"{'≥' if refreshed else '<'} {x.threshold:g}% → P_S(root) {self.curriculum.p[0]:.3f}"
                  f"{' (refreshed)' if refreshed else ''}", flush=True)
        return True

    def metrics(self, device) -> dict:
        """P_S(root), the last refresh, and the sampler's counts summed over ranks (fallbacks happen per rank) and
        over the run's resumes (SamplerTotals)."""
        import torch.distributed as dist

        sampler, curriculum = self.source.sampler, self.curriculum
        counts = torch.tensor([sampler.counts[n] for n in SAMPLER_COUNTS], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts)  # a device tensor: NCCL refuses CPU tensors
        out = dict(self.source.totals.add(dict(zip(SAMPLER_COUNTS, counts.tolist()))))
        out["tonics_p_root"] = float(curriculum.p[0])
        out["tonics_refreshes"] = sum(h["refreshed"] for h in curriculum.history)
        if curriculum.history:
            out["tonics_last_refresh_accuracy"] = curriculum.history[-1]["accuracy"]
            out["tonics_last_refresh_step"] = curriculum.history[-1]["step"]
        return out
