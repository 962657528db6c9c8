"""The per-worker batch stream fails with a clear error instead of hanging or spinning on empty epochs."""
import os
import time

import numpy as np
import pytest

from rayvl.config import load_config
from rayvl.data.report import DataPlaneError
from rayvl.train.batches import batch_stream


def _held(row, release: str):
    """A map task that produces nothing until ``release`` exists (a minute at most)."""
    deadline = time.time() + 60
    while not os.path.exists(release) and time.time() < deadline:
        time.sleep(0.1)
    return row


def test_starved_pipeline_raises_instead_of_hanging(ray_local, tmp_path):
    release = tmp_path / "release"
    ds = ray_local.data.range(4).map(_held, fn_kwargs={"release": str(release)})
    cfg = load_config(None, ["data.stall_timeout_s=3", "train.micro_batch_size=2"])
    started = time.time()
    try:
        with pytest.raises(DataPlaneError, match="data.stall_timeout_s"):
            next(batch_stream(ds.iterator(), cfg))
        assert time.time() - started < 30
    finally:  # the held tasks end now: each holds one of the session's CPUs, and the next tests' pipelines wait
        release.touch()


def test_epoch_without_a_full_batch_is_an_error(ray_local):
    rows = {"image": np.zeros((3, 3, 8, 8), np.uint8), "input_ids": np.zeros((3, 4), np.int64),
            "attention_mask": np.ones((3, 4), np.int64)}
    ds = ray_local.data.from_items([{k: v[i] for k, v in rows.items()} for i in range(3)])
    cfg = load_config(None, ["train.micro_batch_size=8", "data.local_shuffle_buffer=0"])
    with pytest.raises(DataPlaneError, match="no full batch"):
        next(batch_stream(ds.iterator(), cfg))


def test_batches_flow_across_epochs(ray_local):
    rows = [{"image": np.full((3, 8, 8), i, np.uint8), "input_ids": np.full(4, i, np.int64),
             "attention_mask": np.ones(4, np.int64), "label": -1} for i in range(6)]
    cfg = load_config(None, ["train.micro_batch_size=2", "data.local_shuffle_buffer=0"])
    stream = batch_stream(ray_local.data.from_items(rows).iterator(), cfg)
    seen = [next(stream)[0]["input_ids"][:, 0].tolist() for _ in range(6)]  # 2 epochs of 3 batches
    assert sorted(sum(seen[:3], [])) == sorted(sum(seen[3:], [])) == list(range(6))
