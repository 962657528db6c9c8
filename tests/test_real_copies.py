"""Shards as real copies of LAION come: images as webp, png or jpeg members (img2dataset's ``--encode_format``,
webdataset mirrors), a DataComp-style parquet beside a shard, no metadata at all — and shards whose images rayvl
cannot read, which the data check and the dry run refuse before Ray starts."""
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from conftest import cli, small_config
from rayvl.data.tar import iter_tar_samples

PER_SHARD = 32
TIFF_ONLY = 4  # samples of the last shard whose only image is a .tiff member: dropped_missing_image


def _write(folder, name: str, samples: list[dict], ext: str, meta: str, json_member: bytes | None = None) -> None:
    """A shard of ``samples`` with their image re-encoded as ``ext`` (its case kept in the member name) and ``meta``
    beside it: "img2dataset" (parquet with status, stats file), "datacomp" (uid, url, text) or "none"."""
    fmt = {"webp": "WEBP", "png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "tiff": "TIFF"}[ext.lower()]
    with tarfile.open(folder / f"{name}.tar", "w") as tar:
        for i, s in enumerate(samples):
            image = io.BytesIO()
            with Image.open(io.BytesIO(s["img"])) as img:
                (img.convert("P") if fmt == "PNG" else img).save(image, fmt)  # a palette PNG, as many are
            member = "tiff" if meta == "none" and i < TIFF_ONLY else ext
            for suffix, payload in ((member, image.getvalue()), ("txt", s["txt"]), ("json", json_member or s["json"])):
                info = tarfile.TarInfo(f"{s['key']}.{suffix}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    rows = [{"key": s["key"], "caption": s["txt"].decode()} for s in samples]
    if meta == "img2dataset":
        pq.write_table(pa.Table.from_pylist([{**r, "status": "success"} for r in rows]), folder / f"{name}.parquet")
        (folder / f"{name}_stats.json").write_text(json.dumps({"successes": len(rows)}))
    elif meta == "datacomp":  # every URL of the pool, downloaded or not: twice the shard's samples
        pq.write_table(pa.Table.from_pylist([{"uid": f"{i:032x}", "url": f"https://example.com/{i}.jpg",
                                              "text": "a caption"} for i in range(2 * len(rows))]),
                       folder / f"{name}.parquet")


@pytest.fixture(scope="module")
def copies(demo_dir, tmp_path_factory):
    """Four shards of the demo's first 128 samples: webp and png (uppercase members, a palette image) with
    img2dataset's files, jpeg with a DataComp parquet, jpg with no metadata (4 samples with only a .tiff); and a
    folder of .tiff shards."""
    with open(demo_dir / "train" / "00000.tar", "rb") as f:
        samples = list(iter_tar_samples(f))[:4 * PER_SHARD]
    out = tmp_path_factory.mktemp("copies")
    (out / "tiff").mkdir()
    (out / "held_out").mkdir()  # captioned, without the `cls` field zero-shot needs
    _write(out / "held_out", "00000", samples[:PER_SHARD], "jpg", "img2dataset", json_member=b"{}")
    for i, (ext, meta) in enumerate((("webp", "img2dataset"), ("PNG", "img2dataset"), ("jpeg", "datacomp"),
                                     ("jpg", "none"))):
        _write(out, f"{i:05d}", samples[i * PER_SHARD:(i + 1) * PER_SHARD], ext, meta)
        _write(out / "tiff", f"{i:05d}", samples[i * PER_SHARD:(i + 1) * PER_SHARD], "tiff", "img2dataset")
    return out


def test_shards_of_every_image_format_and_metadata_are_checked_and_trained_with_exact_counts(
        ray_local, copies, demo_dir, tmp_path, capsys, monkeypatch):
    from rayvl.data.report import format_data_report
    from rayvl.train.trainer import train

    spec = f"{copies}/{{00000..00003}}.tar"
    code, out, err = cli(capsys, "data", "check", spec, "-n", "4")
    assert code == 0, err
    # the two img2dataset parquets count, for the four shards (the DataComp one is named and not counted, the last
    # shard has none): their average times four
    assert ("128 samples a pass (counted in the img2dataset parquet files of 2 of 4 local shards, extrapolated; 1 "
            "parquet files beside the shards are not img2dataset's (no status column): not counted)") in out
    assert f"00000.tar: {demo_key(copies)}: 112×112 webp, '" in out
    assert f"of the first 32 samples of the first and the last shard: dropped_missing_image {TIFF_ONLY}, kept " \
           f"{2 * PER_SHARD - TIFF_ONLY}" in out

    # the dry run of a run that says what a pass holds, with a demo-sized budget, its model and its evaluation
    budget = [f"data.samples_per_pass={4 * PER_SHARD}", "train.micro_batch_size=16", "train.max_steps=2",
              "train.warmup_steps=1", f"data.classes={demo_dir / 'classes.json'}"]
    code, out, err = cli(capsys, "train", "--dry-run", "--data", spec, "--eval-data", str(copies / "held_out"),
                          *[x for setting in budget for x in ("--set", setting)])
    assert code == 0, err
    assert f"{4 * PER_SHARD} samples a pass (data.samples_per_pass)" in out
    assert "4 steps a pass; train.max_steps=2 is 0.50 passes" in out
    # the demo-sized budget this command line set is its own choice: only what the recipe left is warned of
    warnings = [line.strip() for line in out.splitlines() if "warning:" in line]
    assert [w.split(" — ")[0] for w in warnings] == ["warning: evaluation only at the last step (eval.every_steps=0)"]
    assert ("image tower efficientnet-lite0 (pretrained, the package's weights): 3,371,008 trainable parameters\n"
            "  text tower minilm-l6, pretrained, frozen_alignment: ") in out
    assert "AdamW lr 0.001, betas 0.9/0.98, weight decay 0.1; linear warm-up over 1 steps, cosine decay to 0 at " \
           "step 2" in out
    assert ("evaluation: at the last step only\n"
            "  zeroshot: skipped: none of the first 32 held-out samples has a class (a `cls` or `npy` member, a JSON field)\n"
            "  retrieval: runs\n"
            "  paraphrase: skipped: no paraphrase file (data.paraphrases)\n"
            "  sts: skipped: no STS file (data.sts)\n") in out

    # one run over all four: every format decoded, the .tiff-only samples dropped and counted, per pass exactly. Its
    # Ray Train polls every second (a user's setting, which rayvl keeps): each report waits for a poll, and what the
    # reports say still covers the wall time between them (samples/s of the steps and the waits alike)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1")
    steps = (4 * PER_SHARD - TIFF_ONLY) // 16  # 1 worker × 16 rows (the formats are read the same for any rank)
    result = train(small_config(demo_dir, tmp_path, f"data.train={spec}", f"data.samples_per_pass={4 * PER_SHARD}",
                                "train.num_workers=1", "train.micro_batch_size=16",
                                f"train.max_steps={steps}", f"train.checkpoint_every={steps}", "eval.tasks=[]",
                                "data.shuffle_files=false"))
    counts = result.data_report["counts"]
    passes = counts["samples_seen"] // (4 * PER_SHARD)
    assert passes >= 1 and counts["samples_seen"] == passes * 4 * PER_SHARD  # whole passes read, every sample seen
    assert {k: v for k, v in counts.items() if k.startswith("format_")} == {
        "format_webp": passes * PER_SHARD, "format_png": passes * PER_SHARD,
        "format_jpg": passes * (2 * PER_SHARD - TIFF_ONLY)}  # .jpeg and .jpg members are one format
    assert counts["dropped_missing_image"] == passes * TIFF_ONLY
    assert counts["samples_kept"] == passes * (4 * PER_SHARD - TIFF_ONLY)
    assert result.data_report["pass_size_from"] == "data.samples_per_pass"
    position = result.data_report["position"]
    assert sum(position["rows_per_pass"].values()) == steps * 16 and position["duplicates"] == 0
    text = format_data_report(result.data_report)
    assert f"a pass holds {4 * PER_SHARD} samples: data.samples_per_pass" in text
    assert f"images: jpg {passes * 60}, png {passes * PER_SHARD}, webp {passes * PER_SHARD}" in text
    history = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, steps + 1))
    # reports 4-6 (a step each, no checkpoint): their windows end to end against the driver's clock from report 3 to
    # 6, which adds the difference of two reports' ways to the driver — each up to two polls (one report queued, one
    # waiting to be), alike once the run's reports wait in step — and the tenths elapsed_s is rounded to
    windows = sum(16 / h["samples_per_s"] for h in history[3:6])
    assert windows == pytest.approx(history[5]["elapsed_s"] - history[2]["elapsed_s"], abs=1.5)


def demo_key(copies) -> str:
    with open(copies / "00000.tar", "rb") as f:
        return next(iter_tar_samples(f))["key"]


def test_shards_without_an_image_rayvl_reads_are_refused_naming_their_members(copies, demo_dir, capsys):
    spec = f"{copies}/tiff/{{00000..00003}}.tar"
    for argv in (["data", "check", spec], ["train", "--dry-run", "--data", spec, "--eval-data", str(demo_dir / "eval")]):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "64 of the 64 samples read from the start of its first and last shards would be dropped for their " \
               "image (dropped_missing_image 64)" in err
        assert "members: .json in 32, .tiff in 32, .txt in 32 — rayvl reads images from jpg, png, jpeg, webp" in err
    # a local shard with no metadata: the size of a pass is estimated from its first shard's members, and what
    # gives it exactly is named
    code, out, err = cli(capsys, "data", "check", f"{copies}/00003.tar")
    assert code == 0, err
    assert (f"{PER_SHARD} samples a pass (estimated: the first shard holds {PER_SHARD} samples, × 1 shard; no "
            f"img2dataset parquet or _stats.json files beside the shards — data.samples_per_pass gives it "
            f"exactly)") in out


def test_shards_on_object_storage_without_metadata_get_a_pass_size_from_the_first_shards_head(copies, s3, capsys,
                                                                                               monkeypatch):
    """No _stats.json beside shards on S3: the first shard is counted (one ranged read of at most ESTIMATE_BYTES) —
    whole when it fits, else its head's samples scaled to its size."""
    from rayvl.data import shards

    client = s3.client()
    for i in range(2):
        client.put_object(Bucket="rayvl-test", Key=f"nometa/{i:05d}.tar", Body=(copies / "00003.tar").read_bytes())
    spec = "s3://rayvl-test/nometa/{00000..00001}.tar"
    code, out, err = cli(capsys, "data", "check", spec, "-n", "1")
    assert code == 0, err
    assert (f"{2 * PER_SHARD} samples a pass (estimated: the first shard holds {PER_SHARD} samples, × 2 shards; no "
            f"img2dataset parquet or _stats.json files beside the shards — data.samples_per_pass gives it "
            f"exactly)") in out
    size = len((copies / "00003.tar").read_bytes())
    monkeypatch.setattr(shards, "ESTIMATE_BYTES", size // 2)  # the head of a shard larger than one read
    estimate, how = shards.remote_shard_samples("s3://rayvl-test/nometa/00000.tar")
    assert how.startswith("holds ≈ (") and abs(estimate - PER_SHARD) <= PER_SHARD // 4, (estimate, how)
