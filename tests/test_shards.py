"""The Ray Data reader drops bad samples and counts them; a truncated shard costs only its bad tail."""
import io
import tarfile
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
from PIL import Image

from rayvl import assets
from rayvl.data import shards
from rayvl.data.pipeline import Rows, preprocess_columns
from rayvl.data.shards import Reading
from rayvl.data.report import DataPlaneError, create_report, report_actor
from rayvl.data.specs import resolve_shards


def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _write(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, payload in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def _read(spec, report_name, train=True):
    ds = shards.read_shards(spec, Rows(image_size=32, crop_scale_min=0.5, train=train,
                                       tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=16),
                            Reading(read_cpus=0.5, batch_size=4, report_name=report_name,
                                    threads=2))  # 3 batches of 4, transformed side by side (data.read_threads)
    return ds.take_all()


@pytest.fixture
def bad_shard(tmp_path):
    good = lambda i: {"jpg": _jpeg(i), "txt": f"a photo number {i}".encode(), "json": b"{}"}  # noqa: E731
    samples = [(f"{i:09d}", good(i)) for i in range(6)]
    samples.append(("000000006", {"jpg": b"\xff\xd8\xff this is not a jpeg", "txt": b"corrupt", "json": b"{}"}))
    samples.append(("000000007", {"jpg": _jpeg(7), "txt": b"   \n", "json": b"{}"}))
    samples.append(("000000008", {"jpg": _jpeg(8), "txt": b"caf\xe9 latin-1", "json": b"{}"}))
    samples.append(("000000009", {"jpg": _jpeg(9), "json": b"{}"}))  # caption missing
    samples.append(("000000010", {"txt": b"no image", "json": b"{}"}))  # image missing
    _write(tmp_path / "00000.tar", samples)
    return tmp_path


def test_drop_counters(ray_local, bad_shard):
    name = "test-report-drops"
    report = create_report(name)
    rows = _read(str(bad_shard), name)
    assert sorted(r["key"] for r in rows) == [f"{i:09d}" for i in range(6)]
    assert rows[0]["image"].shape == (3, 32, 32) and rows[0]["image"].dtype == np.uint8
    assert rows[0]["input_ids"].shape == (16,) and rows[0]["input_ids"][0] == 101  # [CLS]
    counts = ray.get(report.snapshot.remote())["counts"]
    assert counts == {"samples_seen": 11, "samples_kept": 6, "dropped_corrupt_image": 1,
                      "dropped_empty_caption": 1, "dropped_non_utf8_caption": 1, "dropped_missing_caption": 1,
                      "dropped_missing_image": 1, "caption_words": 6 * 4,  # "a photo number {i}" kept 6 times
                      "format_jpg": 10}  # the image members read: all but the missing one


def test_truncated_shard_costs_only_its_tail(ray_local, demo_dir, tmp_path):
    whole = (demo_dir / "train" / "00000.tar").read_bytes()
    (tmp_path / "00000.tar").write_bytes(whole[: len(whole) // 2 + 777])  # cut inside a member
    (tmp_path / "00001.tar").write_bytes((demo_dir / "train" / "00001.tar").read_bytes())
    # cut where a member's header starts (a copy that stopped between members): tarfile's stream reads the missing
    # header as the archive's end; rayvl finds no end-of-archive blocks there and counts the shard
    with tarfile.open(demo_dir / "train" / "00002.tar") as tar:
        boundary = [m.offset for m in tar.getmembers()][90]  # 30 whole samples of jpg, json, txt before it
    (tmp_path / "00002.tar").write_bytes((demo_dir / "train" / "00002.tar").read_bytes()[:boundary])
    name = "test-report-truncated"
    report = create_report(name)
    rows = _read(str(tmp_path), name)
    snap = ray.get(report.snapshot.remote())
    keys = {r["key"] for r in rows}
    assert {f"00001{i:04d}" for i in range(128)} <= keys  # the intact shard is read completely
    from_cut = sorted(k for k in keys if k.startswith("00000"))
    assert 55 <= len(from_cut) < 128 and from_cut == [f"00000{i:04d}" for i in range(len(from_cut))]
    assert sorted(k for k in keys if k.startswith("00002")) == [f"00002{i:04d}" for i in range(30)]
    (path, why), (at_header, ended) = sorted(snap["bad_shards"].items())
    assert path.endswith("00000.tar") and "after" in why
    assert at_header.endswith("00002.tar") and f"no end-of-archive blocks at byte {boundary:,}" in ended
    assert snap["counts"]["samples_kept"] == len(rows) and snap["counts"]["truncated_shards"] == 2


def test_eval_rows_carry_class_and_center_crop(ray_local, demo_dir):
    rows = _read(str(demo_dir / "eval"), None, train=False)
    assert len(rows) == 64
    again = {r["key"]: r["image"] for r in _read(str(demo_dir / "eval"), None, train=False)}
    assert all(np.array_equal(r["image"], again[r["key"]]) for r in rows)  # deterministic centre crop
    listed = pq.read_table(demo_dir / "eval" / "00000.parquet")  # img2dataset's metadata of the same shard
    assert {r["key"] for r in rows} == set(listed["key"].to_pylist())
    assert all(r["cls"] >= 0 for r in rows)


def test_missing_shards_is_a_clear_error(tmp_path):
    with pytest.raises(DataPlaneError, match="nothing-here' does not exist"):
        resolve_shards(str(tmp_path / "nothing-here"))


def test_passes_stream_in_one_fused_operator(ray_local, demo_dir):
    """A training dataset lists every pass in one Ray Data execution: each pass reads every sample exactly once,
    in its own shard order drawn from (seed, pass), and the whole plan is one read operator — no separate
    map/Project operators and no SplitBlocks (each would copy every row through the object store again)."""
    spec = str(demo_dir / "train")
    paths = resolve_shards(spec)
    ds = shards.read_shards(spec, Rows(image_size=16, crop_scale_min=0.5, train=True, seed=5,
                                       tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8),
                            Reading(read_cpus=0.5, batch_size=32, shuffle=True, seed=5, passes=3),
                            columns=["image", "key"])
    rows = ds.take_all()
    assert set(rows[0]) == {"image", "key"}
    keys = [r["key"] for r in rows]
    assert len(keys) == 3 * len(set(keys)) and all(keys.count(k) == 3 for k in set(keys))
    stats = ds.stats()
    assert "ReadShardStream:" in stats and "SplitBlocks" not in stats and "Project" not in stats
    assert f"{3 * len(paths)} tasks executed" in stats
    source = shards.ShardStream(paths, Reading(shuffle=True, seed=5))
    orders = [source.order(p) for p in range(3)]
    assert all(sorted(o) == list(range(len(paths))) for o in orders) and len({tuple(o) for o in orders}) > 1
    assert source.order(1) == shards.ShardStream(paths, Reading(shuffle=True, seed=5)).order(1)


def test_threaded_transform_keeps_order_rows_and_counts(bad_shard):
    """A read task transforming batches in threads emits what one thread does: the same rows in shard order, the
    same drop counts (centre crops, so images compare equal)."""
    from functools import partial

    def read(threads):
        source = shards.ShardStream(resolve_shards(str(bad_shard)), Reading(batch_size=2, threads=threads),
                                    transform=partial(preprocess_columns, columns=None, rows=Rows(
                                        image_size=32, crop_scale_min=0.5, train=False, max_tokens=16,
                                        tokenizer_path=str(assets.text_model_path("minilm-l6")))))
        bad: list = []
        out = list(source._transformed_ahead(0, 0, bad, Counter()))
        return [b for b, _ in out], sum((c for _, c in out), Counter())

    one, counts_one = read(1)
    three, counts_three = read(3)
    assert counts_three == counts_one and counts_one["samples_seen"] == 11 and counts_one["samples_kept"] == 6
    assert len(three) == len(one) == 6  # 11 samples in batches of 2
    for a, b in zip(one, three):
        assert list(a["key"]) == list(b["key"]) and np.array_equal(a["row"], b["row"])
        assert np.array_equal(a["image"], b["image"]) and np.array_equal(a["input_ids"], b["input_ids"])


def test_read_ahead_stops_near_what_training_takes(ray_local, tmp_path):
    """The training stream's object-store budget (datasets.read_ahead_bytes through trainer.ingest_options) holds
    Ray Data's decoding near the rows taken — with Ray's default budget the read tasks decode whole shards ahead — and
    reads stopped mid-shard count what they decoded."""
    import time

    from rayvl.config import RayvlConfig
    from rayvl.train.trainer import ingest_options

    sample = {"jpg": _jpeg(0), "txt": b"a photo", "json": b"{}"}
    for s in range(2):
        _write(tmp_path / f"{s:05d}.tar", [(f"{s}{i:08d}", sample) for i in range(2000)])
    rows = Rows(image_size=16, crop_scale_min=0.5, train=True, max_tokens=8,
                tokenizer_path=str(assets.text_model_path("minilm-l6")))
    name = "test-report-read-ahead"
    create_report(name)
    ds = shards.read_shards(str(tmp_path), rows, Reading(read_cpus=0.5, batch_size=16, report_name=name))
    taken, budget = 64, 64 * shards.row_bytes(rows)
    ds.context.execution_options = ingest_options(RayvlConfig(), {"train": ds}, budget)["train"]
    assert ds.context.execution_options.resource_limits.object_store_memory == budget
    batches = iter(ds.iter_batches(batch_size=16, prefetch_batches=0))
    got = sum(len(next(batches)["image"]) for _ in range(taken // 16))
    time.sleep(5)  # unbounded, the read tasks would decode both shards meanwhile
    batches.close()  # the run has what it needs: Ray Data stops its reads, each held mid-shard
    seen = ray.get(report_actor(name).snapshot.remote())["counts"]["samples_seen"]
    # counted as decoded (sent before each block); each running read task holds a few blocks of 16 rows ahead (its
    # generator's buffer, the budget's minimum) — not its 2,000-sample shard
    assert got == taken and taken < seen < 1000, seen


def test_fast_tokenizer_equals_transformers():
    """Read tasks tokenize with the model folder's tokenizer.json through HF tokenizers (no transformers import in
    a new worker process): ids and masks equal AutoTokenizer's padding="max_length", truncation=True."""
    from rayvl.data.text import fixed_length_tokenizer, load_tokenizer, tokenize

    path = str(assets.text_model_path("minilm-l6"))
    captions = ["a red circle", "Two DOGS on a beach, léft of the café!", "word " * 60, "日本語のキャプション",
                "  spaced   out  ", "don’t stop-word t-shirt 3.14", "[PAD] [CLS] literal specials"]
    for max_tokens in (4, 24, 77):
        assert fixed_length_tokenizer(path, max_tokens) is not None
        ids, mask = tokenize(captions, path, max_tokens)
        ref = load_tokenizer(path)(captions, padding="max_length", truncation=True, max_length=max_tokens,
                                   return_tensors="np")
        assert ids.dtype == np.int64 and ids.shape == (len(captions), max_tokens)
        assert np.array_equal(ids, ref["input_ids"]) and np.array_equal(mask, ref["attention_mask"])


def test_passes_needed_covers_the_steps_with_a_margin():
    assert shards.passes_needed(12_800, 4_000, 4) == 4  # ⌈1.05 × 12,800 / 4,000⌉ (the demo)
    assert shards.passes_needed(12_000, 4_000, 4) == 4  # 3 passes would leave no room for a dropped sample
    assert shards.passes_needed(100, 4_000, 4) == 1
    assert shards.passes_needed(100, None, 4) == 500  # unknown pass size: ≈2,000 read tasks listed


def test_shard_urls_list_folders_and_globs(demo_dir, tmp_path):
    """A URL names a shard, a folder of shards or a glob, listed through pyarrow/fsspec as the read tasks open them
    (file:// here; s3:// and gs:// go the same way)."""
    from rayvl.data.shard_io import open_shard
    from rayvl.data.tar import iter_tar_samples
    for i in range(3):
        (tmp_path / f"{i:05d}.tar").write_bytes((demo_dir / "train" / f"{i:05d}.tar").read_bytes())
    (tmp_path / "00000.parquet").write_bytes(b"not a shard")
    url = f"file://{tmp_path}"
    assert resolve_shards(url) == [f"{url}/{i:05d}.tar" for i in range(3)]
    assert resolve_shards(f"{url}/0000[12].tar") == [f"{url}/00001.tar", f"{url}/00002.tar"]
    assert resolve_shards(f"{url}/00002.tar,{tmp_path}/00000.tar") == [f"{url}/00002.tar", f"{tmp_path}/00000.tar"]
    with open_shard(f"{url}/00001.tar") as f:
        keys = [s["key"] for s in iter_tar_samples(f, ("key",))]
    assert keys[0] == "000010000" and len(keys) == len(set(keys)) > 0
    with pytest.raises(DataPlaneError, match=r"nothing\*.tar' matches no shard"):
        resolve_shards(f"{url}/nothing*.tar")
