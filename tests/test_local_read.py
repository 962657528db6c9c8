"""A local DataLoader reads shards as Ray Data's read tasks do (rayvl.eval.local_read): the same rows kept, the same
samples dropped and counted, the same damaged shard named — whether its workers split the shards or, with fewer
shards than workers, the batches of one shard."""
from collections import Counter

import numpy as np
import pytest
import ray

from rayvl import assets
from rayvl.data import shards
from rayvl.data.pipeline import Rows
from rayvl.data.report import DataPlaneError, create_report, release_reports
from rayvl.data.shard_io import ReadPolicy
from rayvl.data.shards import Reading
from rayvl.data.specs import resolve_shards
from rayvl.eval import local_read
from rayvl.eval.local_read import share
from test_shards import bad_shard  # noqa: F401 (the fixture: 11 samples, 5 of them bad in 5 ways)


def test_every_batch_of_every_shard_has_one_reader():
    """``share``: whole shards while there are enough of them, else the workers of a shard take turns by batch —
    every (shard, batch) read by exactly one worker, and no worker idle while a shard has fewer readers."""
    for n_shards in range(1, 9):
        for workers in range(1, 9):
            read = Counter()
            for w in range(workers):
                for shard, part, parts in share(n_shards, w, workers):
                    read.update((shard, b) for b in range(24) if b % parts == part)
            assert read == Counter({(s, b): 1 for s in range(n_shards) for b in range(24)}), (n_shards, workers)
            assert all(share(n_shards, w, workers) for w in range(workers)), (n_shards, workers)
    # shards on object storage are not split (each reader would fetch the whole shard): one reader each
    assert [share(2, w, 5, split=False) for w in range(5)] == [[(0, 0, 1)], [(1, 0, 1)], [], [], []]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 5 worker processes")  # 5 on purpose, on 2 CPUs
def test_a_local_loader_keeps_drops_and_counts_as_ray_data_reads(ray_local, bad_shard, demo_dir):  # noqa: F811
    """Three shards — 11 samples of which 5 are bad in 5 ways, a demo shard cut inside a member, an intact one —
    read by Ray Data's read tasks and by a local loader of 1, 2 and 5 workers (5: fewer shards than workers, so
    readers share a shard's batches): the same keys, the same centre-cropped images and tokens, the same counts,
    the same damaged shard named."""
    whole = (demo_dir / "train" / "00002.tar").read_bytes()  # keys 00002…, apart from bad_shard's 00000000…
    (bad_shard / "00001.tar").write_bytes(whole[: len(whole) // 2 + 777])
    (bad_shard / "00002.tar").write_bytes((demo_dir / "train" / "00001.tar").read_bytes())
    paths = resolve_shards(str(bad_shard))
    rows = Rows(image_size=32, crop_scale_min=0.5, train=False, max_tokens=16,
                tokenizer_path=str(assets.text_model_path("minilm-l6")))
    columns = ["key", "image", "input_ids", "cls"]
    name = "test-local-read-report"
    report = create_report(name)
    try:
        reading = Reading(read_cpus=0.5, batch_size=4, report_name=name)
        by_ray = {r["key"]: r for r in shards.read_shards(paths, rows, reading, columns).take_all()}
        snap = ray.get(report.snapshot.remote())
    finally:
        release_reports([name])
    assert snap["counts"]["truncated_shards"] == 1 and snap["counts"]["dropped_corrupt_image"] == 1

    for workers in (1, 2, 5):
        batches = local_read.shard_batches(paths, rows, Reading(batch_size=4, threads=2), columns, workers)
        seen = {}
        for batch in batches:
            for i, key in enumerate(batch["key"]):
                assert key not in seen, f"{key} read twice ({workers} workers)"
                seen[key] = {c: batch[c][i] for c in columns}
        assert seen.keys() == by_ray.keys(), workers
        for key, row in seen.items():
            assert np.array_equal(row["image"], by_ray[key]["image"]), (workers, key)
            assert np.array_equal(row["input_ids"], by_ray[key]["input_ids"]) and row["cls"] == by_ray[key]["cls"]
        assert dict(+batches.counts) == snap["counts"], workers
        assert batches.bad_shards == snap["bad_shards"], workers


def test_a_shard_that_cannot_be_read_fails_the_read_naming_it_or_is_skipped_and_counted(tmp_path):
    """An I/O failure in a loader worker reaches the caller as the DataPlaneError Ray's read names (not a worker's
    traceback text); under data.unreadable_shards=skip the shard is counted as unreadable and the rest is read."""
    (tmp_path / "00000.tar").write_bytes(b"")
    missing = str(tmp_path / "gone.tar")
    rows = Rows(image_size=32, crop_scale_min=0.5, train=False, max_tokens=16,
                tokenizer_path=str(assets.text_model_path("minilm-l6")))
    fail = Reading(batch_size=4, io=ReadPolicy(retries=0, wait_s=0.0))
    with pytest.raises(DataPlaneError, match=r"shard .*gone\.tar cannot be read: it does not exist"):
        list(local_read.shard_batches([str(tmp_path / "00000.tar"), missing], rows, fail, ["key"], 1))
    # the workers start as the iteration does, before a batch is asked for: the model loads while they read
    import multiprocessing

    started = iter(local_read.shard_batches([str(tmp_path / "00000.tar")], rows, fail, ["key"], 2))
    assert len(multiprocessing.active_children()) >= 2 and list(started) == []
    skip = Reading(batch_size=4, io=ReadPolicy(retries=0, wait_s=0.0, unreadable="skip"))
    batches = local_read.shard_batches([missing], rows, skip, ["key"], 1)
    assert list(batches) == [] and batches.counts == Counter({"unreadable_shards": 1})
    assert list(batches.bad_shards) == [missing]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 5 worker processes")
def test_the_aligned_sets_word_statistics_and_caption_pool_read_here_are_ray_datas(ray_local, demo_dir):
    """`rayvl pseudo-label` without Ray reads S_a twice with local loaders: its BoW word statistics (a local
    ``sum_over_shards``) and its caption pool — the same sums and the same (key, caption) pairs as Ray Data's reads,
    with 1 worker and with more workers than shards (3)."""
    from rayvl.data.shards import sum_over_shards
    from rayvl.methods.bow import deformation as bow
    from rayvl.methods.bow.pseudo_label import read_pool

    paths = resolve_shards(str(demo_dir / "train"))
    kwargs = {"seed": 0, "fraction": 0.5}
    by_ray = sum_over_shards(paths, ("key", "txt", "json"), bow.base_word_counts, kwargs, "word", "df")
    assert by_ray[bow.ALL_CAPTIONS] == 384 and 0 < by_ray[bow.BASE_CAPTIONS] < 384
    pool = read_pool(str(demo_dir / "train"), 0.5)
    assert len(pool[0]) == 384 and pool[0] == sorted(pool[0])
    for workers in (1, 5):
        here = local_read.sum_over_shards(paths, ("key", "txt", "json"), bow.base_word_counts, kwargs, "word", "df",
                                          workers=workers)
        assert here == by_ray, workers
    assert read_pool(str(demo_dir / "train"), 0.5, here=5) == pool


def test_one_model_on_a_machine_of_its_own_runs_without_ray(monkeypatch):
    """session.runs_without_ray: no cluster named and one model — one actor on CPU, or a machine's only GPU; a
    cluster (RAY_ADDRESS or the config's address), a Ray running in the process, several actors or more than one
    GPU an actor keep Ray."""
    import torch

    from rayvl.session import runs_without_ray

    here = not ray.is_initialized()  # the session's Ray, when an earlier test started it, is a Ray in this process
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert runs_without_ray(0, 0.0) == here and runs_without_ray(1, 0.0) == here
    assert runs_without_ray(1, 1.0) == (here and torch.cuda.is_available() and torch.cuda.device_count() == 1)
    assert not any((runs_without_ray(2, 0.0), runs_without_ray(1, 2.0), runs_without_ray(0, 0.0, "ray://head:10001")))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert not runs_without_ray(0, 0.0) and not runs_without_ray(1, 0.0)
