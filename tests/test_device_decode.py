"""Decoding on the device (rayvl.data.encoded_jpegs, rayvl.device_decode; data.decode / eval.decode): the same crop
boxes as the CPU path, pixels within the stated tolerance of it, what the device cannot take decoded on the CPU as
before, a JPEG no decoder takes left out and counted — and `rayvl eval --decode device`, on Ray and without,
scoring the held-out set as `--decode cpu` does, its counts exact."""
import io
import json
import tarfile
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from rayvl import device_decode
from rayvl.data import encoded_jpegs
from rayvl.data.images import decode_and_crop

CPU = torch.device("cpu")
# the stated tolerance (docs/concepts.md): against Pillow's decode and bicubic resize, in uint8 levels
MEAN_LEVELS, P999_LEVELS = 0.5, 4


def demo_jpegs(demo_dir, n: int = 24) -> list[bytes]:
    with tarfile.open(demo_dir / "eval" / "00000.tar") as tar:
        return [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")][:n]


def encoded(img: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def no_scan(jpeg: bytes) -> bytes:
    """A JPEG whose header is whole and whose scan is gone: its size reads, no decoder decodes it."""
    return jpeg[:jpeg.index(b"\xff\xda")] + b"\xff\xd9"


@pytest.fixture(scope="module")
def images(demo_dir):
    """The demo's JPEGs, and the other kinds a LAION shard holds: larger and greyscale JPEGs (decoded on the
    device), PNG, WebP, CMYK and progressive JPEGs (decoded on the CPU)."""
    base = [Image.open(io.BytesIO(d)).convert("RGB") for d in demo_jpegs(demo_dir, 6)]
    device = demo_jpegs(demo_dir) + [encoded(b.resize((300, 220)), "JPEG", quality=90) for b in base]
    device.append(encoded(base[0].convert("L").resize((90, 130)), "JPEG"))
    cpu = [encoded(base[1], "PNG"), encoded(base[2], "WEBP"), encoded(base[3].convert("CMYK"), "JPEG"),
           encoded(base[4].resize((200, 150)), "JPEG", progressive=True)]
    return device, cpu


@pytest.mark.parametrize("size,scale_min", [(32, None), (64, None), (224, None), (32, 0.3), (64, 0.6)])
def test_device_crops_are_the_cpu_paths_boxes_within_the_tolerance(images, size, scale_min):
    """Each row's box is drawn by the CPU path's call from the same generator (the generator is left where the CPU
    path leaves it: a row's later draws are the same too); decoded and resized on the device path's tensors, the
    crops differ from Pillow's by at most the stated levels; what the device cannot take is the CPU path's crop,
    bit for bit."""
    device, cpu = images
    rows = device + cpu
    reference, prepared = [], []
    for i, data in enumerate(rows):
        a, b = np.random.default_rng(i), np.random.default_rng(i)
        reference.append(decode_and_crop(data, size, scale_min, a if scale_min else None))
        prepared.append(encoded_jpegs.prepare(data, size, scale_min, b if scale_min else None))
        assert a.random() == b.random()
    boxes = np.array([box for _, box in prepared])
    assert (boxes[:len(device), 0] != encoded_jpegs.PIXELS).all(), "a JPEG the device takes was decoded here"
    assert (boxes[len(device):] == encoded_jpegs.PIXELS).all()
    crops, ok = device_decode.decoded([d for d, _ in prepared], boxes, size, CPU)
    assert ok.all() and crops.shape == (len(rows), 3, size, size) and crops.dtype == torch.uint8
    diff = np.abs(crops.numpy().astype(int) - np.stack(reference).astype(int))
    assert diff[:len(device)].mean() <= MEAN_LEVELS and np.percentile(diff[:len(device)], 99.9) <= P999_LEVELS
    assert not diff[len(device):].any()
    assert 0 < diff[:len(device)].mean()  # decoded apart, not the CPU path's crop again


def test_a_crop_far_larger_than_its_output_is_cut_in_the_read_task(demo_dir):
    """A crop over DEVICE_MAX_DOWNSCALE times the output side (torch's CUDA antialiased resize has no shared memory
    for its filter there) is cut in the read task, from the box drawn already: the CPU path's crop, bit for bit."""
    big = encoded(Image.open(io.BytesIO(demo_jpegs(demo_dir, 1)[0])).convert("RGB").resize((1400, 1100)), "JPEG")
    for size, on_device in ((32, False), (64, True)):
        a, b = np.random.default_rng(7), np.random.default_rng(7)
        data, box = encoded_jpegs.prepare(big, size, None, None)
        assert (box[0] != encoded_jpegs.PIXELS) == on_device  # centre crop 1100 px: over 32 × 32, under 32 × 64
        if not on_device:
            assert data == decode_and_crop(big, size, None).tobytes()
        data, box = encoded_jpegs.prepare(big, 16, 0.9, a)
        assert box[0] == encoded_jpegs.PIXELS and data == decode_and_crop(big, 16, 0.9, b).tobytes()


def test_a_batch_decoded_in_chunks_and_split_resizes_is_the_same(demo_dir, monkeypatch):
    """A batch decoded DECODE_CHUNK JPEGs at a time, its resizes split by RESIZE_BYTES (bounded device memory for
    an evaluation block of full-size photos), gives the crops of one call, in order."""
    rows = [encoded_jpegs.prepare(d, 32, None, None) for d in demo_jpegs(demo_dir)]
    whole, _ = device_decode.decoded([d for d, _ in rows], [b for _, b in rows], 32, CPU)
    monkeypatch.setattr(device_decode, "DECODE_CHUNK", 5)
    monkeypatch.setattr(device_decode, "RESIZE_BYTES", 3 * 112 * 112 * 4 * 2)  # two demo crops a resize
    chunked, ok = device_decode.decoded([d for d, _ in rows], [b for _, b in rows], 32, CPU)
    assert ok.all() and torch.equal(whole, chunked)


def test_a_batch_of_random_crops_costs_two_kernels_a_row(demo_dir):
    """Random crops have shapes of their own, so each is resized alone: a row costs its float copy and its resize,
    the rest (rounding to uint8, the batch's order) is once a chunk. What a training batch's copy thread launches on
    a GPU beside the step's own kernels (each elementwise op a row's was six a row)."""
    from rayvl.checks.census import Census

    jpegs = demo_jpegs(demo_dir)
    rows = [encoded_jpegs.prepare(d, 32, 0.3, np.random.default_rng(i)) for i, d in enumerate(jpegs)]
    boxes = np.array([b for _, b in rows])
    assert len({(y1 - y0, x1 - x0) for x0, y0, x1, y1 in boxes}) == len(rows)  # a shape a row
    census = Census()
    with census:
        crops, ok = device_decode.decoded([d for d, _ in rows], boxes, 32, CPU)
    assert ok.all() and len(crops) == len(rows)
    by_op = census.counts.by_op
    assert by_op["aten._upsample_bicubic2d_aa"] == len(rows) and by_op["aten.round_"] == 1
    assert census.counts.kernels <= 2 * len(rows) + 6, by_op


def test_a_jpeg_no_decoder_takes_is_left_out_and_the_rest_kept_in_order(demo_dir):
    """A JPEG whose header reads and whose data no decoder takes passes the read task (its size is known) and is
    left out by the device, which keeps the others' crops in order; bytes that are no image never leave the read
    task."""
    jpegs = demo_jpegs(demo_dir, 5)
    broken = no_scan(jpegs[2])
    assert encoded_jpegs.jpeg_size(broken) is not None and decode_and_crop(broken, 32, None) is None
    assert encoded_jpegs.prepare(b"not an image", 32, None, None) is None
    rows = [encoded_jpegs.prepare(d, 32, None, None) for d in jpegs[:2] + [broken] + jpegs[3:]]
    crops, ok = device_decode.decoded([d for d, _ in rows], [b for _, b in rows], 32, CPU)
    assert ok.tolist() == [True, True, False, True, True] and len(crops) == 4
    alone = [device_decode.decoded([d], [b], 32, CPU)[0][0] for d, b in rows[:2] + rows[3:]]
    assert torch.equal(crops, torch.stack(alone))
    # a batch of no JPEG (every row decoded in its read task, or none kept): its pixels, or nothing
    png = encoded(Image.open(io.BytesIO(jpegs[0])), "PNG")
    data, box = encoded_jpegs.prepare(png, 32, None, None)
    pixels, ok = device_decode.decoded([data], [box], 32, CPU)
    assert ok.tolist() == [True] and torch.equal(pixels[0], torch.from_numpy(decode_and_crop(png, 32, None)))
    none, ok = device_decode.decoded([], np.zeros((0, 4), np.int64), 32, CPU)
    assert none.shape == (0, 3, 32, 32) and len(ok) == 0


def test_rows_carry_bytes_and_boxes_for_the_device(demo_dir):
    """A read task's rows for the device: the JPEG's own bytes and its box, no decoded image; counts as the CPU
    path's."""
    from collections import Counter

    from rayvl import assets
    from rayvl.data.pipeline import Rows, preprocess

    jpegs = demo_jpegs(demo_dir, 4)
    batch = {"key": np.array(["a", "b", "c", "d"], dtype=object), "img": jpegs[:3] + [b"junk"],
             "txt": ["a red square", "a blue circle", "a green triangle", "a cat"], "json": [b"{}"] * 4}
    tokenizer = str(assets.text_model_path("minilm-l6"))
    counts = {d: Counter() for d in encoded_jpegs.DECODES}
    out = {d: preprocess(batch, counts[d], Rows(32, 1.0, False, tokenizer, 16, decode=d)) for d in counts}
    assert counts["cpu"] == counts["device"] and counts["cpu"]["dropped_corrupt_image"] == 1
    assert "image" not in out["device"] and list(out["device"]["image_bytes"]) == jpegs[:3]
    assert out["device"]["image_box"].tolist() == [[encoded_jpegs.CENTRE] * 4] * 3  # the evaluation's crop
    assert np.array_equal(out["cpu"]["input_ids"], out["device"]["input_ids"])


@pytest.fixture(scope="module")
def shards_with_a_broken_jpeg(demo_dir, tmp_path_factory):
    """The demo's held-out shard with one more sample, a JPEG whose header is whole and whose scan is gone."""
    out = tmp_path_factory.mktemp("broken") / "00000.tar"
    with tarfile.open(demo_dir / "eval" / "00000.tar") as src, tarfile.open(out, "w") as dst:
        members = [(m, src.extractfile(m).read()) for m in src if m.isfile()]
        for m, data in members:
            dst.addfile(m, io.BytesIO(data))
        broken = no_scan(next(d for m, d in members if m.name.endswith(".jpg")))
        for name, data in (("zz_broken.jpg", broken), ("zz_broken.txt", b"a picture"), ("zz_broken.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out.parent


def test_rayvl_eval_decoded_on_the_device_scores_as_on_the_cpu_without_ray(checkpoint_dir, shards_with_a_broken_jpeg,
                                                                           tmp_path):
    """`rayvl eval --decode device` with the model in its own process, fed by a local loader."""
    same_as_on_the_cpu(checkpoint_dir, shards_with_a_broken_jpeg, tmp_path, actors=1, without_ray=True)


def test_rayvl_eval_decoded_on_the_device_scores_as_on_the_cpu_on_two_actors(ray_local, checkpoint_dir,
                                                                             shards_with_a_broken_jpeg, tmp_path):
    """`rayvl eval --decode device` on two embedding actors fed by Ray Data's read tasks."""
    same_as_on_the_cpu(checkpoint_dir, shards_with_a_broken_jpeg, tmp_path, actors=2, without_ray=False)


def same_as_on_the_cpu(checkpoint_dir, shards, tmp_path, **pool) -> None:
    """`rayvl eval --decode device` (Pillow here, the device path's crops): the same rows in the same order, the
    same counts — the JPEG its read task passed, counted dropped by the model that could not decode it —, image
    embeddings close to the CPU path's and the retrieval metrics within a point of it."""
    from rayvl.checks.gpu import decode_agreement
    from rayvl.eval.runner import Sources, run_eval

    sources = Sources(str(shards), "shards")
    results = {d: run_eval(str(checkpoint_dir), ["retrieval"], sources, tmp_path / d, decode=d, cpus_per_actor=0.5,
                           batch_size=16, **pool) for d in encoded_jpegs.DECODES}
    assert results["cpu"]["data"] == results["device"]["data"]
    assert results["cpu"]["data"]["dropped_corrupt_image"] == 1 and results["cpu"]["data"]["samples_kept"] == 64
    keys = {d: json.loads((tmp_path / d / "keys.json").read_text()) for d in results}
    assert keys["cpu"] == keys["device"] and len(keys["cpu"]) == 64
    embedded = {d: np.load(tmp_path / d / "image_embeddings.npy") for d in results}
    assert np.median((embedded["cpu"] * embedded["device"]).sum(1)) > 0.99
    for metric, value in results["cpu"]["retrieval"].items():
        assert results["device"]["retrieval"][metric] == pytest.approx(value, abs=1.0 + 1e-9), metric
    said, failure = decode_agreement(tmp_path / "device", tmp_path / "cpu")  # what gpu_check holds a GPU to
    assert failure == "" and said.startswith("same counts and rows")


@pytest.fixture(scope="module")
def checkpoint_dir(demo_dir, tmp_path_factory):
    from conftest import untrained_checkpoint

    return untrained_checkpoint(demo_dir, tmp_path_factory.mktemp("ckpt")) / "checkpoint_000000"


def test_training_batches_decoded_on_the_device_are_the_cpu_paths_rows(ray_local, demo_dir, tmp_path):
    """data.decode=device: the training stream's read tasks send the JPEGs' bytes and boxes, the batch stream
    decodes them into ``image`` (Pillow here, the device path's crops): the same rows in the same order with the same
    tokens and labels as data.decode=cpu, their random resized crops within the stated tolerance."""
    import uuid

    import ray

    from conftest import small_config
    from rayvl.data.report import create_report, release_reports
    from rayvl.train.batches import batch_stream
    from rayvl.train.datasets import shard_datasets

    streams, reports = {}, []
    for decode in encoded_jpegs.DECODES:
        cfg = small_config(demo_dir, tmp_path, f"data.decode={decode}", "data.deterministic=true",
                           "data.local_shuffle_buffer=0", "eval.tasks=[]")
        reports.append(f"device-decode-{uuid.uuid4().hex[:6]}")
        shards = sorted(str(p) for p in (demo_dir / "train").glob("*.tar"))
        ray.get(create_report(reports[-1]).restore.remote(uuid.uuid4().hex, None, len(shards)))
        train = shard_datasets(cfg, shards, "", reports[-1])["train"]
        if decode == "device":
            assert {"image_bytes", "image_box"} <= set(train.schema().names) and "image" not in train.schema().names
        stream, rows = batch_stream(train.iterator(), cfg), {}
        while len(rows) < 384:  # the demo's pass (3 shards of 128); the streams' orders differ, the rows not
            batch = next(stream)[0]
            assert batch["image"].dtype == torch.uint8 and "image_bytes" not in batch
            rows.update({int(r): {k: batch[k][i] for k in ("image", "input_ids", "attention_mask", "label")}
                         for i, r in enumerate(batch["row"])})
        streams[decode] = rows
    release_reports(reports)
    cpu, device = streams["cpu"], streams["device"]
    assert set(cpu) == set(device)
    for row in cpu:
        for name in ("input_ids", "attention_mask", "label"):
            assert torch.equal(cpu[row][name], device[row][name]), name
    diff = torch.stack([(cpu[r]["image"].int() - device[r]["image"].int()).abs().float() for r in cpu])
    assert diff.mean() <= MEAN_LEVELS and torch.quantile(diff.flatten(), 0.999) <= P999_LEVELS


def test_tonics_micro_batches_keep_the_jpegs_for_the_copy_to_decode(demo_dir):
    """data.decode=device under TOnICS: the bucket sampler's micro-batch keeps each row's JPEG bytes as they came
    (TonicsBatches._stack: a list, not a stacked array), and the batch copy decodes them — each row's crop the one
    its bytes and box give alone, a row no decoder takes a blank image, counted."""
    from types import SimpleNamespace

    from rayvl.methods.tonics.sampler import ROOT, BucketSampler
    from rayvl.methods.tonics.train import TonicsBatches
    from rayvl.train.batches import DeviceCopy

    jpegs = demo_jpegs(demo_dir, 16)
    jpegs[5] = no_scan(jpegs[5])
    rows = [encoded_jpegs.prepare(d, 32, 0.5, np.random.default_rng(i)) for i, d in enumerate(jpegs)]

    def stream():  # batches of 4 rows as Ray Data's numpy batches hold them (the bytes an object column), row r
        for at in range(0, 64, 4):  # made of rows[r % 16]
            some = [rows[r % 16] for r in range(at, at + 4)]
            yield {"image_bytes": np.array([d for d, _ in some], dtype=object),
                   "image_box": np.stack([b for _, b in some]), "object": np.arange(at, at + 4) % 2,
                   "row": np.arange(at, at + 4)}

    sampler = BucketSampler(stream(), ["image_bytes", "image_box", "object", "row"], micro_batch=8, buffer_rows=16,
                            max_wait_rows=0, seed=0, rank=0)
    copy = DeviceCopy(CPU, 32)
    stack = partial(TonicsBatches._stack, SimpleNamespace(device=CPU))
    seen = []
    for node in (2, ROOT):  # object 1's bucket, then a root draw
        batch = sampler.batch(node, step=1, stack=stack)
        assert isinstance(batch["image_bytes"], list) and all(isinstance(d, bytes) for d in batch["image_bytes"])
        decoded = copy.decoded(batch)
        assert "image_bytes" not in decoded and decoded["image"].shape == (8, 3, 32, 32)
        for i, r in enumerate(decoded["row"].tolist()):
            alone, ok = device_decode.decoded([rows[r % 16][0]], np.array([rows[r % 16][1]]), 32, CPU)
            expected = alone[0] if ok.all() else torch.zeros((3, 32, 32), dtype=torch.uint8)
            assert torch.equal(decoded["image"][i], expected), r
        seen += decoded["row"].tolist()
    assert len(set(seen)) == 16 and copy.blank == sum(r % 16 == 5 for r in seen) >= 1
    assert {r % 2 for r in seen[:8]} == {1}  # object 1's bucket
