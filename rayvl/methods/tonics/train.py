"""TOnICS on every training worker ([TOnICS] §3, App. A): micro-batches drawn from the step's ontology node, the
curriculum refreshed from held-out retrieval, one label per image-caption pair, and the sampler's counts."""
from __future__ import annotations

import threading
from collections import Counter, deque

import numpy as np
import torch

from rayvl.config import RayvlConfig
from rayvl.data.pipeline import read_columns
from rayvl.methods.tonics.sampler import SAMPLER_COUNTS, BucketSampler, Curriculum, SamplerTotals
from rayvl.train.batches import CPU, ROW, epochs, prefetched, shuffle_seeds
from rayvl.train.parts import TrainPart
from rayvl.train.worker import Worker


class TonicsBatches:
    """TOnICS micro-batches (sampler.BucketSampler) over this rank's stream of rows with an "object" column, as
    torch tensors on ``device``, and the seconds the training thread waited for each.

    A thread of their own draws them ahead of the training thread — the bucketing of every row read and the stacking
    of a micro-batch are host work that a step would otherwise wait for — up to ``data.prefetch_batches`` ahead,
    and never past a refresh the training loop has not decided: step s's node is drawn from P_S, which the refresh
    of the last multiple of ``tonics.refresh_every`` before s may change ([TOnICS] App. A.2), so the thread waits
    for ``decided`` of that step. The batches and the node of each step are what drawing on demand gives (the
    sampler's draws are seeded by step, micro-step and rank); its counts are taken when a batch is handed out."""

    def __init__(self, shard, cfg: RayvlConfig, rank: int, curriculum: Curriculum, begin=None,
                 device: torch.device = CPU):
        t, x = cfg.train, cfg.tonics
        self.cfg, self.device, self.curriculum = cfg, device, curriculum
        self.every, self.accumulation = x.refresh_every, t.grad_accumulation
        self.totals = SamplerTotals()  # the counts handed out, over ranks and resumes (a train-state part)
        self.counts: Counter = Counter()  # this start's counts of the micro-batches handed out
        seeds = shuffle_seeds(cfg, rank)
        rows = prefetched(lambda: epochs(lambda: shard.iter_batches(
            batch_size=t.micro_batch_size, batch_format="numpy", prefetch_batches=cfg.data.prefetch_batches,
            local_shuffle_buffer_size=cfg.data.local_shuffle_buffer or None, local_shuffle_seed=next(seeds)),
            begin), cfg)
        self.sampler = BucketSampler((item for item, _ in rows), read_columns(cfg.data.decode) + ["object", ROW],
                                     t.micro_batch_size, x.buffer_rows, x.max_wait_rows, t.seed, rank)
        self.decided_through = 0  # the last step whose refresh the training loop decided
        self.changed = threading.Condition()
        self.drawn: deque = deque()  # ((step, micro), its counts) of each batch drawn and not yet handed out
        self.waiting_for: int | None = None  # the refresh step the drawing thread waits for the decision of
        self.batches = None  # the drawing thread's, started at the first step asked for (a resume's first too)

    def next(self, step: int, micro: int) -> tuple[dict, float]:
        if self.batches is None:
            self.decided(step - 1)  # the steps before the first asked for are behind the curriculum it restored
            # each read of the stream is watched for a stall (data.stall_timeout_s); a micro-batch may take many
            self.batches = prefetched(lambda: self._draw(step), self.cfg, self.device, copy=True, watched=False)
        batch, waited = next(self.batches)
        drawn_for, counts = self.drawn.popleft()
        if drawn_for != (step, micro):
            raise RuntimeError(f"TOnICS batches: drew step {drawn_for} where the loop asked for {(step, micro)}")
        self.counts.update(counts)
        return batch, waited

    def decided(self, step: int) -> None:
        """The training loop is past step ``step``'s refresh decision (after_step): later nodes may be drawn."""
        with self.changed:
            self.decided_through = max(self.decided_through, step)
            self.changed.notify_all()

    def _draw(self, first: int):
        """The micro-batches of steps first, first + 1, ..., the run's last, in order (in the drawing thread)."""
        for step in range(first, self.cfg.train.end_step + 1):
            refresh = (step - 1) // self.every * self.every  # the last refresh that may change this step's node
            with self.changed:
                self.waiting_for = refresh if self.decided_through < refresh else None
                self.changed.wait_for(lambda: self.decided_through >= refresh)
                self.waiting_for = None
            node = self.curriculum.node(step)
            for micro in range(self.accumulation):
                before = Counter(self.sampler.counts)
                batch = self.sampler.batch(node, step, micro, self._stack)
                self.drawn.append(((step, micro), Counter(self.sampler.counts) - before))
                yield batch
        # the loop asks for none after its last step: this reaches the training thread only if it does
        raise RuntimeError(f"TOnICS batches: none after step {self.cfg.train.end_step} (train.end_step)")

    def _stack(self, rows: list) -> torch.Tensor | list:
        """One column of the micro-batch as a host tensor — for a GPU stacked straight into pinned memory (torch's
        caching host allocator: reused once its copy is done), which the drawing thread then copies on a stream of
        its own (batches.DeviceCopy): one host copy of the images. JPEG bytes (data.decode: device) stay a list,
        which the copy decodes."""
        if isinstance(rows[0], bytes):
            return list(rows)
        if self.device.type != "cuda":
            return torch.from_numpy(np.stack(rows))
        first = np.asarray(rows[0])  # a column's rows share its dtype (one Ray Data column)
        pinned = torch.empty((len(rows), *first.shape), dtype=torch.from_numpy(first).dtype, pin_memory=True)
        np.stack(rows, out=pinned.numpy())
        return pinned


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
        self.source = TonicsBatches(ray.train.get_dataset_shard("train"), w.cfg, w.rank, self.curriculum, w.begin,
                                    w.device)
        return self.source.next

    def targets(self, batch: dict, batch_index: int) -> torch.Tensor:
        return pair_labels(batch)

    def components(self) -> dict:
        return {"curriculum": self.curriculum, "tonics_sampler": self.source.totals}

    def after_step(self, engine, step: int) -> bool:
        """Every tonics.refresh_every steps: held-out text→image R@1 decides the refresh ([TOnICS] App. A.2)."""
        x = self.worker.cfg.tonics
        if step % x.refresh_every:
            self.source.decided(step)
            return False
        accuracy = self.worker.evaluation.retrieval(engine.module, x.refresh_instances)
        refreshed = self.curriculum.update(step, accuracy)
        self.source.decided(step)  # the nodes after it are drawn from the P_S it left
        if self.worker.rank == 0:
            print(f"rayvl: TOnICS step {step}: held-out t2i R@1 {accuracy:.1f}% "
                  f"{'≥' if refreshed else '<'} {x.threshold:g}% → P_S(root) {self.curriculum.p[0]:.3f}"
                  f"{' (refreshed)' if refreshed else ''}", flush=True)
        return True

    def metrics(self, device) -> dict:
        """P_S(root), the last refresh, and the sampler's counts summed over ranks (fallbacks happen per rank) and
        over the run's resumes (SamplerTotals)."""
        import torch.distributed as dist

        source, curriculum = self.source, self.curriculum
        counts = torch.tensor([source.counts[n] for n in SAMPLER_COUNTS], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts)  # a device tensor: NCCL refuses CPU tensors
        out = dict(self.source.totals.add(dict(zip(SAMPLER_COUNTS, counts.tolist()))))
        out["tonics_p_root"] = float(curriculum.p[0])
        out["tonics_refreshes"] = sum(h["refreshed"] for h in curriculum.history)
        if curriculum.history:
            out["tonics_last_refresh_accuracy"] = curriculum.history[-1]["accuracy"]
            out["tonics_last_refresh_step"] = curriculum.history[-1]["step"]
        return out
