"""What ``train.seed`` fixes: each row's crop and prompt are a function of (seed, sample key, pass) alone, each
rank's shuffle buffer of (seed, rank, execution), and with ``data.deterministic`` two runs of one seed log the same
loss at every step on CPU — a TOnICS run and a UniCL run with image-label data. That another seed trains otherwise
(other losses, another initialisation) is checked on the trials of test_compare's seeds grid."""
import io
import json
from collections import Counter

import numpy as np

from conftest import UNICL_MIXED, small_config, tonics_shapes
from rayvl import assets
from rayvl.data import fashion_mnist
from rayvl.data.pipeline import Rows, preprocess
from rayvl.methods.unicl.rows import Prompted, prompt_batch
from rayvl.data.position import row_ids
from rayvl.methods.unicl.prompts import Prompts
from rayvl.data.prompts import templates as prompt_templates
from rayvl.data.seeding import key_hash, row_rng, shuffle_seed


def test_a_rows_generator_is_a_function_of_seed_key_and_pass():
    # blake2b of the key: the same in every process (Python's str hash is salted per process, PYTHONHASHSEED)
    assert key_hash("000000042") == key_hash(np.str_("000000042")) == key_hash(b"000000042") == 16077919341038967921
    draws = row_rng(3, "000000042", 1).random(4)
    assert np.array_equal(row_rng(3, "000000042", 1).random(4), draws)
    for other in (row_rng(4, "000000042", 1), row_rng(3, "000000043", 1), row_rng(3, "000000042", 2)):
        assert not np.array_equal(other.random(4), draws)
    seeds = {shuffle_seed(0, rank, execution, stream) for rank in (0, 1) for execution in (0, 1) for stream in (0, 1)}
    assert len(seeds) == 8 and shuffle_seed(0, 1, 0) == shuffle_seed(0, 1, 0) != shuffle_seed(1, 1, 0)


def _jpeg(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _shard_rows(n: int, pass_: int) -> dict:
    """n image-label shard rows of pass ``pass_`` as a read task hands them to ``preprocess``."""
    return {"key": [f"{i:09d}" for i in range(n)], "img": [_jpeg(i) for i in range(n)], "txt": [None] * n,
            "json": [json.dumps({"cls": i % 3}) for i in range(n)], "row": row_ids(pass_, 0, 0, n)}


def _by_key(out: dict) -> dict:
    return {k: (img.tobytes(), caption) for k, img, caption in zip(out["key"], out["image"], out["caption"])}


def _split_reversed(batch: dict, fn) -> dict:
    """``fn`` over the batch's rows in two reversed halves (other tasks, other batches), merged by key."""
    n = len(batch["key"])
    halves = [{c: [v[i] for i in idx] for c, v in batch.items()} for idx in (range(n - 1, n // 2, -1),
                                                                             range(n // 2, -1, -1))]
    return {**_by_key(fn(halves[0])), **_by_key(fn(halves[1]))}


def test_a_shard_rows_crop_and_prompt_depend_on_seed_key_and_pass_only():
    prompts = Prompts(("cat", "dog", "bird"), prompt_templates(), frozenset({0, 1, 2}))
    kw = dict(image_size=16, crop_scale_min=0.3, train=True, max_tokens=16, transforms=(Prompted(prompts),),
              tokenizer_path=str(assets.text_model_path("minilm-l6")))

    def run(batch, seed=0):
        return preprocess(batch, Counter(), Rows(seed=seed, **kw))

    rows = _shard_rows(12, pass_=0)
    whole = _by_key(run(rows))
    assert len(whole) == 12 and _split_reversed(rows, run) == whole  # however the rows are batched
    # another pass or seed: other crops and prompts (80 templates: a caption may repeat by chance, not every one)
    for other in (_by_key(run(_shard_rows(12, pass_=1))), _by_key(run(rows, seed=1))):
        assert all(other[k][0] != whole[k][0] for k in whole)
        assert sum(other[k][1] != whole[k][1] for k in whole) >= 8


def test_a_fashion_mnist_rows_crop_and_prompt_depend_on_seed_key_and_pass_only():
    pixels, labels = fashion_mnist.read("fashion-mnist", "t10k", limit=12)
    prompts = Prompts(tuple(fashion_mnist.CLASSES), prompt_templates(), frozenset(range(10)))
    kw = dict(prompts=prompts, image_size=16, crop_scale_min=0.3, max_tokens=16, report_name=None,
              tokenizer_path=str(assets.text_model_path("minilm-l6")))

    def rows(pass_: int) -> dict:
        return {"key": [f"fmnist-t10k-{i:05d}" for i in range(12)], "pixels": list(pixels), "cls": list(labels),
                "pass": [pass_] * 12}

    def run(batch, seed=0):
        return prompt_batch(batch, seed=seed, **kw)

    whole = _by_key(run(rows(0)))
    assert _split_reversed(rows(0), run) == whole
    for other in (_by_key(run(rows(1))), _by_key(run(rows(0), seed=1))):
        assert all(other[k][0] != whole[k][0] for k in whole)
        assert sum(other[k][1] != whole[k][1] for k in whole) >= 8


def test_the_shuffle_buffer_is_seeded_per_rank(ray_local):
    from rayvl.config import load_config
    from rayvl.train.batches import batch_stream

    cfg = load_config(None, ["train.micro_batch_size=4", "data.local_shuffle_buffer=32"])
    ds = ray_local.data.from_items([{"image": np.zeros((3, 2, 2), np.uint8), "input_ids": np.zeros(2, np.int64),
                                     "attention_mask": np.ones(2, np.int64), "label": i} for i in range(64)])
    ds.context.execution_options.preserve_order = True  # the same blocks in the same order to every stream

    def labels(rank: int) -> list[int]:
        stream = batch_stream(ds.iterator(), cfg, rank=rank)
        return [x for _ in range(16) for x in next(stream)[0]["label"].tolist()]

    first = labels(0)
    assert sorted(first) == list(range(64)) and first != list(range(64))  # one execution, shuffled
    assert labels(0) == first and labels(1) != first


# one worker: the UniCL pair below is the one on two ranks (their shuffle buffers and split, seeded per rank)
TONICS = tonics_shapes("tonics.buffer_rows=64", "eval.tasks=[retrieval]",  # the curriculum needs a held-out task
                       "data.deterministic=true", "train.checkpoint_every=100", "train.num_workers=1")


def _losses(run_dir) -> list[float]:
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(h["grad_norm"] > 0 for h in history)  # rayvl's own norm (ZeRO-0)
    return [h["loss"] for h in history]


def _curve(recipe: list[str], demo_dir, tmp_path, seed: int, name: str) -> list[float]:
    from rayvl.train.trainer import train

    return _losses(train(small_config(demo_dir, tmp_path, *recipe, f"train.seed={seed}", f"train.run_name={name}"),
                         verbose=False).run_dir)


def test_one_seed_gives_one_tonics_loss_curve(ray_local, demo_dir, tmp_path, tonics_counts_path):
    """Two TOnICS runs of seed 0 log the same loss at every step (the same rows, node draws, batches and init)."""
    recipe = [*TONICS, f"tonics.counts_path={tonics_counts_path}"]  # counted once for the session
    assert _curve(recipe, demo_dir, tmp_path, 0, "first") == _curve(recipe, demo_dir, tmp_path, 0, "again")


def test_one_seed_gives_one_unicl_loss_curve(unicl_mixed_run, demo_dir, tmp_path):
    """With image-label rows in every batch and a memory bank: the session's run of seed 0 (test_unicl reads it)
    again logs the same losses, exactly (the same crops, prompts, rows, batches and init)."""
    assert _curve(UNICL_MIXED, demo_dir, tmp_path, 0, "again") == _losses(unicl_mixed_run.run_dir)
