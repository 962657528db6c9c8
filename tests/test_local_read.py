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


def test_a_batchs_images_cross_from_a_loader_worker_in_shared_memory(demo_dir):
    """A large numeric column (SHARED_BYTES: a batch of 128 images at 224 px, 19 MB) leaves a loader worker as a
    tensor in shared memory — not pickled through its pipe and unpickled by the main process — and arrives as a
    numpy view of it; keys, captions and small columns stay numpy. The rows are the same either way."""
    import torch

    crossing = local_read._shared({"image": np.zeros((128, 3, 224, 224), np.uint8), "key": np.array(["k"] * 128),
                                   "cls": np.zeros(128, np.int64)})
    assert isinstance(crossing["image"], torch.Tensor) and crossing["image"].dtype == torch.uint8
    assert all(isinstance(crossing[c], np.ndarray) for c in ("key", "cls"))
    arrived = local_read._as_numpy(crossing)
    assert isinstance(arrived["image"], np.ndarray) and np.shares_memory(arrived["image"], crossing["image"].numpy())
    # where the shared memory could not hold the batches in flight (a container's 64 MB), every column is pickled
    assert local_read.shared_bytes_here() == local_read.SHARED_BYTES  # this machine's /dev/shm
    assert local_read.shared_bytes_here(shm=str(demo_dir / "no-such-folder")) == local_read.NEVER_SHARED

    paths = resolve_shards(str(demo_dir / "eval"))
    rows = Rows(image_size=32, crop_scale_min=0.5, train=False, max_tokens=16,
                tokenizer_path=str(assets.text_model_path("minilm-l6")))

    def read(shared_bytes: int) -> tuple[dict, list]:
        batches = local_read.shard_batches(paths, rows, Reading(batch_size=16), ["key", "image", "cls"], 2)
        batches.shared_bytes = shared_bytes
        seen = list(batches)
        return {k: (img.tobytes(), c) for b in seen for k, img, c in zip(b["key"], b["image"], b["cls"])}, seen

    pickled, before = read(local_read.SHARED_BYTES)
    shared, after = read(1024)
    assert len(shared) == 64 and shared == pickled
    assert not any(isinstance(b["image"].base, torch.Tensor) for b in before)
    assert all(b["image"].base.is_shared() for b in after)  # 16 images of 32 px: 48 KB a batch
    assert all(b["key"].dtype.kind in "OU" and not isinstance(b["key"].base, torch.Tensor) for b in after)


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


@pytest.mark.slow
def test_an_evaluation_copies_its_image_embeddings_back_once(monkeypatch, demo_dir, tmp_path):
    """`rayvl eval` without Ray (LocalEmbedder), and each embedding actor on Ray (its ``images`` call a Ray Data
    block, then ``collect``), keeps each batch's image embeddings on the model's device and copies them to the host
    once (once every DEVICE_EMBEDDINGS_BYTES): on a GPU each copy waits for the device, and a copy a batch kept the
    process from queueing the next batch while the GPU ran one. Counted here on CPU tensors: the same code. The
    embeddings, in key order, are those embedded batch by batch."""
    from collections import Counter

    import torch
    from ray.data.block import BlockAccessor

    from conftest import untrained_checkpoint
    from rayvl.eval import embed

    paths = resolve_shards(str(demo_dir / "eval"))
    rows = Rows(image_size=32, crop_scale_min=0.5, train=False, max_tokens=16,
                tokenizer_path=str(assets.text_model_path("minilm-l6")))
    local = embed.LocalEmbedder(untrained_checkpoint(demo_dir, tmp_path), batch_size=16)

    def batches():
        return local_read.shard_batches(paths, rows, Reading(batch_size=16), ["key", "image"], 1)

    by_batch, by_batch_rows = embed.in_order([local.model().embed(b) for b in batches()])
    read_back = Counter()
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **kw: read_back.update(["cpu"]) or cpu(t, *a, **kw))
    once = local.images(batches())
    assert read_back["cpu"] == 1 and len(once) == 64
    assert np.array_equal(once, by_batch) and list(local.rows["key"]) == list(by_batch_rows["key"])
    actor = local.model()  # an actor's calls, on the blocks Ray Data would hand it
    read_back.clear()
    blocks = [BlockAccessor.batch_to_block({**b, "cls": np.arange(len(b["key"]))}) for b in batches()]
    assert [actor.images(block) for block in blocks] == [16] * 4
    assert read_back["cpu"] == 0 and len(actor.held) == 4
    # what it holds is its own (a view of a block would keep the block, images and all, in Ray's object store)
    assert all(values.flags.owndata for _, columns in actor.held for values in columns.values())
    held, dropped = actor.collect()
    collected, collected_rows = embed.in_order(held)
    assert read_back["cpu"] == 1 and not actor.held and not dropped and actor.collect() == ([], {})
    actor.images(BlockAccessor.batch_to_block(dict(next(iter(batches())))))
    actor.drop()  # a pass that failed half-way: nothing of it in the next
    assert actor.collect() == ([], {})
    assert np.array_equal(collected, by_batch) and list(collected_rows["key"]) == list(by_batch_rows["key"])
    monkeypatch.setattr(embed, "DEVICE_EMBEDDINGS_BYTES", 16 * 64 * 4)  # one batch's 16 embeddings of 64 floats
    read_back.clear()
    assert np.array_equal(local.images(batches()), once) and read_back["cpu"] == 4
    # a batch whose every sample was dropped: no rows, float32, beside the others' as a batch embedded alone gives
    none, columns = local.model().on_device({"image": np.zeros((0, 3, 32, 32), np.uint8), "key": np.array([], object)})
    assert none.dtype == torch.float32 and none.shape == (0, 64) and len(columns["key"]) == 0
    first = next(iter(batches()))
    held = [local.model().on_device(dict(first)), (none, columns)]
    together = embed.copied_back(held)
    assert [len(p["embedding"]) for p in together] == [16, 0] and together[1]["embedding"].dtype == np.float32
    assert np.array_equal(together[0]["embedding"], local.model().embed(first)["embedding"])


def test_ray_datas_readers_of_one_shard_take_turns_by_batch(ray_local, bad_shard, demo_dir):  # noqa: F811
    """A held-out set of fewer shards than its CPUs is read by several read tasks a shard (``readers_per_shard``),
    each transforming every n-th batch: the same rows as one reader a shard, none read twice, the same counts, the
    damaged shard counted and named once. How many readers: as many as fill the CPUs, files only."""
    from rayvl.data.shard_read import readers_per_shard

    whole = (demo_dir / "train" / "00002.tar").read_bytes()
    (bad_shard / "00001.tar").write_bytes(whole[: len(whole) // 2 + 777])
    paths = resolve_shards(str(bad_shard))
    rows = Rows(image_size=32, crop_scale_min=0.5, train=False, max_tokens=16,
                tokenizer_path=str(assets.text_model_path("minilm-l6")))
    read = {}
    for readers in (1, 3):
        name = f"test-readers-{readers}"
        report = create_report(name)
        try:
            reading = Reading(read_cpus=0.5, batch_size=4, report_name=name, readers_per_shard=readers)
            keys = [r["key"] for r in shards.read_shards(paths, rows, reading, ["key", "image"]).take_all()]
            read[readers] = (Counter(keys), ray.get(report.snapshot.remote()))
            assert len(shards.ShardStream(paths, reading).get_read_tasks(0)) == 2 * readers
        finally:
            release_reports([name])
    (one, one_report), (three, three_report) = read[1], read[3]
    assert max(three.values()) == 1 and three == one and sum(one.values()) > 50
    assert three_report["counts"] == one_report["counts"] and three_report["counts"]["truncated_shards"] == 1
    assert three_report["bad_shards"] == one_report["bad_shards"]
    assert readers_per_shard(paths, 0.5, 16) == 8 and readers_per_shard(paths, 0.5, 2) == 2
    assert readers_per_shard(paths * 10, 0.5, 16) == 1
    assert readers_per_shard(["s3://b/0.tar"], 0.5, 16) == readers_per_shard(["pipe:cat 0.tar"], 0.5, 16) == 1
    with pytest.raises(ValueError, match="one pass"):
        shards.ShardStream(paths, Reading(readers_per_shard=2, passes=2))
