"""Pseudo-BoW labelling ([BoW] §2.3): the four word-ranking rules against hand-computed words, faiss and the index
recall against brute force, the word precision counted by hand and on a labeller whose answer is known, and the job
on real shards — output read back with exact counts, a bad image counted, a killed job's rerun skipping its
finished shards, a folder of image files, errors named before Ray starts."""
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, untrained_checkpoint
from rayvl.methods.bow.deformation import shuffle
from rayvl.methods.bow.word_rank import WordRanker, neighbour_counts

# retrieved captions, best first, and S_a's document frequencies
NN = ["a red circle left of a blue square", "the red circle", "a large red star", "two blue squares and a red circle"]
DF = {"red": 100, "circle": 10, "blue": 50, "square": 5, "left": 20, "large": 30, "star": 2, "squares": 4,
      "two": 40, "the": 500, "a": 900}


def test_each_rule_keeps_the_hand_computed_words():
    counts, first = neighbour_counts(NN)  # stop words gone; a word counts once per caption
    assert counts == {"red": 4, "circle": 3, "blue": 2, "left": 1, "square": 1, "large": 1, "star": 1, "two": 1,
                      "squares": 1}
    ranker = WordRanker(DF, words=4, top_t=2, seed=0)
    assert ranker.top == {"red", "blue"}  # top-t over content words: "a" and "the" are stop words
    # MaxCount: by count, ties to the word seen first (in the caption closest to a crop)
    assert ranker.rank("max_count", NN, "k") == ["red", "circle", "blue", "left"]
    # RmTopMaxCount: the same after removing S_a's top-2 words
    assert ranker.rank("rm_top_max_count", NN, "k") == ["circle", "left", "square", "large"]
    # WeightedCount: count(w, NN) / count(w, S_a): star 1/2, circle 3/10, squares 1/4, square 1/5, ...
    assert ranker.rank("weighted_count", NN, "k") == ["star", "circle", "squares", "square"]
    # RmTopRand: the survivors in an order drawn from the image key — the same on every worker and rerun
    survivors = ["circle", "left", "square", "large", "star", "two", "squares"]
    drawn = {key: tuple(ranker.rank("rm_top_rand", NN, key)) for key in ("k1", "k2", "k3", "k4")}
    assert all(list(d) == shuffle(survivors, key, 0)[:4] and set(d) <= set(survivors) for key, d in drawn.items())
    assert len(set(drawn.values())) > 1
    assert WordRanker(DF, 4, top_t=20).rank("rm_top_max_count", NN, "k") == []  # everything removed: no caption


def test_the_labelling_actors_nhwc_image_tower_embeds_as_the_trained_layout_does(demo_dir, tmp_path):
    """The Labeler turns its image tower NHWC (faster on CPU); the embeddings must not move."""
    from rayvl.export import load

    model = load(untrained_checkpoint(demo_dir, tmp_path, seed=3))
    crops = np.random.default_rng(0).integers(0, 256, (6, 3, model.image_size, model.image_size), dtype=np.uint8)
    before = model.encode_image(crops).numpy()
    model.module.vision.to_channels_last()
    conv = next(p for p in model.module.vision.parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    np.testing.assert_allclose(model.encode_image(crops).numpy(), before, atol=1e-5)


def test_exact_index_equals_brute_force_and_approximate_recall_is_measured():
    from rayvl.eval import knn

    rng = np.random.default_rng(0)
    pool = rng.standard_normal((4000, 32)).astype(np.float32)
    pool /= np.linalg.norm(pool, axis=1, keepdims=True)
    queries = pool[:50] + 0.3 * rng.standard_normal((50, 32)).astype(np.float32)
    scores, ids = knn.search(knn.build_index(pool, "auto", exact_max=10_000), queries, 5)
    exact = np.argsort(-(queries.astype(np.float64) @ pool.T.astype(np.float64)), axis=1)[:, :5]  # float64 reference
    np.testing.assert_array_equal(ids, exact)
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ pool.T, exact, 1), rtol=1e-5)
    ivf = knn.build_index(pool, "auto", exact_max=1000, nprobe=4)  # above exact_max: IVF
    # 4·√n cells (252), at most n/39 (102): faiss wants ≥ 39 training points per cell
    assert type(ivf).__name__ == "IndexIVFFlat" and ivf.nlist == 4000 // 39 and ivf.nprobe == 4
    low = knn.recall(ivf, pool, queries, 5)
    _, found = ivf.search(queries, 5)  # recall@5: the share of the float64 exact top 5 that IVF's top 5 holds
    assert low == pytest.approx(np.mean([len(set(e) & set(f)) / 5 for e, f in zip(exact, found)]), abs=1e-12)
    ivf.nprobe = ivf.nlist  # every cell searched: exact again
    assert 0 < low < 1.0 and knn.recall(ivf, pool, queries, 5) == 1.0
    assert 0.5 < knn.recall(knn.build_index(pool, "hnsw"), pool, queries, 5) <= 1.0


def test_a_device_index_finds_what_the_flat_index_finds_and_merges_each_images_crops_best_first(monkeypatch):
    """knn.DeviceIndex (a labeller's exact search: matmul + top-k on its model's device, here CPU tensors) against
    the float64 reference and faiss's flat index; knn.merged against the per-image merge the labeller made before:
    each image's c·k retrievals by score, ties in crop then rank order, faiss's −1 padding last."""
    import torch

    from rayvl.eval import knn

    rng = np.random.default_rng(1)
    pool = rng.standard_normal((3000, 32)).astype(np.float32)
    pool /= np.linalg.norm(pool, axis=1, keepdims=True)
    queries = pool[:60] + 0.3 * rng.standard_normal((60, 32)).astype(np.float32)
    flat = knn.build_index(pool, "flat")
    index = knn.DeviceIndex.of(flat, torch.device("cpu"))
    scores, ids = index.search(torch.from_numpy(queries).double(), 5)  # any dtype in: fp32 products, as faiss's
    exact = np.argsort(-(queries.astype(np.float64) @ pool.T.astype(np.float64)), axis=1)[:, :5]
    np.testing.assert_array_equal(ids.numpy(), exact)
    np.testing.assert_allclose(scores.numpy(), knn.search(flat, queries, 5)[0], rtol=1e-5)
    assert index.search(torch.from_numpy(queries[:2]), 5000)[1].shape == (2, 3000)  # k above the pool: all of it
    monkeypatch.setattr(knn, "SCORES_BYTES", 4 * 60 * 7)  # the pool searched in blocks of 7 rows: the same
    blocked = index.search(torch.from_numpy(queries), 5)
    np.testing.assert_array_equal(blocked[1].numpy(), exact)
    np.testing.assert_allclose(blocked[0].numpy(), scores.numpy(), rtol=1e-6)
    assert index.search(torch.from_numpy(queries[:2]), 5000)[1].sort().values.tolist() == [list(range(3000))] * 2
    monkeypatch.setattr(knn, "DEVICE_INDEX_BYTES", 3000 * 32 * 4 - 1)  # a pool above the bound stays with faiss
    assert knn.DeviceIndex.of(flat, "cpu") is None
    assert knn.DeviceIndex.of(knn.build_index(pool, "ivf", nlist=16), "cpu") is None  # approximate: faiss searches
    assert knn.DeviceIndex.of(knn.build_index(pool, "hnsw"), "cpu") is None

    # 3 images × 2 crops × k=3, ties across crops and −1 padding (an approximate index that found fewer than k)
    s = np.array([[.9, .5, .1], [.9, .7, .5], [.8, .2, -3.4e38], [.6, .3, .3], [.4, .4, .4], [.9, .1, 0]], np.float32)
    n = np.array([[1, 2, 3], [4, 5, 6], [7, 8, -1], [9, 10, 11], [12, 13, 14], [15, 16, 17]])
    got_s, got_n = knn.merged(torch.from_numpy(s), torch.from_numpy(n), 2)
    for b in range(3):  # the labeller's merge before: a stable argsort of the negated scores, −1 dropped
        flat_s, flat_n = s[2 * b:2 * b + 2].ravel(), n[2 * b:2 * b + 2].ravel()
        order = np.argsort(-flat_s, kind="stable")
        keep = order[flat_n[order] >= 0]
        row = got_n[b].numpy()
        np.testing.assert_array_equal(row[row >= 0], flat_n[keep])
        np.testing.assert_array_equal(got_s[b].numpy()[row >= 0], flat_s[keep])
    assert got_n[1].tolist() == [7, 9, 10, 11, 8, -1] and got_n[0].tolist() == [1, 4, 5, 2, 6, 3]


def _unaligned(demo_dir, tmp_path) -> Path:
    """Two shards to label: 64 demo images with 2 undecodable ones, and shard 2 of the demo twice over under new
    keys (256 images: the labeller's second shard takes several times what its finisher takes to write the first;
    the captions of both are ignored)."""
    from rayvl.data.demo import write_shard
    from rayvl.data.tar import iter_tar_samples

    out = tmp_path / "unaligned"
    out.mkdir()
    with open(demo_dir / "train" / "00000.tar", "rb") as f:
        good = [s for _, s in zip(range(64), iter_tar_samples(f))]
    rows = [{"key": s["key"], "caption": "x", "status": "success", "jpg": s["img"]} for s in good]
    rows += [{"key": f"99999999{i}", "caption": "x", "status": "success", "jpg": b"\xff\xd8 not a jpeg"}
             for i in range(2)]
    write_shard(out, 0, rows, time.time())
    with open(demo_dir / "train" / "00002.tar", "rb") as f:
        third = list(iter_tar_samples(f))
    write_shard(out, 1, [{"key": f"{s['key']}{copy}", "caption": "x", "status": "success", "jpg": s["img"]}
                         for copy in (0, 1) for s in third], time.time())
    return out


def test_pseudo_label_job_writes_shards_that_train_reads_and_resumes_after_a_kill(ray_local, demo_dir, tmp_path):
    """On Ray (the session's, joined by the CLI): a labeller finds a shard's retrievals and its finisher actor writes
    it; the job killed once a shard is written, then run again without Ray, finishes the other."""
    import ray

    import pyarrow.parquet as pq

    from rayvl.assets import text_model_path
    from rayvl.data.pipeline import Rows
    from rayvl.data.shards import Reading, expected_samples, read_shards

    ckpt, unaligned = untrained_checkpoint(demo_dir, tmp_path), _unaligned(demo_dir, tmp_path)
    out = tmp_path / "pseudo"
    aligned = f"{demo_dir / 'train' / '00000.tar'},{demo_dir / 'train' / '00001.tar'}"
    command = [sys.executable, "-m", "rayvl.cli", "pseudo-label", str(ckpt), "--aligned", aligned,
               "--unaligned", str(unaligned), "--out", str(out), "--rules", "max_count,weighted_count",
               "--set", "pseudo_label.crops=6", "--set", "pseudo_label.k=4", "--set", "pseudo_label.top_t=3",
               "--set", "pseudo_label.cpus_per_actor=0.5", "--set", "pseudo_label.batch_size=64",
               # an approximate index (IVF, 6 cells of 256 captions, 2 searched): its recall is measured
               "--set", "pseudo_label.index=ivf", "--set", "pseudo_label.index_nprobe=2",
               "--set", "pseudo_label.recall_sample=32"]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": str(REPO)}
    # killed (SIGKILL) as soon as one shard is complete: one labeller takes the shards in order, the small one
    # first, and is still finding the large one's retrievals when its finisher has written the first (the driver,
    # killed, hands no more to write) — files of the other written in part must not count as finished
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path)
    deadline = time.time() + 300
    while not list((out / "weighted_count").glob("*_stats.json")):  # the last file of a finished shard
        assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
        time.sleep(0.02)
    first.kill()
    first.communicate(timeout=60)
    done = [sorted(p.name for p in (out / rule).glob("*_stats.json")) for rule in ("max_count", "weighted_count")]
    # one shard finished for both rules, the other not — its files for one rule may be written (its finisher, an
    # actor beside the first one's, can get that far before the kill lands): a shard written for one rule is not
    # finished, and the rerun labels it again
    finished = sorted(set(done[0]) & set(done[1]))
    assert len(finished) == 1, done
    before = {p: p.stat().st_mtime_ns for p in out.glob(f"*/{finished[0][:5]}*")}

    # the rerun, the same command with no cluster named: on one machine with one labeller it starts no Ray (the
    # labeller in its own process, decoding and cropping on the machine's CPUs) and finishes what the Ray job began
    from rayvl.config import load_config

    rerun = subprocess.run(command, env={k: v for k, v in env.items() if k != "RAY_ADDRESS"}, capture_output=True,
                           text=True, cwd=tmp_path, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "labelling 1 of 2 shards (1 finished before)" in rerun.stderr
    assert "caption index reused" in rerun.stderr and "Ray" not in rerun.stderr  # no Ray started, nor named
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())  # the finished shard was not written again
    sets = [command[i + 1] for i, x in enumerate(command) if x == "--set"]
    cfg = load_config(None, sets + [f"pseudo_label.checkpoint={ckpt}", f"pseudo_label.aligned={aligned}",
                                    f"pseudo_label.unaligned={unaligned}", f"pseudo_label.out={out}",
                                    "pseudo_label.rules=[max_count, weighted_count]"])
    summary = json.loads((out / "summary.json").read_text())
    for rule in ("max_count", "weighted_count"):
        s = summary["rules"][rule]
        assert s["success"] + s.get("empty_pseudo_caption", 0) == 64 + 256 and s["failed_to_decode"] == 2
        assert expected_samples(str(out / rule)) == s["success"]  # img2dataset's parquet: successes only
    assert summary["units_reused"] == 1 and summary["index"]["kind"] == "IndexIVFFlat"
    assert summary["index"]["captions"] == 256
    # its recall@4 is the saved IVF index's (2 of 6 cells searched) against exact search over the vectors it holds,
    # for the job's own queries: the crops of the first 32 decodable unaligned images (knn.recall's arithmetic is
    # checked against float64 above; the demo's repeated captions make exact ties here)
    import faiss

    from rayvl.eval import knn
    from rayvl.methods.bow.pseudo_label import INDEX_DIR, _sample_queries, check

    index = faiss.read_index(str(out / INDEX_DIR / "index.faiss"))
    index.make_direct_map()
    queries = _sample_queries(cfg, *check(cfg))
    assert len(queries) == 32 * 6 and index.nprobe == 2
    recall = knn.recall(index, index.reconstruct_n(0, index.ntotal), queries, 4)
    assert summary["index"]["recall_at_4"] == pytest.approx(recall, abs=1e-12) and 0 < recall < 1

    # the same job from the start without Ray (S_a's statistics and pool read by local loaders, the index built and
    # its recall measured here): the same statistics, index and labels as the two runs above wrote. The model runs
    # here on torch's threads, in the actor on one: a last-bit difference may reorder two tied neighbours (the
    # demo's captions repeat), so rows are held to the same neighbours and words but for a few ties
    from rayvl.methods.bow.pseudo_label import run

    fresh = tmp_path / "fresh"
    again = run(dataclasses.replace(cfg, pseudo_label=dataclasses.replace(cfg.pseudo_label, out=str(fresh))),
                without_ray=True)
    assert json.loads((fresh / INDEX_DIR / "aligned_word_stats.json").read_text())["df"] == json.loads(
        (out / INDEX_DIR / "aligned_word_stats.json").read_text())["df"]
    assert {k: again["index"][k] for k in ("captions", "kind", "dim")} == {
        k: summary["index"][k] for k in ("captions", "kind", "dim")}
    assert again["index"]["recall_at_4"] == pytest.approx(summary["index"]["recall_at_4"], abs=0.02)
    same = total = 0
    for rule in ("max_count", "weighted_count"):
        for shard in ("00000", "00001"):
            a, b = (pq.read_table(d / rule / f"{shard}.parquet", columns=["key", "status", "words", "neighbours",
                                                                          "scores"]).to_pylist() for d in (out, fresh))
            assert [(r["key"], r["status"]) for r in a] == [(r["key"], r["status"]) for r in b], (rule, shard)
            for x, y in zip(a, b):
                assert x["scores"] == pytest.approx(y["scores"], abs=2e-4)
                same += (x["neighbours"], x["words"]) == (y["neighbours"], y["words"])
                total += 1
    assert same >= 0.97 * total, (same, total)

    # read back through rayvl's training reader: every written sample arrives, its caption as written
    ds = read_shards(str(out / "weighted_count"), Rows(image_size=32, crop_scale_min=0.6, train=False,
                                                       tokenizer_path=str(text_model_path("minilm-l6")), max_tokens=16),
                     Reading(read_cpus=0.5, batch_size=64), columns=["key", "caption"])
    rows = ds.take_all()
    written = {}
    for shard in sorted((out / "weighted_count").glob("*.parquet")):
        written.update({r["key"]: r for r in pq.read_table(shard).to_pylist() if r["status"] == "success"})
    assert sorted(r["key"] for r in rows) == sorted(written)
    assert all(r["caption"] == written[r["key"]]["caption"] for r in rows)
    one = next(iter(written.values()))
    assert len(one["neighbours"]) == 6 * 4 and one["scores"] == sorted(one["scores"], reverse=True)
    assert 1 <= len(one["caption"].split()) <= 4 and one["pseudo_bow"] is True

    # S_a + pseudo has S_a's BoW statistics: the labelled folders are not counted, nor fingerprinted
    from rayvl.methods.bow import deformation as bow

    both = f"{aligned},{out / 'max_count'},{out / 'weighted_count'}"
    assert bow.counted_shards(both) == aligned.split(",")
    assert bow.fingerprint(both, 0, 0.1) == bow.fingerprint(aligned, 0, 0.1)
    assert Counter(r["rule"] for r in written.values()) == {"weighted_count": len(written)}

    # a shard the labeller cannot read (here a command that dies half-way, every time) is not damage: nothing of
    # it is written, so a rerun reads it again — the run fails naming it, or under skip it is reported unlabelled
    from dataclasses import asdict

    from rayvl.data.shard_io import ReadPolicy, ShardIOError
    from rayvl.methods.bow.pseudo_label import INDEX_DIR, Labeler, Unit, finished, format_summary, units_of, summarize

    broken = Unit(7, "tar", [f"pipe:head -c 9000 {unaligned / '00001.tar'}; exit 3"])
    df = json.loads((out / INDEX_DIR / "aligned_word_stats.json").read_text())["df"]
    fast = dict(retries=1, wait_s=0.01)
    labeler = Labeler(str(ckpt), str(out / INDEX_DIR), asdict(cfg.pseudo_label), df, str(tmp_path / "again"),
                      ReadPolicy(**fast))
    with pytest.raises(ShardIOError, match="exited with status 3"):
        labeler.label(broken)
    labeler.io = ReadPolicy(**fast, unreadable="skip")
    assert "exited with status 3" in labeler.label(broken)["unreadable_shard"]
    assert not (tmp_path / "again").exists() and not finished(tmp_path / "again", broken, cfg.pseudo_label.rules)
    summary = summarize(out, cfg.pseudo_label.rules, [*units_of(str(unaligned), 1000), broken], summary["index"],
                        0, 1.0)
    assert summary["not_labelled"] == broken.paths and "a rerun tries them again" in format_summary(summary)


def test_word_precision_counts_the_pseudo_words_of_the_true_caption(tmp_path):
    """The share of written pseudo words that are content words of the image's true caption (lower-cased, after
    RmStopNalpha), pooled over the rows of every shard of the rule: counted here by hand."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayvl.methods.bow.pseudo_label import word_precision

    truth = {"s1": "A Red circle, left of the blue square.", "s2": "Two large stars"}
    shards = [[{"source": "s1", "status": "success", "words": ["red", "square", "star"]},  # red, square: 2 of 3
               {"source": "s9", "status": "success", "words": ["red", "blue"]}],  # no true caption: not counted
              [{"source": "s2", "status": "success", "words": ["stars", "two", "circle", "blue"]},  # 2 of 4
               {"source": "s1", "status": "failed_to_decode", "words": ["left"]},  # not written: not counted
               {"source": "s2", "status": "empty_pseudo_caption", "words": []}]]
    rule = tmp_path / "max_count"
    rule.mkdir()
    for i, rows in enumerate(shards):
        pq.write_table(pa.Table.from_pylist(rows), rule / f"{i:05d}.parquet")
    assert word_precision(rule, truth) == {"pseudo_word_precision": pytest.approx(100.0 * 4 / 7, abs=1e-12)}
    assert word_precision(rule, {}) == {}  # no true caption known


def test_a_labeller_whose_nearest_caption_is_the_images_own_writes_that_captions_words(demo_dir, tmp_path):
    """Pseudo-label quality where the answer is known: the index holds, for each of 12 demo images, the embeddings
    of exactly the crops the labeller queries with, each row under the image's own caption, so every crop finds
    its own image first. With k = 1 and MaxCount, each pseudo caption is the first 4 content words of the image's
    true caption and the word precision against the shard's own captions (true_captions) is 100 %. A caption
    index read one row off, or crops grouped with the wrong image (2 crops × 3 images per search, cut on threads
    ahead of their search), shows here."""
    from dataclasses import asdict

    import faiss
    import pyarrow.parquet as pq

    from rayvl.methods.bow.config import PseudoLabelConfig
    from rayvl.methods.bow.deformation import rm_stop_nalpha
    from rayvl.data.demo import write_shard
    from rayvl.data.tar import iter_tar_samples
    from rayvl.data.text import words
    from rayvl.eval import knn
    from rayvl.export import load
    from rayvl.methods.bow.pseudo_label import Labeler, Unit, crops, true_captions, word_precision, write_pool

    ckpt = untrained_checkpoint(demo_dir, tmp_path)
    with open(demo_dir / "train" / "00000.tar", "rb") as f:
        samples = [s for _, s in zip(range(12), iter_tar_samples(f))]
    captions = [s["txt"].decode() for s in samples]
    unaligned = tmp_path / "unaligned"
    unaligned.mkdir()
    write_shard(unaligned, 0, [{"key": s["key"], "caption": c, "status": "success", "jpg": s["img"]}
                               for s, c in zip(samples, captions)], time.time())
    # 4 chunks of 3 images, their crops cut on 3 threads up to 6 chunks ahead of the one being searched; a seed
    # whose 24 crops are 24 pictures (a crop of two demo images' plain background is one picture: their embeddings
    # tie, and either image's row is the nearest)
    x = PseudoLabelConfig(rules=["max_count"], crops=2, k=1, words=4, batch_size=6, cpus_per_actor=3, seed=5)
    model = load(ckpt)
    model.module.vision.to_channels_last()  # as the labeller embeds
    vectors = np.concatenate([model.encode_image(crops(s["img"], s["key"], x, model.image_size)).numpy()
                              for s in samples])
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    faiss.write_index(knn.build_index(vectors, "flat"), str(index_dir / "index.faiss"))
    write_pool(index_dir, [s["key"] for s in samples for _ in range(2)], [c for c in captions for _ in range(2)])
    labeler = Labeler(str(next(ckpt.iterdir())), str(index_dir), asdict(x), {}, str(tmp_path / "out"))
    assert labeler.label(Unit(0, "tar", [str(unaligned / "00000.tar")]))["max_count_written"] == 12
    rows = pq.read_table(tmp_path / "out" / "max_count" / "00000.parquet").to_pylist()
    assert [r["key"] for r in rows] == [s["key"] for s in samples]
    for caption, row in zip(captions, rows):
        assert row["neighbours"] == [row["key"]] * 2  # each crop's nearest row: its own image
        assert row["words"] == list(dict.fromkeys(rm_stop_nalpha(words(caption))))[:4]
    truth = true_captions(str(unaligned))
    assert truth == dict(zip((s["key"] for s in samples), captions))
    assert word_precision(tmp_path / "out" / "max_count", truth) == {"pseudo_word_precision": 100.0}


def test_crops_are_cut_ahead_on_threads_and_used_in_order_holding_no_more_than_asked():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from rayvl.methods.bow.pseudo_label import ahead_of_use

    lock, started, held = threading.Lock(), [], []

    def work(i):
        with lock:
            started.append(i)
        return i * i

    with ThreadPoolExecutor(3) as threads:
        for i, result in ahead_of_use(list(range(10)), work, threads, ahead=4):
            held.append(len(started) - i - 1)  # results started beyond the one in use
            assert result == i * i
    assert sorted(started) == list(range(10)) and max(held) <= 4 and max(held) > 0  # ahead, and no further


def test_bad_inputs_are_named_before_ray_starts(demo_dir, tmp_path, capsys):
    import ray

    from rayvl.cli import main
    from rayvl.config import ConfigError
    from rayvl.methods.bow.pseudo_label import claim

    ckpt, train = untrained_checkpoint(demo_dir, tmp_path), str(demo_dir / "train")
    capsys.readouterr()  # building the model prints transformers' loading bar
    flags = {"RUN": str(ckpt), "--aligned": train, "--unaligned": train, "--out": str(tmp_path / "o")}
    cases = [({"RUN": str(tmp_path / "nothing")}, "pseudo_label.checkpoint"),
             ({"--unaligned": str(tmp_path / "none-*.tar")}, "pseudo_label.unaligned"),
             ({"--aligned": str(tmp_path / "none-*.tar")}, "pseudo_label.aligned"),
             ({"--rules": "maxcount"}, "pseudo_label.rules[0]: unknown rule 'maxcount'")]
    was_running = ray.is_initialized()
    for change, key in cases:
        argv = [x for k, v in {**flags, **change}.items() for x in ((v,) if k == "RUN" else (k, v))]
        assert main(["pseudo-label", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rayvl: error: ") and key in err and "Traceback" not in err
    assert ray.is_initialized() == was_running  # no Ray was started for any of them
    from rayvl.config import load_config
    from rayvl.methods.bow.pseudo_label import check_cluster

    cfg = load_config(None, ["pseudo_label.actors=2", "pseudo_label.cpus_per_actor=1"])
    with pytest.raises(ConfigError, match=r"pseudo_label.actors=2 × pseudo_label.cpus_per_actor=1 CPUs leave no"):
        check_cluster(cfg, True, [2.0])  # the caption pool's embedding hung like this on 2 CPUs
    check_cluster(cfg, True, [2.0, 1.0])  # another node keeps a CPU for Ray Data
    check_cluster(load_config(None, ["pseudo_label.actors=2", "pseudo_label.cpus_per_actor=0.5"]), True, [2.0])
    claim(tmp_path / "o", {"k": 5})
    with pytest.raises(ConfigError, match=r"pseudo_label.out: .* another checkpoint.*k: saved 5, now 10"):
        claim(tmp_path / "o", {"k": 10})


def test_a_gpu_labeller_gives_one_of_its_cpus_to_its_writer_and_the_dry_run_says_so():
    from rayvl.config import load_config
    from rayvl.methods.bow.commands import labellers_line
    from rayvl.methods.bow.pseudo_label import finisher_cpus, finishers_per_labeller

    assert [finisher_cpus(c, g) for c, g in ((7, 1), (2, 0.5), (1.5, 1), (8, 0), (0.5, 0))] == [1, 1, 0, 0, 0]
    # one writer for each 6 CPUs of a GPU labeller: a writer's one interpreter bounds the images a second it writes
    assert [finishers_per_labeller(c, g) for c, g in ((2, 1), (11, 1), (15, 1), (24, 1), (15, 0))] == [1, 1, 2, 4, 1]
    gpu = load_config(None, ["pseudo_label.actors=2", "pseudo_label.cpus_per_actor=7", "pseudo_label.gpus_per_actor=1"])
    assert labellers_line(gpu) == ("  2 labelling actors of {CPU: 6, GPU: 1}, each with an actor writing its shards of "
                                   "{CPU: 1}")
    node = load_config(None, ["pseudo_label.cpus_per_actor=15", "pseudo_label.gpus_per_actor=1", "ray_address=auto"])
    assert labellers_line(node).endswith("of {CPU: 13, GPU: 1}, each with 2 actors writing its shards, of "
                                         "{CPU: 1} each")
    cpu = load_config(None, ["pseudo_label.actors=2", "pseudo_label.cpus_per_actor=2"])
    assert labellers_line(cpu) == "  2 labelling actors of {CPU: 2}, each with an actor writing its shards of {CPU: 0}"
    # the default, pseudo_label.actors=0, on a cluster: as many labellers as its GPUs hold (pseudo_label.sized)
    auto = load_config(None, ["pseudo_label.cpus_per_actor=7", "pseudo_label.gpus_per_actor=1", "ray_address=auto"])
    assert auto.pseudo_label.actors == 0
    assert labellers_line(auto) == ("  labelling actors, as many as the cluster's GPUs hold when the job starts "
                                    "(pseudo_label.actors=0), of {CPU: 6, GPU: 1}, each with an actor writing its "
                                    "shards of {CPU: 1}")


def test_each_labellers_units_are_written_by_its_own_finisher_at_most_two_units_behind(ray_local, tmp_path):
    """rayvl.methods.bow.pseudo_label.labelled, with stand-ins for the Labeler's retrieve and the Finisher's write
    (a labeller finding at once, a finisher taking 0.15 s a unit): every unit's counts come back once, each unit is
    written by a finisher of the labeller that found it, given what the labeller returned (Ray resolves the
    reference the driver passes), and no labeller starts a unit while WRITES_AHEAD of its units wait to be
    written a finisher; of two finishers, a slow one takes few."""
    import ray

    from rayvl.methods.bow.pseudo_label import WRITES_AHEAD, Finisher, Unit, labelled

    @ray.remote(num_cpus=0)
    class Finds:
        def __init__(self, name: str):
            self.name, self.started = name, []

        def retrieve(self, unit):
            self.started.append(time.time())
            if unit.id < 0:
                raise ValueError(f"unit {unit.id} cannot be read")
            return {"unit": unit.id, "found_by": self.name}

        def log(self):
            return self.started

    @ray.remote(num_cpus=0)
    class Writes:
        def __init__(self, name: str, seconds: float = 0.15):
            self.name, self.seconds, self.ended = name, seconds, []

        def load(self):
            pass

        def write(self, found):
            time.sleep(self.seconds)
            self.ended.append(time.time())
            return {**found, "written_by": self.name}

        def log(self):
            return self.ended

    finds, writes = [Finds.remote(n) for n in "ab"], [[Writes.remote(n)] for n in "ab"]
    counts = list(labelled([Unit(i, "tar", [f"{i}.tar"]) for i in range(9)], finds, writes))
    assert sorted(c["unit"] for c in counts) == list(range(9))
    assert all(c["found_by"] == c["written_by"] for c in counts)
    for f, (w,) in zip(finds, writes):
        started, ended = ray.get(f.log.remote()), ray.get(w.log.remote())
        # the n-th unit (from 0) starts once at least n − WRITES_AHEAD + 1 of the labeller's units are written
        assert all(sum(e < t for e in ended) >= n - WRITES_AHEAD + 1 for n, t in enumerate(started)), (started, ended)
    # a labeller of two finishers (a GPU labeller of 12 CPUs or more): its units written by both, and it runs up
    # to WRITES_AHEAD units ahead of each
    two = [Writes.remote("a1"), Writes.remote("a2")]
    counts = list(labelled([Unit(i, "tar", [f"{i}.tar"]) for i in range(8)], finds[:1], [two]))
    assert sorted(c["unit"] for c in counts) == list(range(8))
    assert set(c["written_by"] for c in counts) == {"a1", "a2"}
    started = ray.get(finds[0].log.remote())[-8:]
    ended = sorted(ray.get(two[0].log.remote()) + ray.get(two[1].log.remote()))
    assert all(sum(e < t for e in ended) >= n - 2 * WRITES_AHEAD + 1 for n, t in enumerate(started)), (started, ended)
    assert sum(t < ended[0] for t in started) == 2 * WRITES_AHEAD  # four found before the first was written
    # ... each unit to the finisher with the fewest unwritten: one slow on its units (a large shard) takes no more
    # while the other writes the rest (handed in turn, it would get 4)
    slow = [Writes.remote("fast", 0.05), Writes.remote("slow", 2.0)]
    counts = list(labelled([Unit(i, "tar", [f"{i}.tar"]) for i in range(8)], finds[:1], [slow]))
    assert sorted(c["unit"] for c in counts) == list(range(8))
    assert Counter(c["written_by"] for c in counts)["slow"] <= WRITES_AHEAD + 1
    # a labeller's failure fails the job (its write gets the error), not a wait
    with pytest.raises(ValueError, match="unit -1 cannot be read"):
        list(labelled([Unit(i, "tar", [f"{i}.tar"]) for i in (0, -1, 2)], finds, writes))
    # a unit its labeller could not read reaches the job as the labeller counted it, nothing written
    unreadable = {"unit": 3, "unreadable_shard": "00003.tar: exited with status 3"}
    assert Finisher(str(tmp_path), {}, {}, str(tmp_path / "out")).write(unreadable) == unreadable
    assert not (tmp_path / "out").exists()


def test_a_finisher_maps_the_caption_pool_and_copies_none_of_it(tmp_path):
    """Each finisher maps the one pool file (a node's finishers share its pages): loading a pool of 200,000 captions
    allocates neither Python objects nor Arrow buffers of the pool's size (the lists it made before were ~2.6× the
    file), and a row's neighbours and words are the pool's. The file is written under another name and renamed, so a
    write killed half-way leaves the whole one; an index whose pool is not such a file (one made before) is made
    again."""
    import tracemalloc
    from dataclasses import asdict

    import pyarrow as pa

    from rayvl.methods.bow.config import PseudoLabelConfig
    from rayvl.methods.bow.pseudo_label import POOL_FILE, Finisher, mapped_pool, reusable_index, write_pool
    from rayvl.storage import replaced
    from rayvl.methods.bow.word_rank import caption_words

    n = 200_000
    keys, captions = [f"{i:09d}" for i in range(n)], [f"a photo of item {i} on a red table" for i in range(n)]
    write_pool(tmp_path, keys, captions)
    size = (tmp_path / POOL_FILE).stat().st_size
    finisher = Finisher(str(tmp_path), asdict(PseudoLabelConfig(rules=["max_count"])), {"photo": 3}, str(tmp_path))
    caption_words("the word filters loaded first")
    arrow = pa.total_allocated_bytes()
    tracemalloc.start()
    finisher.load()
    python = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert python < size / 20 and pa.total_allocated_bytes() - arrow < size / 20, (python, size)
    assert finisher.keys.take(np.array([5, n - 1])).to_pylist() == [keys[5], keys[-1]]
    assert [finisher.caption_words(j) for j in (0, 7, n - 1)] == [caption_words(captions[j]) for j in (0, 7, n - 1)]
    (tmp_path / "index.json").write_text(json.dumps({"fingerprint": {"a": 1}}))
    assert reusable_index(tmp_path, {"a": 1}) is not None and reusable_index(tmp_path, {"a": 2}) is None

    def killed(path):  # a write that dies half-way (a kill, a full disk)
        path.write_bytes(b"ARROW1 half")
        raise OSError("No space left on device")

    with pytest.raises(OSError):
        replaced(tmp_path / POOL_FILE, killed)
    assert len(mapped_pool(tmp_path)[1]) == n  # the pool under its name is still the whole one
    (tmp_path / POOL_FILE).unlink()
    assert reusable_index(tmp_path, {"a": 1}) is None


def test_a_pseudo_caption_is_trained_as_it_is_and_kept_out_of_the_bow_statistics(demo_dir):
    from collections import Counter as C

    from rayvl.assets import text_model_path
    from rayvl.data.pipeline import Rows, preprocess
    from rayvl.methods.bow.check import parse_ops as parse_bow_ops
    from rayvl.methods.bow.deformation import BowStats, Deformer, base_word_counts
    from rayvl.methods.bow.rows import Deform
    from rayvl.data.tar import iter_tar_samples

    with open(demo_dir / "train" / "00000.tar", "rb") as f:
        s = next(iter_tar_samples(f))
    pseudo = json.dumps({"key": "p1", "pseudo_bow": True})
    batch = {"key": ["p1", "a1"], "img": [s["img"], s["img"]], "txt": [b"circle star large", b"a small red circle"],
             "json": [pseudo, s["json"]]}
    ops = parse_bow_ops(["shuffle", "rm_stop_nalpha", {"keep": 1}])
    counts = C()
    out = preprocess(batch, counts, Rows(image_size=32, crop_scale_min=0.6, train=False,
                                         tokenizer_path=str(text_model_path("minilm-l6")), max_tokens=16,
                                         transforms=(Deform(Deformer(ops, seed=0, base_fraction=0.0,
                                                                     stats=BowStats({}, 0, 0, {}))),)))
    assert list(out["caption"]) == ["circle star large", out["caption"][1]] and len(out["caption"][1].split()) == 1
    assert counts["pseudo_bow_captions"] == 1 and counts["bow_captions_in"] == 1
    from rayvl.data.report import format_data_report

    assert ", 1 pseudo-BoW captions trained as they are" in format_data_report({"counts": counts})
    partial = base_word_counts(batch, seed=0, fraction=1.0)
    df = dict(zip(partial["word"], partial["df"]))
    assert df["<captions>"] == 1 and "star" not in df and df["circle"] == 1  # the aligned caption only


def test_a_folder_of_image_files_is_labelled_in_shards_of_shard_size(demo_dir, tmp_path):
    """Images without any shard (ImageFolder-style trees, any depth): sorted, cut into units of shard_size files,
    labelled in this process by the same Labeler the job's actors run, over an index built here."""
    from dataclasses import asdict

    import faiss
    import pyarrow.parquet as pq

    from rayvl.methods.bow.config import PseudoLabelConfig
    from rayvl.data.tar import iter_tar_samples
    from rayvl.eval import knn
    from rayvl.export import load
    from rayvl.methods.bow.pseudo_label import Labeler, units_of, write_pool

    ckpt = untrained_checkpoint(demo_dir, tmp_path)
    with open(demo_dir / "train" / "00000.tar", "rb") as f:
        samples = [s for _, s in zip(range(40), iter_tar_samples(f))]
    photos = tmp_path / "photos"
    (photos / "cats").mkdir(parents=True)
    (photos / "dogs").mkdir()
    for i, s in enumerate(samples[:3]):
        (photos / ("cats" if i < 2 else "dogs") / f"{i}.jpg").write_bytes(s["img"])
    (photos / "dogs" / "broken.JPG").write_bytes(b"not an image")
    (photos / "dogs" / "notes.txt").write_text("not an image file: ignored")
    units = units_of(str(photos), shard_size=2)
    assert [(u.kind, [Path(p).name for p in u.paths]) for u in units] == [
        ("files", ["0.jpg", "1.jpg"]), ("files", ["2.jpg", "broken.JPG"])]
    captions = [s["txt"].decode() for s in samples]
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    faiss.write_index(knn.build_index(load(ckpt).encode_text(captions).numpy(), "flat"),
                      str(index_dir / "index.faiss"))
    write_pool(index_dir, [s["key"] for s in samples], captions)
    settings = asdict(PseudoLabelConfig(rules=["max_count"], crops=2, k=3))
    labeler = Labeler(str(next(ckpt.iterdir())), str(index_dir), settings, {}, str(tmp_path / "out"))
    counts = [labeler.label(u) for u in units]
    assert [(c["images"], c["decoded"]) for c in counts] == [(2, 2), (2, 1)]
    rows = pq.read_table(tmp_path / "out" / "max_count" / "00001.parquet").to_pylist()
    assert [(r["key"], Path(r["source"]).name, r["status"]) for r in rows] == [
        ("000010000", "2.jpg", "success"), ("000010001", "broken.JPG", "failed_to_decode")]
    assert set(rows[0]["neighbours"]) <= {s["key"] for s in samples} and len(rows[0]["neighbours"]) == 6


def _table_7_job():
    """jobs/pseudo_label.py as a module."""
    import importlib

    sys.path.insert(0, str(REPO / "jobs"))
    try:
        return importlib.import_module("pseudo_label")
    finally:
        sys.path.remove(str(REPO / "jobs"))


def test_the_table_7_job_is_a_comparison_checked_before_ray_starts(demo_dir, tmp_path, capsys):
    """jobs/pseudo_label.py is a comparison like the paper jobs: its labeller and the labelling run first, then its
    arms (aligned only, + each rule's pseudo-labelled shards) × seeds as one Tune grid. Before Ray starts: --data
    without --unaligned is one line naming the option, an arm that is no rule names --variants, and --dry-run
    prints the labeller's plan, where the labelled shards go and the grid, writing nothing."""
    import ray

    job = _table_7_job()
    sets = [x for s in (f"data.demo_dir={demo_dir}", "data.demo_samples=384", "data.demo_eval_samples=64",
                        f"train.storage_path={tmp_path}") for x in ("--set", s)]
    was_running = ray.is_initialized()
    capsys.readouterr()
    assert job.COMPARISON.main(["--data", str(demo_dir / "train"), *sets]) == 2
    assert capsys.readouterr().err == "rayvl: error: --unaligned: required with --data\n"
    assert job.COMPARISON.main(["--variants", "aligned_only,+maxcount", *sets]) == 2
    assert "--variants: unknown +maxcount; known: aligned_only, +max_count," in capsys.readouterr().err
    argv = ["--dry-run", "--name", "t", "--seeds", "2", "--variants", "aligned_only,+weighted_count",
            "--teacher-steps", "10", "--steps", "5"]
    assert job.COMPARISON.main(argv + sets) == 0
    out = capsys.readouterr().out
    assert "labeller (10 steps on the aligned shards):" in out and f"run directory {tmp_path}/t-labeller" in out
    halves = [str(demo_dir / "train" / f"0000{i}.tar") for i in range(3)]  # the demo's 3 shards: 1 aligned, 2 not
    assert "data.train: 1 shard" in out
    assert f"then: pseudo-label {halves[1]},{halves[2]} with weighted_count into {tmp_path}/t-pseudo/" in out
    assert ("then: 4 trials, arms aligned_only, +weighted_count × seeds 0…1, 5 steps each from the labeller's "
            "weights") in out
    assert ray.is_initialized() == was_running and not list(tmp_path.iterdir())


def test_the_table_7_job_labels_then_trains_its_arms_as_a_grid(ray_local, demo_dir, tmp_path, capsys):
    """The job end to end at the smallest budget that checks its wiring: a 2-step labeller on the demo's first
    shard, its second and third labelled with max_count, then aligned only and + max_count, one seed each, as one
    grid of 2-step trials continued from the labeller with its BoW statistics. Each arm trained what it names and
    counted the pseudo-captioned images it held (the labelling summary's) and their word precision; --resume then
    reuses the finished labeller, labels nothing again and finds the grid finished."""
    import csv

    job = _table_7_job()
    sets = [f"data.demo_dir={demo_dir}", "data.demo_samples=384", "data.demo_eval_samples=64",
            f"train.storage_path={tmp_path / 'runs'}", f"tune.storage_path={tmp_path / 'sweeps'}",
            "train.num_workers=1", "data.image_size=32", "data.max_text_tokens=16", "train.micro_batch_size=8",
            "model.embed_dim=64", "model.alignment_layers=1", "eval.batch_size=32", "train.report_to=[]",
            "pseudo_label.crops=2", "pseudo_label.k=2", "pseudo_label.actors=1", "eval.tasks=[]"]
    argv = ["--name", "t7", "--seeds", "1", "--variants", "aligned_only,+max_count", "--teacher-steps", "2",
            "--steps", "2", *(x for s in sets for x in ("--set", s))]
    assert job.COMPARISON.main(argv) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    labeller, pseudo = tmp_path / "runs" / "t7-labeller", tmp_path / "runs" / "t7-pseudo"
    summary = json.loads((pseudo / "summary.json").read_text())
    assert list(summary["rules"]) == ["max_count"] and summary["rules"]["max_count"]["success"] > 0
    with open(tmp_path / "sweeps" / "t7" / "comparison.csv") as f:
        trials = {t["variant"]: t for t in csv.DictReader(f)}
    assert set(trials) == {"aligned_only", "+max_count"} and all(t["status"] == "TERMINATED" for t in trials.values())
    aligned = str(demo_dir / "train" / "00000.tar")
    for variant, t in trials.items():
        run = tmp_path / "sweeps" / "t7" / "runs" / f"trial-{t['trial']}"
        config = json.loads((run / "run.json").read_text())["config"]
        assert config["data"]["train"] == aligned + ("" if variant == "aligned_only" else f",{pseudo}/max_count")
        assert config["train"]["init_from"] == str(labeller) and config["train"]["max_steps"] == 2
        assert config["bow"]["stats_path"] == str(labeller / "bow_stats.json")
        metrics = json.loads((run / "final_metrics.json").read_text())["metrics"]
        held = summary["rules"]["max_count"]["success"] if variant == "+max_count" else 0
        assert metrics["pseudo_images"] == held and ("pseudo_word_precision" in metrics) == bool(held)
    assert "pseudo-labelled images" in printed and "== pseudo_label (BoW Table 7): mean ± std over 1 seeds" in printed

    labelled = {p: p.stat().st_mtime_ns for p in pseudo.glob("max_count/*")}
    assert job.COMPARISON.main(argv + ["--resume"]) == 0, capsys.readouterr().err[-3000:]
    assert f"labeller: {labeller} (finished before, reused)" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in pseudo.glob("max_count/*")} == labelled  # not labelled again


def test_a_resumed_comparison_that_names_the_metrics_where_they_were_finds_them():
    """A Table 7 comparison started before the pseudo-caption metrics moved under methods/bow keeps the old
    "module:function" in its trials' configs (Tune restores them as they started): the hook still resolves."""
    from rayvl.methods.bow.pseudo_captions import pseudo_caption_metrics
    from rayvl.sweeps.trials import hook

    assert hook("rayvl.eval.pseudo_captions:pseudo_caption_metrics") is pseudo_caption_metrics
    assert hook("rayvl.methods.bow.pseudo_captions:pseudo_caption_metrics") is pseudo_caption_metrics
