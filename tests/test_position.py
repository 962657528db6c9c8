"""The data position (rayvl.data.position): row ids, what rank 0 merges and settles at a checkpoint, and a read that
resumes from it — finished shards skipped, rows already trained on dropped, the data report continued exactly."""
import io
import uuid

import numpy as np
import pytest
import torch

from rayvl.data.position import DataPosition, row_ids, unit_of


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
    assert pos.plan(0, [0, 1]) == ({0}, {1: {(int(i), -1) for i in b}})
    # a row trained on again (a restarted stream would do this) is a duplicate, never a new row
    pos.merge(np.stack([np.concatenate([a[:1], b[:1]]), [-1, -1]], 1))
    assert pos.duplicates == 2 and pos.rows_per_pass[0] == 7
    # TOnICS: one sample, two aligned nouns → two rows
    pos.merge(np.array([[b[2], 5], [b[2], 7]]))
    assert pos.settle({(0, 1): 4}) == [(0, 1)] and pos.complete == [0] and pos.finished == {}
    assert pos.plan(0, [0, 1]) == ({0, 1}, {}) and pos.plan(1, [0]) == (set(), {})

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
    from rayvl.data.report import report_actor, snapshot

    def read(name):
        ds = shards.read_shards(str(demo_dir / "train"), image_size=16, crop_scale_min=0.5, train=True,
                                tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8,
                                read_cpus=0.5, transform_batch_size=32, shuffle_files=True, report_name=name,
                                columns=["row", "key"], passes=1, seed=1, positioned=True)
        return {int(r["row"]): r["key"] for r in ds.take_all()}

    first_name, second_name = (f"position-test-{uuid.uuid4().hex[:6]}" for _ in range(2))
    report_actor(first_name)
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

    second = report_actor(second_name)
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
    from rayvl.data.report import report_actor

    def consume(name, token, position, limit):
        ray.get(report_actor(name).restore.remote(token, position, 3))
        ds = shards.read_shards(str(demo_dir / "train"), image_size=16, crop_scale_min=0.5, train=True,
                                tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8,
                                read_cpus=0.5, transform_batch_size=32, shuffle_files=True, report_name=name,
                                columns=["row", "image"], passes=2, seed=3, positioned=True)
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
