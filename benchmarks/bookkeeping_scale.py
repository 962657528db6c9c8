"""The data position's bookkeeping at LAION-400M scale, simulated: no data, no Ray Train, no GPU (issue 32, item 7).

Archival baseline: PairsPosition below is a copy of old code, rayvl.data.position.DataPosition as it was before
issue 32 (at 54912c3, the parent of 1082a04, which replaced it and added this file) — every (row id, object) pair kept
and gathered as int64. It is no product code and nothing else uses it: it is kept to measure the runs of
rayvl.data.position against ("before" beside "after" in the tables).

A pass over 41,408 shards × 10,000 samples is dealt out the way Ray Data delivers it — 200 read tasks over groups
of the shuffled shard order, all running, each emitting its shards in order in blocks of 256 rows (less the rows
the pipeline drops), blocks of different tasks interleaved; streaming_split hands each whole block to the rank
handed the fewest rows so far; each rank's local shuffle buffer lets a row be trained up to a buffer's length
late. A rank trains global batch / ranks rows a step, and at
every checkpoint (every 1,000 steps) the real code does what train/loop.py does: every rank packs its rows, rank 0
unpickles them all, merges and settles them with the real DataReport actor class (run in-process), and saves the
train state. A restore then plans every read task of the pass. Both representations run: "before" is the code
before issue 32 (one int64 (row id, object) pair per row, copied here as PairsPosition) and "after" is
rayvl.data.position (runs, RowSet). Its before-merge scans every gathered pair once per unit, so it is timed over
--before-units units and scaled to all of them (the state is completed untimed, by the same code on grouped pairs).

Step time is on paper (see STEP_* below); bookkeeping is shown as seconds and as a share of a step. Prints the
tables, writes bookkeeping_scale.json and bookkeeping_scale.png into --out. docs/scale.md has a run's tables.

    .venv/bin/python benchmarks/bookkeeping_scale.py [--ranks 8,64,256] [--checkpoints 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import heapq
import io
import json
import pickle
import sys
import time
import tracemalloc
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rayvl.data.position import SHARD_SHIFT, DataPosition, unit_of  # noqa: E402
from rayvl.data.report import DataReport  # noqa: E402

SHARDS, SAMPLES = 41_408, 10_000  # LAION-400M as img2dataset writes it
GLOBAL_BATCH, CHECKPOINT_EVERY = 32_768, 1_000
BLOCK = 256  # rows a read task emits per block (shard_read.RAW_ROWS_PER_BLOCK)
READ_TASKS = 200  # read tasks per pass (shards.MAX_TASKS_PER_PASS)
PASSES_PLANNED = 32  # a LAION-400M schedule: OpenCLIP's ViT-B/32 weights are tagged laion400m_e32
# Step time on paper: ViT-B/32 CLIP at 224 px, 77 tokens: 14.78 GFLOPs a sample forward (8.82 image + 5.96 text;
# open_clip docs/model_profile.csv), ×3 for forward + backward, on an A100 (312 TFLOP/s dense bf16) at --mfu
STEP_FLOPS_PER_SAMPLE = 3 * 14.78e9
STEP_PEAK_FLOPS = 312e12
LINK_BYTES_PER_S = 12.5e9  # 100 Gb/s into rank 0's node: the gathered bytes' transfer, estimated, not simulated


# ----------------------------------------------------------------------------- the stream

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64: a row's fixed pseudo-random draw (whether the pipeline drops it)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Pass0:
    """The blocks of pass 0 in the order Ray Data emits them: ``shard``, ``first`` row, rows ``n`` of each."""

    def __init__(self, shards: int, samples: int, drop_rate: float, seed: int):
        rng = np.random.default_rng(seed)
        self.shards, self.samples = shards, samples
        order = rng.permutation(shards)  # ShardStream.order: one permutation per (seed, pass)
        per_shard = -(-samples // BLOCK)
        bounds = np.array([g * shards // READ_TASKS for g in range(READ_TASKS + 1)])  # get_read_tasks' groups
        self.tasks = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
        task_blocks = np.diff(bounds) * per_shard
        # every task runs: which task emits the next block is random, each task's own blocks stay in order
        task = rng.permutation(np.repeat(np.arange(READ_TASKS), task_blocks))
        nth = np.empty(len(task), np.int64)
        nth[np.argsort(task, kind="stable")] = np.arange(len(task)) - np.repeat(np.cumsum(task_blocks) - task_blocks,
                                                                                task_blocks)
        self.shard = order[bounds[task] + nth // per_shard]
        self.first = (nth % per_shard) * BLOCK
        self.n = np.minimum(BLOCK, samples - self.first)
        self.keep_above = np.uint64(min(drop_rate, 1.0) * float(2 ** 64 - 1))

    def rows(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids of the rows of ``blocks`` the pipeline keeps, in stream order; rows kept per block)."""
        n = self.n[blocks]
        starts = np.cumsum(n) - n
        row = np.repeat(self.first[blocks] - starts, n) + np.arange(int(n.sum()))
        ids = np.repeat(self.shard[blocks].astype(np.int64) << SHARD_SHIFT, n) | row
        keep = _mix(ids) >= self.keep_above
        return ids[keep], np.add.reduceat(keep, starts) if len(n) else n


class Ranks:
    """``world`` ranks consuming pass 0: each next block goes to the rank handed the fewest rows so far
    (streaming_split(equal=True): every split pulls as it trains, and the splits get equal rows), each rank's rows
    trained in the order of position + U(0, buffer) (a local shuffle buffer of ``buffer`` rows)."""

    def __init__(self, stream: Pass0, world: int, buffer: int, seed: int):
        self.stream, self.world, self.buffer = stream, world, buffer
        self.rng = np.random.default_rng([seed, world])
        self.handed = np.zeros(world, np.int64)  # rows handed to each rank so far
        self.carry = [(np.zeros(0, np.int64), np.zeros(0))] * world  # handed, not trained yet: (ids, times)
        self.next = 0  # the next block of the pass
        self.kept = np.zeros(stream.shards, np.int64)  # rows each shard produced so far

    def interval(self, checkpoint: int, rows_per_rank: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """(each rank's rows trained between checkpoint − 1 and ``checkpoint``, in training order; shards whose
        read started; shards whose read ended, with the rows they produced)."""
        s, until = self.stream, (checkpoint + 1) * rows_per_rank
        spare = int((until * self.world - self.handed.sum()) / (0.9 * BLOCK)) + 2 * self.world
        blocks = np.arange(self.next, min(self.next + spare, len(s.shard)))
        ids, kept = s.rows(blocks)
        owner = self._deal(kept, until)
        blocks, kept, ids = blocks[:len(owner)], kept[:len(owner)], ids[:int(kept[:len(owner)].sum())]
        self.next += len(owner)
        self.kept += np.bincount(s.shard[blocks], weights=kept, minlength=s.shards).astype(np.int64)
        by_rank = np.repeat(owner, kept)
        order = np.argsort(by_rank, kind="stable")  # each rank's rows, in stream order
        cuts = np.searchsorted(by_rank[order], np.arange(1, self.world))
        trained = [self._train(r, part, until) for r, part in enumerate(np.split(ids[order], cuts))]
        started = s.shard[blocks[s.first[blocks] == 0]]
        ended = s.shard[blocks[s.first[blocks] + s.n[blocks] == s.samples]]
        return trained, started, ended

    def _deal(self, kept: np.ndarray, until: int) -> np.ndarray:
        """The rank each block goes to, until every rank has been handed ``until`` rows."""
        heap = [(int(h), float(t), r) for r, (h, t) in enumerate(zip(self.handed, self.rng.random(self.world)))]
        heapq.heapify(heap)
        owner, ties = [], self.rng.random(len(kept)).tolist()
        for n, tie in zip(kept.tolist(), ties):
            if heap[0][0] >= until:
                break
            handed, _, r = heapq.heappop(heap)
            owner.append(r)
            heapq.heappush(heap, (handed + n, tie, r))
        if heap[0][0] < until:
            raise ValueError("the simulation stays inside pass 0: ask for fewer checkpoints")
        return np.array(owner, dtype=np.int16)

    def _train(self, rank: int, ids: np.ndarray, until: int) -> np.ndarray:
        when = self.handed[rank] + np.arange(len(ids)) + self.rng.random(len(ids)) * self.buffer
        self.handed[rank] += len(ids)
        ids, when = np.concatenate([self.carry[rank][0], ids]), np.concatenate([self.carry[rank][1], when])
        now = when < until
        self.carry[rank] = (ids[~now], when[~now])
        return ids[now][np.argsort(when[now], kind="stable")]


# ----------------------------------------------------------------------------- the code before issue 32

class PairsPosition(DataPosition):
    """rayvl.data.position.DataPosition before issue 32: every (row id, object) pair kept and gathered as int64."""

    partial = None  # an attribute again, not DataPosition's view of its runs

    def __init__(self, n_shards: int):
        super().__init__(n_shards)
        self.partial: dict = {}  # (pass, shard) → sorted unique (k, 2) pairs

    def take_trained(self) -> np.ndarray:
        return self.take_pending()

    def merge(self, pairs: np.ndarray) -> list[tuple[int, int]]:
        passes, shards = unit_of(pairs[:, 0])
        units = {(int(p), int(s)) for p, s in zip(passes.tolist(), shards.tolist())}
        return [u for u in units if self.merge_unit(*u, pairs[(passes == u[0]) & (shards == u[1])])]

    def merge_unit(self, p: int, s: int, new: np.ndarray) -> bool:
        if p in self.complete or s in self.finished.get(p, ()):
            self.duplicates += len(new)
            return False
        old = self.partial.get((p, s), np.zeros((0, 2), np.int64))
        merged = np.unique(np.concatenate([old, new]), axis=0)
        self.duplicates += len(old) + len(new) - len(merged)
        self.rows_per_pass[p] += len(merged) - len(old)
        self.partial[(p, s)] = merged
        return True

    def settle(self, totals: dict) -> list[tuple[int, int]]:
        done = [u for u, pairs in self.partial.items() if u in totals and len(pairs) >= totals[u]]
        for p, s in done:
            del self.partial[(p, s)]
            self.finished.setdefault(p, []).append(s)
        for p in [p for p, shards in self.finished.items() if len(shards) == self.n_shards]:
            del self.finished[p]
            self.complete.append(p)
        return done

    def left_out(self, pass_: int, shards: list[int]):
        if pass_ in self.complete:
            return set(shards), {}
        skip = set(self.finished.get(pass_, ())) & set(shards)
        return skip, {s: set(map(tuple, self.partial[(pass_, s)].tolist())) for s in shards
                      if (pass_, s) in self.partial}

    def state_dict(self) -> dict:
        state = super().state_dict()
        del state["partial_spans"]
        return {**state, "partial": {u: torch.from_numpy(a.copy()) for u, a in self.partial.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({**state, "partial": {}})
        self.partial = {tuple(u): a.numpy() for u, a in state["partial"].items()}


def timed_pairs_merge(pos: PairsPosition, pairs: np.ndarray, units_timed: int) -> float:
    """Seconds PairsPosition.merge takes on ``pairs``: its set of units in full, its per-unit loop (a scan of all
    pairs per unit) over ``units_timed`` units, scaled to every unit; the other units are then merged by the same
    code on pairs grouped once (untimed), so the state is the one merge would leave."""
    t = time.perf_counter()
    passes, shards = unit_of(pairs[:, 0])
    units = sorted({(int(p), int(s)) for p, s in zip(passes.tolist(), shards.tolist())})
    listing = time.perf_counter() - t
    timed = units[:units_timed]
    t = time.perf_counter()
    for p, s in timed:
        pos.merge_unit(p, s, pairs[(passes == p) & (shards == s)])
    loop = (time.perf_counter() - t) * len(units) / max(1, len(timed))
    rest = pairs[np.argsort(pairs[:, 0] >> SHARD_SHIFT, kind="stable")]
    unit = rest[:, 0] >> SHARD_SHIFT
    cuts = np.flatnonzero(unit[1:] != unit[:-1]) + 1
    done = {(p << 27 | s) for p, s in timed}
    for part in np.split(rest, cuts):
        u = int(part[0, 0] >> SHARD_SHIFT)
        if u not in done:
            pos.merge_unit(u >> 27, u & ((1 << 27) - 1), part)
    return listing + loop


class RowsKeptReport(DataReport.__ray_actor_class__):
    """The DataReport actor before issue 32: a shard's produced-row count is kept after the shard is settled, and a
    restore loads a PairsPosition."""

    def settle(self, units):
        kept = dict(self.rows)
        out = super().settle(units)
        self.rows = kept
        return out

    def restore(self, token, position, n_shards):
        super().restore(token, None, n_shards)
        self.position = PairsPosition(n_shards)
        if position is not None:
            self.position.load_state_dict(position)
            self.settled = Counter(position["report"]["counts"])
            self.bad_shards, self.execution = dict(position["report"]["bad_shards"]), self.position.execution


# ----------------------------------------------------------------------------- measuring

def deep_size(obj, seen: set | None = None) -> int:
    """Bytes held by ``obj`` and everything it refers to (arrays and tensors by their buffers)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):  # a view holds its base's buffer (counted once)
        return 112 + (deep_size(obj.base, seen) if isinstance(obj.base, np.ndarray) else obj.nbytes)
    if isinstance(obj, torch.Tensor):
        return 80 + obj.untyped_storage().nbytes()
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(deep_size(x, seen) for x in obj)
    for name in getattr(type(obj), "__slots__", ()):
        size += deep_size(getattr(obj, name, None), seen)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        size += deep_size(vars(obj), seen)
    return size


def clocked(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def feed_report(report, token: str, ranks: Ranks, started: np.ndarray, ended: np.ndarray, attempts: dict) -> None:
    """What the read tasks tell the data report in an interval: a shard's first counts when its read starts, its
    last ones and the rows it produced when it ends (shards.ShardStream._read_shard)."""
    for s in started.tolist():
        attempts[s] = uuid.uuid4().hex
        report.add(Counter(samples_seen=BLOCK, samples_kept=BLOCK, caption_words=11 * BLOCK),
                   unit=(token, attempts[s], 0, s, None))
    for s in ended.tolist():
        produced = int(ranks.kept[s])
        report.add(Counter(samples_seen=SAMPLES - BLOCK, samples_kept=produced - BLOCK,
                           caption_words=11 * (produced - BLOCK), dropped_image_decode=SAMPLES - produced),
                   unit=(token, attempts[s], 0, s, produced))


def pack(kind: str, trained: np.ndarray, micro: int) -> tuple[bytes, float]:
    """What a rank sends at a checkpoint (pickled, as torch.distributed's object collectives do) and the seconds
    it takes: its micro-batches' rows taken from the position and pickled."""
    pos = (PairsPosition if kind == "before" else DataPosition)(SHARDS)
    pairs = np.stack([trained, np.full_like(trained, -1)], 1)
    pos.pending = np.split(pairs, np.arange(micro, len(pairs), micro))
    t = time.perf_counter()
    blob = pickle.dumps(pos.take_trained())
    return blob, time.perf_counter() - t


def rank0(kind: str, pos, report, blobs: list[bytes], units_timed: int) -> dict:
    """Rank 0 at a checkpoint: unpickle every rank's part, merge, settle against the data report, save."""
    parts, unpickle = clocked(lambda: [pickle.loads(b) for b in blobs])
    if kind == "before":
        merge = timed_pairs_merge(pos, np.concatenate(parts), units_timed)
    else:
        merge = clocked(pos.merge, *parts)[1]
    del parts
    t = time.perf_counter()
    done = pos.settle(report.unit_rows(list(pos.partial)))
    pos.report, pos.execution = report.settle(done)
    settle = time.perf_counter() - t
    buf = io.BytesIO()
    t = time.perf_counter()
    torch.save({"data_position": pos.state_dict()}, buf)
    save = time.perf_counter() - t
    return {"unpickle_s": unpickle, "merge_s": merge, "settle_s": settle, "save_s": save,
            "state_bytes": buf.getbuffer().nbytes, "finished_now": len(done), "state": buf.getvalue()}


def rank0_peak(kind: str, pos, report, own: np.ndarray, micro: int, blobs: list[bytes], units_timed: int) -> int:
    """Peak bytes rank 0 allocates during a checkpoint — its own rows packed, then everything ``rank0`` does
    (tracemalloc, on copies) — plus the gather's receive buffer (torch pads every part to the largest: world ×
    largest part) and the position it held before."""
    held = deep_size(pos)
    pos, report = copy.deepcopy(pos), copy.deepcopy(report)
    tracemalloc.start()
    pack(kind, own, micro)
    rank0(kind, pos, report, blobs, units_timed)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return held + peak + len(blobs) * max(map(len, blobs))


def plan_restore(kind: str, state: bytes, tasks: list[list[int]]) -> dict:
    """A restore from this checkpoint: the actor loads the position, then every read task of the pass plans (what
    each is sent, pickled as Ray returns it)."""
    report = (RowsKeptReport if kind == "before" else DataReport.__ray_actor_class__)()
    t = time.perf_counter()
    report.restore("resumed", torch.load(io.BytesIO(state), weights_only=True)["data_position"], SHARDS)
    sizes = [len(pickle.dumps(report.read_task(0, 1, shards))) for shards in tasks]
    return {"restore_plan_s": time.perf_counter() - t, "plan_max_bytes": max(sizes), "plan_total_bytes": sum(sizes),
            "actor_restored_bytes": deep_size(report)}


def trained_seconds(rows: np.ndarray, micro: int, calls: int = 200) -> float:
    """Seconds of one DataPosition.trained call (a micro-batch's row ids; once per micro-batch in the loop)."""
    pos, batches = DataPosition(SHARDS), np.split(rows[:micro * calls], calls)
    t = time.perf_counter()
    for b in batches:
        pos.trained(b)
    return (time.perf_counter() - t) / calls


def step_seconds(micro: int, mfu: float) -> float:
    return micro * STEP_FLOPS_PER_SAMPLE / (STEP_PEAK_FLOPS * mfu)


def end_of_pass_state(pos) -> dict:
    """The train state late in a pass, when ``finished`` lists nearly every shard: this position's partial
    units with every other shard of pass 0 finished."""
    pos = copy.deepcopy(pos)
    partial = {s for _, s in pos.partial}
    pos.finished = {0: [s for s in range(SHARDS) if s not in partial]}
    buf = io.BytesIO()
    _, save = clocked(torch.save, {"data_position": pos.state_dict()}, buf)
    return {"end_state_bytes": buf.getbuffer().nbytes, "end_save_s": save}


def checkpoint(kind: str, pos, report, trained: list[np.ndarray], micro: int, args) -> dict:
    """One checkpoint of ``kind`` (before / after) on every rank and on rank 0; ``pos`` and ``report`` move on."""
    packed = [pack(kind, rows, micro) for rows in trained]
    blobs = [b for b, _ in packed]
    peak = rank0_peak(kind, pos, report, trained[0], micro, blobs, args.before_units)
    out = rank0(kind, pos, report, blobs, args.before_units)
    out.update(plan_restore(kind, out.pop("state"), args.tasks))
    out.update(end_of_pass_state(pos))
    world = len(blobs)
    out.update(rows=int(sum(map(len, trained))), gathered_bytes=sum(map(len, blobs)),
               others_receive_bytes=world * max(map(len, blobs)) if kind == "before" else 0,
               # ranks pack side by side, each as much; here they run one after another on a shared machine,
               # whose pauses the slowest of them catches: the median is the rank's time, the slowest is kept too
               pack_s=float(np.median([s for _, s in packed])), pack_max_s=max(s for _, s in packed),
               rank0_peak_bytes=peak, actor_bytes=deep_size(report),
               actor_rows_entries=len(report.rows), partial_units=len(pos.partial))
    # the actor before issue 32 keeps a row count for every shard ever read (one per shard and pass); after, only
    # for shards read to their end and not yet settled
    per_entry = deep_size(report.rows) / max(1, len(report.rows))
    more = SHARDS * PASSES_PLANNED - len(report.rows) if kind == "before" else 0
    out["actor_projected_bytes"] = out["actor_bytes"] + per_entry * more
    out["transfer_s"] = out["gathered_bytes"] / LINK_BYTES_PER_S
    out["checkpoint_s"] = sum(out[k] for k in ("pack_s", "transfer_s", "unpickle_s", "merge_s", "settle_s",
                                               "save_s"))
    return out


def run_world(world: int, stream: Pass0, args) -> dict:
    """Every checkpoint measured at ``world`` ranks, after and (the first --before-checkpoints) before."""
    micro = GLOBAL_BATCH // world
    ranks = Ranks(stream, world, args.shuffle_buffer, args.seed)
    kinds = {"after": (DataPosition(SHARDS), DataReport.__ray_actor_class__()),
             "before": (PairsPosition(SHARDS), RowsKeptReport())}
    for _, report in kinds.values():
        report.restore("run", None, SHARDS)
    results: dict = {"after": [], "before": []}
    attempts: dict = {}
    for c in range(args.checkpoints):
        t = time.perf_counter()
        trained, started, ended = ranks.interval(c, micro * CHECKPOINT_EVERY)
        for kind, (pos, report) in kinds.items():
            if kind == "before" and c >= args.before_checkpoints:
                continue
            feed_report(report, "run", ranks, started, ended, attempts)
            results[kind].append(checkpoint(kind, pos, report, trained, micro, args))
        if c < args.before_checkpoints:
            same_position(*(pos for pos, _ in kinds.values()))
        print(f"  {world} ranks, checkpoint {c + 1}: {time.perf_counter() - t:.0f} s simulated and measured",
              flush=True)
    trained_s = trained_seconds(trained[0], micro)
    step = step_seconds(micro, args.mfu)
    for runs in results.values():
        for r in runs:
            r.update(trained_s=trained_s, step_s=step,
                     share=(r["checkpoint_s"] / CHECKPOINT_EVERY + trained_s) / step)
    return results


def same_position(after: DataPosition, before: PairsPosition) -> None:
    """The runs hold what the pairs held: the same rows per unit, shards finished, counts."""
    assert after.partial == {u: len(a) for u, a in before.partial.items()}, "partial units differ"
    assert {p: sorted(s) for p, s in after.finished.items()} == {p: sorted(s) for p, s in before.finished.items()}
    assert after.summary() == before.summary() and after.report == before.report


# ----------------------------------------------------------------------------- spec resolution

def spec_resolution(n_shards: int) -> dict:
    """Expanding LAION's shard spec (braceexpand, as webdataset does; rayvl.data.specs.resolve when present) and
    what the shard list weighs where it travels: in every read task, which pickles its datasource."""
    from braceexpand import braceexpand

    spec = f"s3://bucket/laion/{{00000..{n_shards - 1:05d}}}.tar"
    names, expand = clocked(lambda: list(braceexpand(spec)))
    out = {"spec": spec, "shards": len(names), "braceexpand_s": expand, "names_bytes": len(pickle.dumps(names))}
    try:  # hook: rayvl's own resolution (rayvl.data.specs), measured when it is importable and resolves offline
        from rayvl.data.specs import resolve

        resolved, out["rayvl_resolve_s"] = clocked(resolve, spec)
        out["rayvl_resolve_shards"] = len(resolved.paths)
    except Exception as e:  # noqa: BLE001 — whatever stops it is reported, not fatal to the benchmark
        out["rayvl_resolve_error"] = f"{type(e).__name__}: {e}"
    try:
        from ray import cloudpickle

        from rayvl.data.shards import ShardStream

        tasks = ShardStream(names).get_read_tasks(READ_TASKS)
        out["read_task_bytes"] = len(cloudpickle.dumps(tasks[0]))
        out["read_tasks"] = len(tasks)
    except Exception as e:  # noqa: BLE001
        out["read_task_error"] = f"{type(e).__name__}: {e}"
    return out


# ----------------------------------------------------------------------------- report

def _mb(n: float) -> str:
    return f"{n / 2 ** 20:.2f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"


def _s(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def _steady(runs: list[dict]) -> list[dict]:
    """The checkpoints after the first: the first interval starts with empty shuffle buffers, so fewer of its rows
    are scattered at its start."""
    return runs[1:] or runs


def _means(runs: list[dict]) -> dict:
    runs = _steady(runs)
    return {k: float(np.mean([r[k] for r in runs])) for k, v in runs[0].items() if isinstance(v, (int, float))}


def _measured(runs: list[dict]) -> str:
    """Which checkpoints the means are over."""
    first = len(runs) - len(_steady(runs)) + 1
    return str(first) if first == len(runs) else f"{first}–{len(runs)}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def checkpoint_table(results: dict) -> str:
    """Per checkpoint, means over the checkpoints measured after the first (if there are several)."""
    head = ["ranks", "code", "checkpoint", "rows", "to rank 0", "every other rank receives", "pack (a rank)",
            "transfer (est.)", "unpickle", "merge", "settle", "save", "state", "checkpoint", "trained() a step",
            "step (paper)", "share of a step"]
    rows = []
    for world, by_kind in results.items():
        for kind in ("before", "after"):
            if by_kind[kind]:
                m = _means(by_kind[kind])
                rows.append([str(world), kind, _measured(by_kind[kind]), f"{m['rows'] / 1e6:.2f} M",
                             _mb(m["gathered_bytes"]), _mb(m["others_receive_bytes"]) if m["others_receive_bytes"]
                             else "—", *map(_s, (m[k] for k in ("pack_s", "transfer_s", "unpickle_s", "merge_s",
                                                                "settle_s", "save_s"))),
                             _mb(m["state_bytes"]), _s(m["checkpoint_s"]), f"{m['trained_s'] * 1e6:.1f} µs",
                             _s(m["step_s"]), f"{100 * m['share']:.3f} %"])
    return _table(head, rows)


def memory_table(results: dict) -> str:
    """Memory, the train state late in the pass, and a restore's plans."""
    head = ["ranks", "code", "rank-0 peak", "data report actor", "its row counts", "actor after 32 passes (proj.)",
            "state late in the pass", "restore + 200 plans", "largest plan sent", "all plans", "actor restored"]
    rows = []
    for world, by_kind in results.items():
        for kind in ("before", "after"):
            runs = by_kind[kind]
            if runs:
                m, last = _means(runs), runs[-1]
                rows.append([str(world), kind, _mb(max(r["rank0_peak_bytes"] for r in runs)),  # of all measured
                             _mb(last["actor_bytes"]), str(last["actor_rows_entries"]),
                             _mb(last["actor_projected_bytes"]), _mb(m["end_state_bytes"]), _s(m["restore_plan_s"]),
                             _mb(m["plan_max_bytes"]), _mb(m["plan_total_bytes"]), _mb(m["actor_restored_bytes"])])
    return _table(head, rows)


def spec_table(spec: dict) -> str:
    rows = [["braceexpand", f"{spec['shards']} names", _s(spec["braceexpand_s"]), _mb(spec["names_bytes"])]]
    if "rayvl_resolve_s" in spec:
        rows.append(["rayvl.data.specs.resolve", f"{spec['rayvl_resolve_shards']} shards",
                     _s(spec["rayvl_resolve_s"]), ""])
    else:
        rows.append(["rayvl.data.specs.resolve", spec["rayvl_resolve_error"], "", ""])
    if "read_task_bytes" in spec:
        rows.append(["one read task (pickled)", f"{spec['read_tasks']} tasks a pass", "",
                     _mb(spec["read_task_bytes"])])
    else:
        rows.append(["one read task (pickled)", spec["read_task_error"], "", ""])
    return _table([f"`{spec['spec']}`", "result", "time", "size"], rows)


def plot(results: dict, path: Path) -> None:
    """How each cost grows with the ranks, before (dashed) and after (solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [("gathered_bytes", "bytes to rank 0 per checkpoint", 2 ** -20, "MiB"),
              ("checkpoint_s", "bookkeeping per checkpoint", 1, "s"),
              ("share", "share of a step", 100, "%"),
              ("rank0_peak_bytes", "rank-0 peak memory", 2 ** -20, "MiB"),
              ("state_bytes", "train state (data position)", 2 ** -20, "MiB"),
              ("actor_projected_bytes", "data report actor after 32 passes", 2 ** -20, "MiB")]
    worlds = list(results)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title, scale, unit) in zip(axes.ravel(), panels):
        for kind, style in (("before", "--o"), ("after", "-o")):
            have = [w for w in worlds if results[w][kind]]
            ax.plot(have, [_means(results[w][kind])[key] * scale for w in have], style, label=kind)
        if key == "share":
            ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="goal: 1 %")
        if key == "rank0_peak_bytes":
            ax.axhline(1024, color="grey", lw=0.8, ls=":", label="goal: 1 GiB")
        ax.set(xscale="log", yscale="log", title=title, xlabel="ranks", ylabel=unit)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.legend(fontsize=8)
    fig.suptitle("Data-position bookkeeping, LAION-400M simulated (41,408 shards × 10,000; global batch 32,768; "
                 "checkpoint every 1,000 steps)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,64,256")
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints simulated from the start of the pass")
    p.add_argument("--before-checkpoints", type=int, default=1, help="of those, measured with the code before too")
    p.add_argument("--before-units", type=int, default=48, help="units the before-merge's loop is timed over")
    p.add_argument("--shuffle-buffer", type=int, default=5000,
                   help="rows in each rank's local shuffle buffer (open_clip's webdataset sample shuffle: 5,000)")
    p.add_argument("--drop-rate", type=float, default=0.01, help="share of samples the pipeline drops")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the step on paper")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bookkeeping_scale")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    stream = Pass0(SHARDS, SAMPLES, args.drop_rate, args.seed)
    args.tasks = stream.tasks
    results = {}
    for world in map(int, args.ranks.split(",")):
        results[world] = run_world(world, stream, args)
    spec = spec_resolution(SHARDS)
    text = "\n\n".join([checkpoint_table(results), memory_table(results), spec_table(spec)])
    print("\n" + text)
    print(f"\nstep on paper: ViT-B/32 CLIP, {STEP_FLOPS_PER_SAMPLE / 1e9:.2f} GFLOPs a sample (forward + backward) on "
          f"an A100 at {STEP_PEAK_FLOPS / 1e12:.0f} TFLOP/s × MFU {args.mfu}; transfer estimated at "
          f"{LINK_BYTES_PER_S / 1e9:.1f} GB/s; {time.perf_counter() - t:.0f} s in all")
    (out / "bookkeeping_scale.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                                     if k != "tasks"},
                                                            "results": results, "spec": spec}, indent=1))
    (out / "bookkeeping_scale.md").write_text(text + "\n")
    plot(results, out / "bookkeeping_scale.png")
    print(f"wrote {out}/bookkeeping_scale.{{json,md,png}}")


if __name__ == "__main__":
    main()
