"""The embedded dataset is deterministic and written in img2dataset's layout exactly."""
import io
import re
import json
import tarfile

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from rayvl.data.demo import SHAPES, write_demo
from rayvl.data.paraphrases import INVERSE, SENSES, _articles, _reorder, rephrase, synonyms


def test_img2dataset_layout(demo_dir):
    train = demo_dir / "train"
    assert sorted(p.name for p in train.iterdir()) == [
        "00000.parquet", "00000.tar", "00000_stats.json", "00001.parquet", "00001.tar", "00001_stats.json",
        "00002.parquet", "00002.tar", "00002_stats.json"]
    with tarfile.open(train / "00001.tar") as tar:
        names = tar.getnames()
        assert names[:3] == ["000010000.jpg", "000010000.txt", "000010000.json"]
        assert len(names) == 3 * 128
        meta = json.loads(tar.extractfile("000010000.json").read())
        text = tar.extractfile("000010000.txt").read().decode()
        img = Image.open(io.BytesIO(tar.extractfile("000010000.jpg").read()))
    assert img.format == "JPEG" and img.size == (112, 112)
    assert meta["key"] == "000010000" and meta["caption"] == text and meta["status"] == "success"
    table = pq.read_table(train / "00001.parquet")
    assert {"key", "url", "caption", "status", "width", "height", "sha256"} <= set(table.column_names)
    assert table.num_rows == 128
    stats = json.loads((train / "00001_stats.json").read_text())
    assert stats["count"] == stats["successes"] == 128


def test_eval_split_classes_and_paraphrases(demo_dir):
    classes = json.loads((demo_dir / "classes.json").read_text())
    assert classes["classes"] == SHAPES and all("{}" in t for t in classes["templates"])
    pairs = [json.loads(x) for x in (demo_dir / "paraphrases.jsonl").read_text().splitlines()]
    assert len(pairs) == 64
    assert all(p["caption"] != p["paraphrase"] and len(p["expansions"]) == 3 for p in pairs)
    table = pq.read_table(demo_dir / "eval" / "00000.parquet")
    # the first half paraphrases the held-out images' own captions, the second half 2–3 object scenes
    assert [p["caption"] for p in pairs[:32]] == table["caption"].to_pylist()[:32]
    assert all(" and " in p["caption"] or any(f" {r} " in p["caption"] for r in INVERSE) for p in pairs[32:])
    # each held-out caption names its class (the single object's shape)
    for caption, cls in zip(table["caption"].to_pylist(), table["cls"].to_pylist()):
        assert SHAPES[cls] in caption


def test_paraphrase_edits():
    """WordNet synonyms of the pinned sense only; relations swapped for their inverse; list items permuted."""
    lexicon = synonyms()
    assert set(lexicon) == set(SENSES)
    assert lexicon["diamond"] == ["rhombus", "rhomb"] and "halo" in lexicon["ring"] and lexicon["large"] == ["big"]
    assert "cherry-red" not in lexicon["red"] and "crimson" in lexicon["red"]  # narrower colours stay out
    rng = np.random.default_rng(0)
    assert _reorder("a small red circle to the left of a blue square", rng) == \
        "a blue square to the right of a small red circle"
    assert _reorder("a star above a large ring", rng) == "a large ring below a star"
    listed = _reorder("a star, a ring and a cross", rng)
    assert listed != "a star, a ring and a cross" and sorted(listed.replace(" and ", ", ").split(", ")) == \
        ["a cross", "a ring", "a star"]
    caption = "there is a small orange circle to the left of a large white ring"
    outs = [rephrase(caption, np.random.default_rng(seed), lexicon) for seed in range(200)]
    assert caption not in outs and len(set(outs)) > 150
    # meaning kept: the same objects in some order, whatever the words chosen for them
    rings = ["ring", *lexicon["ring"]]
    for out in outs:
        ring = min(out.find(f" {w}") for w in rings if f" {w}" in out)
        assert out.count("orang") == 1 and ("left of" in out) == (out.index("orang") < ring), out
        assert not re.search(r"\ba [aeiou]|\ban [^aeiou]", out), out  # articles agree after the edits
    assert _articles("a orange circle and an big ring") == "an orange circle and a big ring"


def test_captions_are_varied_english(demo_dir):
    captions = pq.read_table(demo_dir / "train" / "00000.parquet")["caption"].to_pylist()
    assert len(set(captions)) > 0.9 * len(captions)
    joined = " ".join(captions)
    for phrase in ("to the left of", "above", "a small", "there is"):
        assert phrase in joined


def test_deterministic(tmp_path):
    a = write_demo(tmp_path / "a", samples=20, eval_samples=5, seed=3)
    b = write_demo(tmp_path / "b", samples=20, eval_samples=5, seed=3)
    assert (a / "train" / "00000.tar").read_bytes() == (b / "train" / "00000.tar").read_bytes()
    assert (a / "paraphrases.jsonl").read_text() == (b / "paraphrases.jsonl").read_text()


def test_cli_writes_demo(tmp_path):
    from rayvl.cli import main

    assert main(["data", "demo", "--out", str(tmp_path / "d"), "--samples", "30", "--eval-samples", "4",
                 "--shard-size", "16"]) == 0
    assert sorted(p.name for p in (tmp_path / "d" / "train").glob("*.tar")) == ["00000.tar", "00001.tar"]
    assert (tmp_path / "d" / "classes.json").exists() and (tmp_path / "d" / "paraphrases.jsonl").exists()


def test_expected_samples_are_img2dataset_successes(demo_dir, tmp_path):
    """The pass size a run plans with: rows whose img2dataset status is success, summed over the shards' parquets."""
    import shutil

    import pyarrow as pa

    from rayvl.data.shards import expected_samples

    assert expected_samples(str(demo_dir / "train")) == 384
    for name in ("00000", "00001"):
        shutil.copy(demo_dir / "train" / f"{name}.tar", tmp_path)
        table = pq.read_table(demo_dir / "train" / f"{name}.parquet")
        if name == "00001":  # 3 downloads failed
            status = ["failed_to_download"] * 3 + table.column("status").to_pylist()[3:]
            table = table.set_column(table.column_names.index("status"), "status", pa.array(status))
        pq.write_table(table, tmp_path / f"{name}.parquet")
    assert expected_samples(str(tmp_path)) == 128 + 125
    (tmp_path / "00001.parquet").unlink()  # a shard without its parquet counts as the counted ones average
    assert expected_samples(str(tmp_path)) == 256
    # an interrupted img2dataset's parquet (no footer): left out and said, not a crash before Ray starts
    cut = tmp_path / "00000.parquet"
    cut.write_bytes(cut.read_bytes()[:300])
    from rayvl.data.shards import pass_size

    size, how = pass_size(sorted(str(p) for p in tmp_path.glob("*.tar")))
    assert size is None and how.startswith(f"1 parquet files beside the shards are unreadable (e.g. {cut}")
    # open_clip's sizes.json beside the shards, when it names every one, is the pass's size where img2dataset's
    # files give none (the parquets here are cut and missing); one that misses a shard, or is not JSON, is not used
    from rayvl.data.shards import samples_per_pass

    shards = sorted(str(p) for p in tmp_path.glob("*.tar"))
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 100, "00001.tar": 20, "00009.tar": 7}))
    assert samples_per_pass(0, shards) == (120, "the shards' folder's sizes.json (open_clip's)")
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 100}))
    assert samples_per_pass(0, shards)[0] != 100 and samples_per_pass(0, shards[:1])[0] == 100
    (tmp_path / "sizes.json").write_text("{not json")
    assert samples_per_pass(0, shards[:1])[0] != 100
