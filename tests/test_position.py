"""The data position (rayvl.data.position): row ids, what rank 0 merges and settles at a checkpoint, and a read that
resumes from it — finished shards skipped, rows already trained on dropped, the data report continued exactly."""
import io
import uuid

import numpy as np
import pytest
import torch

from rayvl.data.pipeline import Rows
from rayvl.data.position import DataPosition, RowSet, row_ids, unit_of
from rayvl.data.shards import Reading


def test_row_ids_name_pass_shard_and_row():
    ids = row_ids(3, 41_000, 9_998, 2)
    assert unit_of(ids)[0].tolist() == [3, 3] and unit_of(ids)[1].tolist() == [41_000, 41_000]
    assert (ids & ((1 << 20) - 1)).tolist() == [9_998, 9_999]
    with pytest.raises(ValueError, match="samples a shard"):
        row_ids(0, 0, (1 << 20) - 1, 2)


def test_merge_counts_duplicates_and_settles_finished_shards_and_passes():
    pos = DataPosition(n_shards=2)
    a, b = row_ids(0, 0, 0, 4), row_ids(0, 1, 0, 3)
    pos.trained(a[:2])
    pos.trained(np.concatenate([a[2:], [-1, -1]]))  # −1: image-label rows, not tracked
    rank1 = np.stack([b, np.full(3, -1)], 1)
    assert sorted(pos.merge(np.concatenate([pos.take_pending(), rank1]))) == [(0, 0), (0, 1)]
    assert pos.rows_per_pass[0] == 7 and pos.duplicates == 0 and not pos.pending
    assert pos.settle({(0, 0): 4}) == [(0, 0)]  # shard 1's read has not reached its end: no total yet
    assert pos.finished == {0: [0]} and list(pos.partial) == [(0, 1)]
    assert pos.left_out(0, [0, 1]) == ({0}, {1: {(int(i), -1) for i in b}})
    # a row trained on again (a restarted stream would do this) is a duplicate, never a new row
    pos.merge(np.stack([np.concatenate([a[:1], b[:1]]), [-1, -1]], 1))
    assert pos.duplicates == 2 and pos.rows_per_pass[0] == 7
    # TOnICS: one sample, two aligned nouns → two rows
    pos.merge(np.array([[b[2], 5], [b[2], 7]]))
    assert pos.settle({(0, 1): 4}) == [(0, 1)] and pos.complete == [0] and pos.finished == {}
    assert pos.left_out(0, [0, 1]) == ({0, 1}, {}) and pos.left_out(1, [0]) == (set(), {})

    buf = io.BytesIO()
    torch.save(pos.state_dict(), buf)
    back = DataPosition(n_shards=2)
    back.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert back.summary() == pos.summary() == {"data_rows_trained": 9, "data_duplicate_rows": 2,
                                               "data_passes_complete": 1}
    with pytest.raises(ValueError, match="data.train"):
        DataPosition(n_shards=3).load_state_dict(pos.state_dict())


def test_a_resumed_read_skips_finished_shards_and_trained_rows_and_continues_the_report(ray_local, demo_dir):
    from rayvl import assets
    from rayvl.data import shards
    from rayvl.data.report import create_report, report_actor, snapshot

    def read(name):
        ds = shards.read_shards(str(demo_dir / "train"), Rows(image_size=16, crop_scale_min=0.5, train=True, seed=1,
                                tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8),
                                Reading(read_cpus=0.5, batch_size=32, shuffle=True, report_name=name,
                                        passes=1, seed=1, positioned=True), columns=["row", "key"])
        return {int(r["row"]): r["key"] for r in ds.take_all()}

    first_name, second_name = (f"position-test-{uuid.uuid4().hex[:6]}" for _ in range(2))
    create_report(first_name)
    everything = read(first_name)
    full = snapshot(first_name)["counts"]
    assert len(everything) == len(set(everything.values())) == full["samples_kept"]
    by_shard = {s: sorted(i for i in everything if unit_of(np.int64(i))[1] == s) for s in range(3)}

    # trained before the "checkpoint": all of shard 0 and the first 50 rows of shard 1
    pos = DataPosition(n_shards=3)
    pos.trained(np.array(by_shard[0] + by_shard[1][:50]))
    first = report_actor(first_name)
    pos.merge(pos.take_pending())
    import ray

    done = pos.settle(ray.get(first.unit_rows.remote(list(pos.partial))))
    assert done == [(0, 0)]
    pos.report, pos.execution = ray.get(first.settle.remote(done))
    assert pos.report["counts"]["samples_seen"] == 128

    second = create_report(second_name)
    ray.get(second.restore.remote(uuid.uuid4().hex, pos.state_dict(), 3))
    resumed = read(second_name)
    assert set(resumed) == set(by_shard[1][50:] + by_shard[2])  # every row not trained on, once
    # the report continues: shard 0 settled (not read again), shards 1 and 2 read (and counted) once more
    assert snapshot(second_name)["counts"] == full

    # a further execution of the same dataset (the listed passes ran out) reads the passes after them
    ray.get(second.begin_execution.remote(1))
    again = read(second_name)
    assert {int(unit_of(np.int64(i))[0]) for i in again} == {1} and sorted(again.values()) == sorted(
        everything.values())


def test_a_stream_resumed_on_two_ranks_and_read_to_its_end_trains_every_row_of_every_pass_once(ray_local, demo_dir):
    """What the training loop does, without the model: two ranks read a two-pass stream through Ray's
    streaming_split(equal=True) with a local shuffle buffer, stop after 96 rows each (the "checkpoint"), and a new
    stream resumed from the merged position is read to its end — the interrupted pass and the next each have their
    384 rows exactly once."""
    import threading

    import ray

    from rayvl import assets
    from rayvl.data import shards
    from rayvl.data.report import create_report, report_actor

    def consume(name, token, position, limit):
        ray.get(create_report(name).restore.remote(token, position, 3))
        ds = shards.read_shards(str(demo_dir / "train"), Rows(image_size=16, crop_scale_min=0.5, train=True, seed=3,
                                tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8),
                                Reading(read_cpus=0.5, batch_size=32, shuffle=True, report_name=name,
                                        passes=2, seed=3, positioned=True), columns=["row", "image"])
        splits, got = ds.streaming_split(2, equal=True), [[], []]

        def rank(i):
            for batch in splits[i].iter_torch_batches(batch_size=16, drop_last=True, local_shuffle_buffer_size=64):
                got[i].append(batch["row"].numpy())
                if limit and 16 * len(got[i]) >= limit:
                    break

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return np.concatenate(got[0] + got[1])

    first_name, second_name = (f"position-test-{uuid.uuid4().hex[:6]}" for _ in range(2))
    pos = DataPosition(n_shards=3)
    pos.trained(consume(first_name, "t1", None, 96))
    pos.merge(pos.take_pending())
    actor = report_actor(first_name)
    pos.report, pos.execution = ray.get(actor.settle.remote(pos.settle(ray.get(actor.unit_rows.remote(
        list(pos.partial))))))
    assert sum(pos.rows_per_pass.values()) == 192
    pos.trained(consume(second_name, "t2", pos.state_dict(), 0))
    pos.merge(pos.take_pending())
    assert pos.duplicates == 0 and dict(pos.rows_per_pass) == {0: 384, 1: 384}
    pos.settle(ray.get(report_actor(second_name).unit_rows.remote(list(pos.partial))))
    assert pos.complete == [0, 1]


def test_a_caption_naming_one_class_twice_is_one_row_through_sampler_position_settle_and_resume(ray_local, demo_dir):
    """Some demo captions name one shape twice ("a large green diamond to the right of an orange diamond"): one
    (pair, class) row each (methods/tonics/ontology.py). The TOnICS sampler trains on part of the pass (object and root
    batches; rows left in its buckets are untrained at the "checkpoint"), a resumed read trains on the rest: every
    row once, none a duplicate, the shards settled and the pass complete. With a row per noun the two rows of such a
    pair share one (row, object) key: a false duplicate, a shard that never settles."""
    import tarfile

    import ray

    from rayvl import assets
    from rayvl.data import shards
    from rayvl.data.demo import SHAPES
    from rayvl.methods.tonics.ontology import Ontology
    from rayvl.methods.tonics.rows import Objects
    from rayvl.data.report import create_report, report_actor
    from rayvl.data.text import validate_caption
    from rayvl.methods.tonics.sampler import BucketSampler

    ontology = Ontology.build(SHAPES)
    expected, repeated = 0, 0
    for path in sorted((demo_dir / "train").glob("*.tar")):
        with tarfile.open(path) as tar:
            for m in (m for m in tar.getmembers() if m.name.endswith(".txt")):
                text, _ = validate_caption(tar.extractfile(m).read())
                classes = [ontology.noun_class(w) for w in ontology.nouns(text)]
                classes = [c for c in classes if c is not None]
                repeated += len(classes) > len(set(classes))
                expected += max(1, len(set(classes)))
    assert repeated >= 20  # the case is common in the demo, not a corner of it

    def consume(name, token, position, limit):
        ray.get(create_report(name).restore.remote(token, position, 3))
        ds = shards.read_shards(str(demo_dir / "train"), Rows(image_size=16, crop_scale_min=0.5, train=True, seed=3,
                                tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8,
                                transforms=(Objects(ontology),)),
                                Reading(read_cpus=0.5, batch_size=32, shuffle=True, report_name=name,
                                        passes=1, seed=3, positioned=True), columns=["row", "object"])
        sampler = BucketSampler(iter(ds.iter_batches(batch_size=16, batch_format="numpy")), ["row", "object"], 8,
                                buffer_rows=48, max_wait_rows=32, seed=0, rank=0)
        got = []
        try:
            for step in range(1, 10_000):
                if limit and 8 * len(got) >= limit:
                    return np.concatenate(got)
                b = sampler.batch(1 + step % len(SHAPES) if step % 2 else 0, step)  # object and root batches
                got.append(np.stack([b["row"], b["object"]], 1))
        except StopIteration:  # the stream's end: what the buckets hold is trained too
            rest = [r for bucket in sampler.buckets.values() for r in bucket]
            return np.concatenate(got + [np.array(rest, dtype=np.int64).reshape(-1, 2)])

    first_name, second_name = (f"position-test-{uuid.uuid4().hex[:6]}" for _ in range(2))
    pos = DataPosition(n_shards=3)
    pos.merge(consume(first_name, "t1", None, 96))
    actor = report_actor(first_name)
    pos.report, pos.execution = ray.get(actor.settle.remote(pos.settle(ray.get(actor.unit_rows.remote(
        list(pos.partial))))))
    assert pos.duplicates == 0 and sum(pos.rows_per_pass.values()) == 96
    pos.merge(consume(second_name, "t2", pos.state_dict(), 0))
    assert pos.duplicates == 0 and dict(pos.rows_per_pass) == {0: expected}
    pos.settle(ray.get(report_actor(second_name).unit_rows.remote(list(pos.partial))))
    assert pos.complete == [0] and not pos.partial


def test_a_checkpoint_taken_as_the_next_execution_starts_resumes_the_rows_still_queued(ray_local, demo_dir):
    """batches.epochs calls begin(k) as soon as Ray Data execution k − 1's reads end, while its last batch still
    waits in the prefetch queue. A checkpoint in that window — held open here: begin waits until it is taken —
    resumes in execution k − 1, whose finished shards are skipped and whose queued rows are read again; saving k
    would lose them. Passes 0 and 1 (one pass per execution) each have their 384 rows exactly once."""
    import threading

    import ray

    from rayvl import assets
    from rayvl.config import load_config
    from rayvl.data import shards
    from rayvl.data.report import create_report, report_actor
    from rayvl.train.batches import batch_stream

    cfg = load_config(None, ["train.micro_batch_size=16", "data.prefetch_batches=2"])

    def stream(name, token, position, begin):
        ray.get(report_actor(name).restore.remote(token, position, 3))
        ds = shards.read_shards(str(demo_dir / "train"), Rows(image_size=16, crop_scale_min=0.5, train=True, seed=5,
                                tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8),
                                Reading(read_cpus=0.5, batch_size=32, shuffle=True, report_name=name,
                                        passes=1, seed=5, positioned=True), columns=["row"])
        return batch_stream(ds, cfg, begin=begin)

    first_name, second_name = (f"position-test-{uuid.uuid4().hex[:6]}" for _ in range(2))
    actor, in_window, taken = create_report(first_name), threading.Event(), threading.Event()

    def begin(k):  # what train/loop.py passes, then the window held open
        ray.get(actor.begin_execution.remote(k))
        in_window.set()
        taken.wait(120)

    pos, first = DataPosition(n_shards=3), stream(first_name, "t1", None, begin)
    for _ in range(23):  # of the pass's 24 batches
        pos.trained(next(first)[0]["row"].numpy())
    assert in_window.wait(120)  # execution 1 has begun; the 24th batch of execution 0 is queued, untrained
    pos.merge(pos.take_pending())
    pos.report, pos.execution = ray.get(actor.settle.remote(
        pos.settle(ray.get(actor.unit_rows.remote(list(pos.partial)))), pos.open_pass()))
    taken.set()
    assert pos.execution == 0 and dict(pos.rows_per_pass) == {0: 368}
    saved = pos.state_dict()

    second = create_report(second_name)
    resumed = stream(second_name, "t2", saved,
                     lambda k: ray.get(second.begin_execution.remote(saved["execution"] + k)))
    for _ in range(1 + 24):  # the queued batch, then execution 1's pass
        pos.trained(next(resumed)[0]["row"].numpy())
    pos.merge(pos.take_pending())
    assert pos.duplicates == 0 and dict(pos.rows_per_pass) == {0: 384, 1: 384}
    pos.settle(ray.get(second.unit_rows.remote(list(pos.partial))))
    assert pos.complete == [0, 1]


def test_a_shard_that_produced_no_row_is_finished_once_read(ray_local):
    """Every sample of shard 1 was dropped: no row of it is ever trained on, so only its end settles it (else its
    pass is never complete, and a resume would read it again and again)."""
    import ray

    from rayvl.data.report import create_report

    name = f"position-test-{uuid.uuid4().hex[:6]}"
    actor = create_report(name)
    ray.get(actor.restore.remote("t", None, 2))
    ray.get(actor.add.remote({"samples_seen": 5, "samples_kept": 5}, None, ("t", "a", 0, 0, 5)))
    ray.get(actor.add.remote({"samples_seen": 4, "dropped_corrupt_image": 4}, None, ("t", "b", 0, 1, 0)))
    pos = DataPosition(n_shards=2)
    pos.merge(np.stack([row_ids(0, 0, 0, 5), np.full(5, -1)], 1))
    done = pos.settle(ray.get(actor.unit_rows.remote(list(pos.partial))))
    assert sorted(done) == [(0, 0), (0, 1)] and pos.complete == [0]
    report, _ = ray.get(actor.settle.remote(done))
    assert report["counts"] == {"samples_seen": 9, "samples_kept": 5, "dropped_corrupt_image": 4}


def test_a_stream_without_position_counts_the_reads_of_its_current_worker_group(ray_local):
    """Image-label data has no position: a new worker group reads it again from its start, so its counts start
    again, and a read of the lost group still running counts for nothing."""
    import ray

    from rayvl.data.report import create_report, current_token, record, snapshot

    name = f"labels-test-{uuid.uuid4().hex[:6]}"
    actor = create_report(name)
    ray.get(actor.restore.remote("group-1", None, 0))
    old = current_token(name)
    record(name, {"samples_seen": 10, "samples_kept": 8}, token=old)
    ray.get(actor.restore.remote("group-2", None, 0))
    ray.get(actor.restore.remote("group-2", None, 0))  # every rank may call it: once per group
    record(name, {"samples_seen": 5}, token=old)  # started before the restart
    record(name, {"samples_seen": 3, "samples_kept": 3}, token=current_token(name))
    assert snapshot(name)["counts"] == {"samples_seen": 3, "samples_kept": 3}


# ----------------------------------------------------------------------------- runs (position.RowSet)

def _random_rows(rng, n_shards: int, rows_per_shard: int, objects: list[int], n: int) -> np.ndarray:
    """(row id, object) pairs as a rank records them: runs of consecutive rows (the blocks Ray hands out), loose
    rows (a shuffle buffer's edge) and rows again (repeats), over two passes; rows at the very end of a shard's id
    range sit next to the next shard's first ids, which must not join them."""
    out = []
    while sum(map(len, out)) < n:
        p, s = int(rng.integers(2)), int(rng.integers(n_shards))
        first = int(rng.integers(rows_per_shard))
        ids = row_ids(p, s, first, int(rng.integers(1, min(24, rows_per_shard - first) + 1)))
        if rng.random() < 0.3:
            ids = rng.choice(ids, size=max(1, len(ids) // 3))
        out.append(np.stack([ids, rng.choice(objects, size=len(ids))], 1))
    edge = (1 << 20) - 1  # the last possible row of shard 0 and the first of shard 1
    out.append(np.array([[row_ids(0, 0, edge, 1)[0], -1], [row_ids(0, 1, 0, 1)[0], -1]]))
    return np.concatenate(out)


@pytest.mark.parametrize("objects", [[-1], [-1, 0, 3, 70_000]], ids=["plain", "tonics"])
def test_runs_hold_exactly_the_set_of_pairs_with_repeats_counted(objects):
    rng = np.random.default_rng(0)
    parts = [_random_rows(rng, 6, 64, objects, 500) for _ in range(4)]
    sets = [RowSet.of(p[:, 0], p[:, 1]) for p in parts]
    for p, s in zip(parts, sets):
        distinct = {tuple(x) for x in p.tolist()}
        assert sorted(distinct) == sorted(map(tuple, s.pairs().tolist())) and len(s) == len(distinct)
        assert s.repeats == len(p) - len(distinct)
    everything = np.concatenate(parts)
    union = RowSet.union(sets)
    assert {tuple(x) for x in union.pairs().tolist()} == {tuple(x) for x in everything.tolist()}
    assert union.repeats == len(everything) - len(union)
    some = set(np.unique(union.spans[:, 0])[::2].tolist())  # the rows of every other unit, found by unit
    assert {tuple(x) for x in union.only(some).pairs().tolist()} == {
        tuple(x) for x in everything.tolist() if x[0] >> 20 in some}
    # runs are maximal: two runs of a unit never touch, and a shard's last id never joins the next shard's first
    unit, first, end = union.spans.T
    same = unit[1:] == unit[:-1]
    assert (first[1:][same] > end[:-1][same]).all() and (end > first).all()


class _SetPosition:
    """The reference: the data position as plain Python sets of (row id, object) pairs."""

    def __init__(self, n_shards):
        self.n_shards, self.partial, self.finished, self.complete = n_shards, {}, {}, []
        self.duplicates, self.rows_per_pass = 0, {}

    def merge(self, pairs):
        for row, obj in pairs.tolist():
            p, s = int(row >> 47), int((row >> 20) & ((1 << 27) - 1))
            held = self.partial.setdefault((p, s), set())
            if p in self.complete or s in self.finished.get(p, ()) or (row, obj) in held:
                self.duplicates += 1
            else:
                held.add((row, obj))
                self.rows_per_pass[p] = self.rows_per_pass.get(p, 0) + 1
        self.partial = {u: rows for u, rows in self.partial.items() if rows}

    def settle(self, totals):
        for u in [u for u, rows in self.partial.items() if u in totals and len(rows) >= totals[u]]:
            self.finished.setdefault(u[0], []).append(u[1])
            del self.partial[u]
        for p in [p for p, shards in self.finished.items() if len(shards) == self.n_shards]:
            del self.finished[p]
            self.complete.append(p)


@pytest.mark.parametrize("objects", [[-1], [-1, 0, 3]], ids=["plain", "tonics"])
def test_merge_settle_plan_and_restore_match_a_set_reference_checkpoint_after_checkpoint(objects):
    """Three ranks' rows (runs, loose rows, repeats across and within ranks, TOnICS pairs) merged over six
    checkpoints; every (pass, shard) produces 64 rows per object, so shards finish and pass 0 completes on the way."""
    rng, n_shards = np.random.default_rng(1), 3
    pos, ref = DataPosition(n_shards), _SetPosition(n_shards)
    totals = {(p, s): 64 * len(objects) for p in range(2) for s in range(n_shards)}
    for checkpoint in range(6):
        parts = [_random_rows(rng, n_shards, 64, objects, 150 * (checkpoint + 1)) for _ in range(3)]
        parts = [p[(p[:, 0] & ((1 << 20) - 1)) < 64] for p in parts]  # the shard-edge rows are not in this set
        if checkpoint == 5:  # the last one trains everything not trained yet: pass 0 and pass 1 complete
            parts.append(np.concatenate([np.stack([row_ids(p, s, 0, 64), np.full(64, o)], 1)
                                         for p in range(2) for s in range(n_shards) for o in objects]))
        pos.trained(parts[0][:, 0], parts[0][:, 1])
        touched = pos.merge(pos.take_trained(), *parts[1:])
        ref.merge(np.concatenate(parts))
        assert set(touched) <= set(ref.partial) | {(p, s) for p, shards in ref.finished.items() for s in shards} \
            | {(p, s) for p in ref.complete for s in range(n_shards)}
        assert pos.settle(totals) is not None
        ref.settle(totals)
        assert pos.partial == {u: len(rows) for u, rows in ref.partial.items()}
        assert pos.finished == ref.finished and pos.complete == ref.complete
        assert pos.duplicates == ref.duplicates and dict(pos.rows_per_pass) == ref.rows_per_pass
        for p in range(2):
            skip, trained = pos.left_out(p, [0, 2])
            assert trained == {s: ref.partial[(p, s)] for s in (0, 2) if (p, s) in ref.partial}
            assert skip == ({0, 2} if p in ref.complete else set(ref.finished.get(p, ())) & {0, 2})
        buf = io.BytesIO()
        torch.save(pos.state_dict(), buf)
        back = DataPosition(n_shards)
        back.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        assert back.partial == pos.partial and back.summary() == pos.summary()
        assert back.left_out(1, [1]) == pos.left_out(1, [1])
    assert sorted(pos.complete) == [0, 1] and pos.partial == {}


def test_a_checkpoint_written_before_runs_loads():
    """Checkpoints written before position.RowSet hold each partial unit's sorted (row id, object) pairs."""
    a, b = row_ids(0, 1, 0, 5), row_ids(1, 0, 7, 2)
    old = {"n_shards": 2, "complete": [], "finished": {0: [0]}, "rows_per_pass": {0: 7, 1: 3}, "duplicates": 1,
           "execution": 0, "report": {"counts": {}, "bad_shards": {}},
           "partial": {(0, 1): torch.from_numpy(np.stack([a, np.full(5, -1)], 1)),
                       (1, 0): torch.from_numpy(np.array([[b[0], -1], [b[1], 4], [b[1], 9]]))}}
    pos = DataPosition(n_shards=2)
    pos.load_state_dict(old)
    assert pos.partial == {(0, 1): 5, (1, 0): 3} and pos.finished == {0: [0]}
    assert pos.left_out(1, [0]) == (set(), {0: {(int(b[0]), -1), (int(b[1]), 4), (int(b[1]), 9)}})
    assert pos.merge(np.array([[a[0], -1], [b[1], 4], [b[1], 5]])) == [(0, 1), (1, 0)]
    assert pos.duplicates == 3 and pos.rows_per_pass == {0: 7, 1: 4}


def test_the_data_report_forgets_a_shards_row_count_once_it_is_settled():
    """The actor's per-shard row counts stay bounded by the shards in flight, not by every shard of every pass."""
    from rayvl.data.report import DataReport

    report = DataReport.__ray_actor_class__()  # the actor's class itself: its bookkeeping, without Ray
    report.restore("t", None, 2)
    report.add({"samples_seen": 3}, unit=("t", "a", 0, 1, 3))
    assert report.unit_rows([(0, 1), (0, 0)]) == {(0, 1): 3}
    counts, _ = report.settle([(0, 1)])
    assert report.rows == {} and report.units == {} and counts["counts"] == {"samples_seen": 3}
