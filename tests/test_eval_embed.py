"""`rayvl eval` prints all five task tables and its Ray Data actor pools embed as one process does; the tasks' texts
are embedded once."""
import json

import numpy as np
import pytest
import torch

from conftest import small_config
from rayvl.checkpoints import META_FILE, MODEL_FILE, load_model
from rayvl.eval import data as datasets
from rayvl.eval.embed import ModelEmbedder
from rayvl.models.dual_encoder import build_model


@pytest.fixture(scope="module")
def checkpoint(demo_dir, tmp_path_factory):
    """A checkpoint in rayvl's format (consolidated weights + config), from an untrained small model."""
    d = tmp_path_factory.mktemp("ckpt") / "checkpoint_000"
    d.mkdir()
    cfg = small_config(demo_dir, d.parent)
    torch.save(build_model(cfg.model, seed=5).state_dict(), d / MODEL_FILE)
    (d / META_FILE).write_text(json.dumps({"step": 0, "config": cfg.to_dict(), "final": True}))
    return d


def test_the_tasks_texts_are_embedded_in_one_call_and_score_as_each_tasks_own(ray_local, checkpoint, demo_dir):
    """`evaluate` embeds every text the tasks name in one call (under `rayvl eval`: one actor pool, each actor
    loading the checkpoint, not one pool per task); each task's metrics are those of embedding its own texts."""
    from dataclasses import replace

    from rayvl import assets
    from rayvl.eval import tasks as eval_tasks

    model, config = load_model(checkpoint)
    tokenizer, max_tokens = str(assets.text_model_path("minilm-l6")), config["data"]["max_text_tokens"]
    data = datasets.load_shards(str(demo_dir / "eval"), config["data"]["image_size"], tokenizer, max_tokens, 0.5)
    rows = sorted(data.images.take_all(), key=lambda r: r["key"])
    data = replace(data, images=np.stack([r["image"] for r in rows])).with_rows(
        {c: [r[c] for r in rows] for c in ("key", "caption", "cls")}).with_text_sets(
        str(demo_dir / "classes.json"), str(demo_dir / "paraphrases.jsonl"), str(demo_dir / "sts.tsv"))

    class Counted(ModelEmbedder):
        calls: list[int] = []

        def texts(self, texts):
            self.calls.append(len(texts))
            return super().texts(texts)

    tasks = ["zeroshot", "retrieval", "paraphrase", "sts"]
    results, embeddings = eval_tasks.evaluate(tasks, data, Counted(model, tokenizer, max_tokens))
    named = {*eval_tasks.zeroshot_texts(data), *data.captions, *eval_tasks.paraphrase_texts(data),
             *eval_tasks.sts_texts(data)}
    assert Counted.calls == [len(named)] and set(results) == set(tasks)
    alone = ModelEmbedder(model, tokenizer, max_tokens)  # each task embedding its own texts
    for task in tasks:
        own = getattr(eval_tasks, task)(data, {"image": embeddings["image"]}, alone, 10)
        assert results[task] == pytest.approx(own, abs=1e-6), task


def test_rayvl_eval_prints_every_task_and_embeds_as_one_process(ray_local, checkpoint, demo_dir, tmp_path, capsys):
    """`rayvl eval` with two embedding actors (each pulling its share of the streamed held-out rows, then embedding
    half the texts): all five task tables, and the image and caption embeddings it writes, in key order, equal a
    single-process embedding of the same rows."""
    from rayvl import assets
    from rayvl.cli import main

    out = tmp_path / "out"
    pool = ["--actors", "2", "--cpus-per-actor", "0.5", "--batch-size", "16"]
    assert main(["eval", str(checkpoint.parent), "--out", str(out), *pool]) == 0
    printed = capsys.readouterr().out
    for table in ("== zeroshot ==", "== retrieval ==", "== paraphrase ==", "== sts ==", "== linear_probe =="):
        assert table in printed
    results = json.loads((out / "eval.json").read_text())
    assert results["checkpoint"].endswith("checkpoint_000") and results["step"] == 0  # what it scored
    assert results["retrieval"]["retrieval_images"] == 64 and results["paraphrase"]["paraphrase_pairs"] == 64
    assert "skipped" not in results
    assert results["data"]["samples_seen"] == results["data"]["samples_kept"] == 64
    speed = results["embedding"]  # the first actor's start-up (model loaded, warmed up) apart from the rate after
    assert speed["images"] == 64 and 0 < speed["startup_s"] and speed["images_per_s_once_ready"] > 0
    assert "== embedding ==" in printed

    model, config = load_model(checkpoint)
    tokenizer, max_tokens = str(assets.text_model_path("minilm-l6")), config["data"]["max_text_tokens"]
    data = datasets.load_shards(str(demo_dir / "eval"), config["data"]["image_size"], tokenizer, max_tokens, 0.5)
    rows = sorted(data.images.take_all(), key=lambda r: r["key"])
    local = ModelEmbedder(model, tokenizer, max_tokens)
    images = np.stack([r["image"] for r in rows])
    assert json.loads((out / "keys.json").read_text()) == [r["key"] for r in rows]
    np.testing.assert_allclose(np.load(out / "image_embeddings.npy"), local.images(images), atol=1e-5)
    captions = [r["caption"] for r in rows]
    np.testing.assert_allclose(np.load(out / "caption_embeddings.npy"), local.texts(captions), atol=1e-5)


def test_an_embedding_model_is_warmed_up_before_it_says_it_is_ready(checkpoint, tmp_path):
    """Both towers run once on a tiny batch before ``ready_at`` is stamped: the first call's one-off costs are in the
    start-up, not in the rate once running. A class-embedding model ([UniCL] eq. (4), loss.kind=ce) has no text
    tower: its image tower warms up alone."""
    import time

    from rayvl.config import from_dict
    from rayvl.eval.embed import EmbeddingActor

    class Timed(EmbeddingActor):
        calls: list[tuple[str, float]] = []

        def on_device(self, columns):
            self.calls.append(("image", time.time()))
            return super().on_device(columns)

        def texts(self, texts, batch_size):
            self.calls.append(("text", time.time()))
            return super().texts(texts, batch_size)

    model = Timed(str(checkpoint), device=torch.device("cpu"))
    assert [kind for kind, _ in Timed.calls] == ["image", "text"]
    assert max(at for _, at in Timed.calls) <= model.ready()

    config = json.loads((checkpoint / META_FILE).read_text())["config"]
    config["model"].update(text_tower="class_embedding", num_classes=3)
    config["loss"]["kind"], config["eval"]["tasks"] = "ce", []  # what a class-embedding run needs besides
    config["image_label"].update(data="fashion-mnist", weight=1.0)
    ce = tmp_path / "ce" / "checkpoint_000"
    ce.mkdir(parents=True)
    torch.save(build_model(from_dict(config).model, seed=5).state_dict(), ce / MODEL_FILE)
    (ce / META_FILE).write_text(json.dumps({"step": 0, "config": config, "final": True}))
    Timed.calls.clear()
    assert Timed(str(ce), device=torch.device("cpu")).ready() >= max(at for _, at in Timed.calls)
    assert [kind for kind, _ in Timed.calls] == ["image"]


def test_imagefolder_and_fashion_mnist(ray_local, tmp_path):
    from PIL import Image

    from rayvl import assets

    for c in ("cat", "dog"):
        (tmp_path / "folder" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (20, 30), (i * 40, 0, 0)).save(tmp_path / "folder" / c / f"{i}.jpg")
    (tmp_path / "folder" / "dog" / "broken.jpg").write_bytes(b"not a jpeg")
    folder = datasets.load_imagefolder(str(tmp_path / "folder"), 32, 0.5)
    assert folder.classes == ["cat", "dog"] and folder.size == 6 and sorted(folder.labels) == [0, 0, 0, 1, 1, 1]
    rows = folder.images.take_all()
    assert sorted(r["index"] for r in rows) == list(range(6)) and rows[0]["image"].shape == (3, 32, 32)

    root = assets.fashion_mnist_dir()
    assert root is not None, "dataset-fashion-mnist not unpacked: make install runs `rayvl assets fetch`"
    assert datasets.detect_kind(str(root)) == "fashion-mnist"
    fm = datasets.load_fashion_mnist(str(root), 32, 0.5, limit=20)
    assert fm.size == 20 and fm.labels[0] == 9 and fm.classes[9] == "ankle boot"  # t10k's first image is a boot
    row = sorted(fm.images.take_all(), key=lambda r: r["index"])[0]
    assert row["image"].shape == (3, 32, 32) and (row["image"][0] == row["image"][1]).all()

    # the same sets read without Ray (`rayvl eval` on one machine): a local loader's batches, in any order, put in
    # order as the embedder does; the labels and size come with the rows, the broken file dropped and counted
    from rayvl.eval.embed import in_order

    def streamed(data):
        batches = list(data.images)
        images, rows = in_order([{**b, "embedding": b["image"].reshape(len(b["image"]), -1)} for b in batches])
        return data.with_rows(rows), images.reshape(-1, 3, 32, 32), data.images.counts

    by_ray = {r["index"]: r["image"] for r in rows}
    local, images, counts = streamed(datasets.local_imagefolder(str(tmp_path / "folder"), 32, workers=2,
                                                                batch_size=4))
    assert local.classes == folder.classes and local.size == 6 and list(local.labels) == list(folder.labels)
    assert counts == {"dropped_corrupt_image": 1} and all(np.array_equal(images[i], by_ray[i]) for i in range(6))
    local, images, _ = streamed(datasets.local_fashion_mnist(str(root), 32, workers=2, batch_size=8, limit=20))
    assert local.size == 20 and list(local.labels) == list(fm.labels) and local.classes == fm.classes
    assert np.array_equal(images[0], row["image"])


def test_the_eval_batch_follows_the_device_unless_set():
    """eval.batch_size=0 (the default): 1,024 images a forward on a GPU — a `rayvl eval` actor's, or in training
    the rank's micro-batch within 128–1,024 — and 128 on CPU; a size set is kept everywhere. Checked before Ray."""
    from rayvl.config import ConfigError, RayvlConfig, validate
    from rayvl.eval.embed import batch_size
    from rayvl.eval.runner import settings

    assert [batch_size(0, False), batch_size(0, True), batch_size(0, True, 32), batch_size(0, True, 512),
            batch_size(0, True, 4096), batch_size(64, True, 512), batch_size(64, False)] == [
        128, 1024, 128, 512, 1024, 64, 64]
    config = RayvlConfig().to_dict()
    assert config["eval"]["batch_size"] == 0
    assert settings(config).batch_size == 128 and settings(config, gpus_per_actor=1.0).batch_size == 1024
    assert settings(config, gpus_per_actor=0.5, batch_size=256).batch_size == 256
    cfg = RayvlConfig()
    cfg.eval.batch_size = -1
    with pytest.raises(ConfigError, match=r"eval\.batch_size: must be ≥ 0"):
        validate(cfg)
