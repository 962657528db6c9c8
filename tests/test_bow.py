"""Bag-of-Words deformation ([BoW] §2.2): operators by hand, the Ray statistics pass against a single-process
reference, determinism across workers, emptied captions counted, the statistics artifact reused or refused."""
import glob
import io
import random
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import ray

from rayvl import assets
from rayvl.config import ConfigError, load_config
from rayvl.data import shards
from rayvl.data.pipeline import Rows
from rayvl.data.shards import Reading
from rayvl.methods.bow import deformation as bow
from rayvl.methods.bow.check import parse_ops as parse_bow_ops
from rayvl.methods.bow.rows import Deform
from rayvl.data.artifacts import ArtifactMismatch
from rayvl.data.report import create_report, report_actor
from rayvl.data.tar import iter_tar_samples
from rayvl.data.text import TOKEN_PATTERN, stopwords, validate_caption, words


# ----------------------------------------------------------------------------- operators by hand

def test_words_keep_contractions_and_split_punctuation():
    assert words("A man's T-shirt: 3.5 dogs, SHOULD'VE been here…") == [
        "a", "man's", "t-shirt", ":", "3", ".", "5", "dogs", ",", "should've", "been", "here", "…"]
    assert words("don’t") == ["don't"]  # typographic apostrophe folded onto NLTK's spelling
    from nltk.tokenize import RegexpTokenizer  # rayvl runs the same pattern through `re` (5× faster, see bow.py)

    for text in ("a man's t-shirt: 3.5 dogs", "café olé — 100% «naïve» x2!!", "should've... o'clock?"):
        assert words(text) == RegexpTokenizer(TOKEN_PATTERN).tokenize(text)
    ws = words("one two three four five six seven")
    assert sorted(bow.shuffle(ws, "k", 0)) == sorted(ws) and bow.shuffle(ws, "k", 0) == bow.shuffle(ws, "k", 0)
    assert bow.shuffle(ws, "k", 0) != bow.shuffle(ws, "k", 1)


def test_nltk_stopword_list_is_loaded_through_nltk():
    stop = stopwords()
    assert len(stop) == 179  # NLTK's English list, read by nltk.corpus.stopwords from the shipped data file
    assert {"should've", "don't", "any", "the", "wouldn't", "ma"} <= stop
    assert "picture" not in stop


def test_rm_stop_nalpha():
    ws = words("There is a small red circle, and it's 3 feet away; you should've seen o'clock t-shirts!")
    assert bow.rm_stop_nalpha(ws) == ["small", "red", "circle", "feet", "away", "seen", "o'clock", "t-shirts"]
    assert bow.rm_stop_nalpha(["42", "3d", "...", "x2", "ok"]) == ["ok"]  # numbers / mixed / punctuation go


def test_vocab_top_freq_and_keep():
    stats = bow.BowStats({}, 10, 3, {"dog": 3, "a": 3, "cat": 2, "red": 1, "ball": 1})
    assert stats.top(2) == {"a", "dog"}  # df ties broken alphabetically
    assert stats.top(3) == {"a", "dog", "cat"}
    assert stats.top(4) == {"a", "dog", "cat", "ball"}
    assert bow.limit_to_base_vocab(["a", "mikoshi", "dog"], frozenset(stats.df)) == ["a", "dog"]
    assert bow.rm_top_freq(["a", "red", "dog", "cat"], stats.top(2)) == ["red", "cat"]
    assert bow.keep(["w1", "w2", "w3"], 2) == ["w1", "w2"] and bow.keep(["w1"], 4) == ["w1"]


def test_default_cascade_by_hand():
    stats = bow.BowStats({}, 100, 10, {"men": 9, "table": 8, "rocks": 5, "utter": 2, "ash": 2, "sitting": 3,
                                       "a": 10, "the": 9, ".": 9})
    ops = parse_bow_ops(["shuffle", "rm_stop_nalpha", "limit_to_base_vocab", {"rm_top_freq": 3}, {"keep": 4}])
    caption = "Men were sitting at the table: all utter mikoshi ash, 4 rocks."
    # bow.top_freq_words=content: the top-3 of the words RmStopNalpha keeps — men, table, rocks — are removed (the
    # words [BoW] Figure 2 shows RmTopFreq removing); mikoshi is not in the base vocab; 4, ":" not alphabetical
    content = bow.Deformer(ops, seed=0, base_fraction=0.0, stats=stats)
    assert content.tops[3] == {"men", "table", "rocks"}
    assert sorted(content.deform_words(words(caption), "k1")) == ["ash", "sitting", "utter"]
    # "all": the top-3 of the whole base vocabulary, a, ".", men — after RmStopNalpha only "men" is a real word
    deform = bow.Deformer(ops, seed=0, base_fraction=0.0, stats=stats, top_freq_words="all")
    assert deform.tops[3] == {"a", ".", "men"}
    out = deform.deform_words(words(caption), "k1")
    survivors = ["sitting", "table", "utter", "ash", "rocks"]
    shuffled = bow.shuffle(words(caption), "k1", 0)
    expected = [w for w in shuffled if w in survivors][:4]  # Keep(4) after everything else: 4 of the 5, in the
    assert out == expected                                   # order the seeded shuffle put them
    assert deform("k1", caption) == (" ".join(expected), False)
    assert deform("k1", caption) == deform("k1", caption)  # same key, same result, any worker
    assert len({" ".join(deform.deform_words(words(caption), f"k{i}")) for i in range(20)}) > 1


def test_keep_must_be_last_and_ops_are_checked_before_ray():
    with pytest.raises(ConfigError, match=r"bow\.ops\[0\]: keep must come once and last"):
        load_config(None, ["bow.ops=[{keep: 2}, shuffle]"])
    with pytest.raises(ConfigError, match=r"bow\.ops\[1\]: unknown operator 'rm_stopwords'"):
        load_config(None, ["bow.ops=[shuffle, rm_stopwords]"])
    with pytest.raises(ConfigError, match=r"bow\.ops\[0\]: rm_top_freq needs a whole number"):
        load_config(None, ["bow.ops=[{rm_top_freq: many}]"])
    with pytest.raises(ConfigError, match=r"bow\.base_fraction: limit_to_base_vocab / rm_top_freq need a base"):
        load_config(None, ["bow.base_fraction=0.0"])
    cfg = load_config(None, [])
    assert cfg.bow.ops == ["shuffle", "rm_stop_nalpha", "limit_to_base_vocab", {"rm_top_freq": 1000}, {"keep": 4}]


def test_base_split_is_a_seeded_hash_of_the_key():
    keys = [f"{i:09d}" for i in range(20000)]
    share = sum(bow.is_base(k, 0, 0.1) for k in keys) / len(keys)
    assert abs(share - 0.1) < 4 * (0.1 * 0.9 / len(keys)) ** 0.5  # binomial, 4 sigma
    other_seed = {k for k in keys if bow.is_base(k, 1, 0.1)}
    assert other_seed != {k for k in keys if bow.is_base(k, 0, 0.1)}


# ----------------------------------------------------------------------------- on Ray, over real shards

def _reference_stats(train_dir: Path, seed: int, fraction: float) -> tuple[int, int, Counter]:
    """Single process, float-free: every caption of every shard, base split by the same hash."""
    captions, base, df = 0, 0, Counter()
    for path in sorted(glob.glob(str(train_dir / "*.tar"))):
        with open(path, "rb") as f:
            for sample in iter_tar_samples(f):
                text, reason = validate_caption(sample.get("txt"))
                if reason:
                    continue
                captions += 1
                if bow.is_base(sample["key"], seed, fraction):
                    base += 1
                    df.update(set(words(text)))
    return captions, base, df


def test_stats_pass_equals_single_process_reference_and_artifact_is_reused(ray_local, demo_dir, tmp_path,
                                                                            monkeypatch):
    data = tmp_path / "train"
    shutil.copytree(demo_dir / "train", data)
    stats = bow.compute_stats(str(data), seed=3, fraction=0.25)
    captions, base, df = _reference_stats(data, 3, 0.25)
    assert (stats.captions, stats.base_captions) == (captions, base) == (384, base)
    assert 60 < base < 130 and stats.df == dict(df)
    # the driver's running sums folded after every batch (as a corpus of more than FOLD_ROWS partial rows is): the same
    monkeypatch.setattr(shards, "FOLD_ROWS", 1)
    assert bow.compute_stats(str(data), seed=3, fraction=0.25) == stats
    monkeypatch.undo()

    path = str(tmp_path / "bow_stats.json")
    first, reused = bow.load_or_compute(str(data), path, seed=3, fraction=0.25)
    assert not reused and first.df == stats.df
    again, reused = bow.load_or_compute(str(data), path, seed=3, fraction=0.25)
    assert reused and again.df == stats.df and again.fingerprint == first.fingerprint

    with pytest.raises(ArtifactMismatch, match=r"seed: saved 3, now 4"):
        bow.load_or_compute(str(data), path, seed=4, fraction=0.25)
    shutil.copy(data / "00000.tar", data / "00009.tar")  # same shards + one more
    with pytest.raises(ArtifactMismatch, match=r"shards differ: 00009\.tar"):
        bow.load_or_compute(str(data), path, seed=3, fraction=0.25)


def _pipeline(spec: str, deform, report_name=None, shuffle_files=True):
    return shards.read_shards(spec, Rows(image_size=32, crop_scale_min=0.5, train=True,
                                         tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=16,
                                         transforms=(Deform(deform),)),
                              Reading(read_cpus=0.5, batch_size=16, shuffle=shuffle_files, report_name=report_name))


@ray.remote(num_cpus=0)
def _consume(iterator) -> dict:
    return {k: c for batch in iterator.iter_batches(batch_format="numpy", batch_size=32)
            for k, c in zip(batch["key"], batch["caption"])}


def test_deformation_is_identical_on_one_and_two_workers(ray_local, demo_dir):
    spec = str(demo_dir / "train")
    stats = bow.compute_stats(spec, seed=0, fraction=0.1)
    ops = parse_bow_ops(["shuffle", "rm_stop_nalpha", "limit_to_base_vocab", {"rm_top_freq": 3}, {"keep": 3}])
    deform = bow.Deformer(ops, 0, 0.1, stats)
    one = ray.get(_consume.remote(_pipeline(spec, deform).streaming_split(1)[0]))
    splits = _pipeline(spec, deform).streaming_split(2, equal=False)  # two consumers, like two Ray Train workers
    parts = ray.get([_consume.remote(it) for it in splits])
    assert all(parts) and not set(parts[0]) & set(parts[1])
    assert {**parts[0], **parts[1]} == one and len(one) == 384
    base = [k for k in one if bow.is_base(k, 0, 0.1)]
    assert base and all(len(one[k].split()) > 4 for k in base)  # base captions stay intact
    assert all(1 <= len(c.split()) <= 3 for k, c in one.items() if k not in base)


def _jpeg(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_emptied_captions_are_dropped_and_counted(ray_local, tmp_path):
    rng = random.Random(0)
    captions = {}
    with tarfile.open(tmp_path / "00000.tar", "w") as tar:
        for i in range(40):
            key = f"{i:09d}"
            # every third caption is only stop words and numbers: RmStopNalpha empties it
            captions[key] = "it is 42 of the ..." if i % 3 == 0 else f"a {rng.choice(['red', 'blue'])} dog"
            for ext, payload in (("jpg", _jpeg(i)), ("txt", captions[key].encode()), ("json", b"{}")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    deform = bow.Deformer(parse_bow_ops(["rm_stop_nalpha"]), seed=1, base_fraction=0.3, stats=None)
    emptied = [k for k, c in captions.items() if not deform(k, c)[0]]
    assert 0 < len(emptied) < 14  # base-split captions among the 14 stay intact
    everything = bow.Deformer(parse_bow_ops(["rm_stop_nalpha"]), seed=1, base_fraction=0.3, stats=None,
                              keep_base_intact=False)  # [BoW] Table 4's 100% BoW: the base split deformed too
    assert len([k for k, c in captions.items() if not everything(k, c)[0]]) == 14
    assert not any(everything(k, c)[1] for k, c in captions.items())

    report = "test-bow-empty"
    create_report(report)
    rows = _pipeline(str(tmp_path), deform, report_name=report, shuffle_files=False).take_all()
    counts = ray.get(report_actor(report).snapshot.remote())["counts"]
    assert counts["dropped_bow_empty"] == len(emptied) and len(rows) == 40 - len(emptied)
    assert counts["bow_captions_in"] == 40 and counts["samples_kept"] == len(rows)
    assert counts["bow_words_in"] == sum(len(c.split()) for c in captions.values())
    assert counts["caption_words"] == sum(len(r["caption"].split()) for r in rows)
    assert {r["key"] for r in rows} == set(captions) - set(emptied)


def test_preview_reuses_a_saved_artifact(ray_local, demo_dir, tmp_path, capsys, caplog):
    from rayvl.cli import main

    stats_file = tmp_path / "stats.json"
    args = ["bow", "preview", "--data", str(demo_dir / "train"), "-n", "5", "--stats", str(stats_file)]
    with caplog.at_level("INFO", logger="rayvl"):  # the statistics pass's progress lines (logger rayvl)
        assert main(args) == 0
        assert "BoW statistics computed" in caplog.text
        caplog.clear()
        capsys.readouterr()
        assert main(args) == 0
        assert "BoW statistics reused" in caplog.text
    out = capsys.readouterr().out
    assert "5 captions:" in out
    assert sum(line.strip().startswith("→") for line in out.splitlines()) == 5
