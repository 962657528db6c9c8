"""UniCL data ([UniCL] §3, App. B.2): prompts from CLIP's 80 templates, image-label shards and Fashion-MNIST
with held-out classes excluded and counted, balanced 1:1 batches in training, and the CE-style baseline."""
import io
import json
import tarfile

import numpy as np
import pytest
import ray

from conftest import small_config
from rayvl import assets
from rayvl.config import ConfigError, load_config
from rayvl.data import fashion_mnist, shards
from rayvl.data.pipeline import Rows
from rayvl.data.shards import Reading
from rayvl.methods.unicl.rows import Prompted, prompt_batch
from rayvl.methods.unicl.prompts import Prompts, load_prompts
from rayvl.data.prompts import templates as prompt_templates
from rayvl.data.report import create_report, report_actor



def test_prompts_use_clip_templates_and_train_classes():
    templates = prompt_templates()
    assert len(templates) == 80 and all(t.count("{}") == 1 for t in templates)
    p = load_prompts("", "", [0, 2], fashion_mnist.CLASSES)
    assert p.train_classes == {0, 2} and len(p.classes) == 10
    rng = np.random.default_rng(0)
    captions = {p.caption(2, rng) for _ in range(200)}
    assert len(captions) > 40 and all("pullover" in c for c in captions)  # one template drawn per sample
    with pytest.raises(ValueError, match="train_classes"):
        load_prompts("", "", [12], fashion_mnist.CLASSES)


def test_ce_and_mixing_options_are_checked_before_ray():
    with pytest.raises(ConfigError, match="loss.kind: ce goes with model.text_tower"):
        load_config(None, ["loss.kind=ce"])
    with pytest.raises(ConfigError, match="image_label.weight=1.0"):
        load_config(None, ["loss.kind=ce", "model.text_tower=class_embedding", "image_label.data=fashion-mnist"])
    with pytest.raises(ConfigError, match="image_label.weight: must be in"):
        load_config(None, ["image_label.weight=0"])
    # the dry run's batch line: the image-label rows each micro-batch takes from their own stream, and the steps a
    # pass of the demo's 384 image-text samples lasts with the 8 left of each micro-batch
    from rayvl.dry_run import describe

    plan = describe(load_config(None, ["image_label.data=fashion-mnist", "image_label.weight=0.5",
                                       "train.micro_batch_size=16", "data.demo_samples=384"]))
    assert "2 workers × 16 per micro-batch × 1 accumulated = 32 samples a step (8 image_label rows per micro-batch)" \
        in plan and "  24 steps a pass;" in plan


def _jpeg(seed):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_image_label_shards_get_prompts_and_labels(ray_local, tmp_path):
    with tarfile.open(tmp_path / "00000.tar", "w") as tar:
        for i in range(12):
            meta = {} if i == 11 else {"cls": i % 3}  # sample 11 carries no class: dropped and counted
            for ext, payload in (("jpg", _jpeg(i)), ("json", json.dumps(meta).encode())):
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    prompts = Prompts(("cat", "dog", "bird"), prompt_templates(), frozenset({0, 1}))
    create_report("test-labels")
    rows = shards.read_shards(str(tmp_path), Rows(image_size=32, crop_scale_min=0.5, train=True,
                                                  tokenizer_path=str(assets.text_model_path("minilm-l6")),
                                                  max_tokens=16, transforms=(Prompted(prompts),)),
                              Reading(read_cpus=0.5, batch_size=4, report_name="test-labels")).take_all()
    counts = ray.get(report_actor("test-labels").snapshot.remote())["counts"]
    assert sorted(r["label"] for r in rows) == [0] * 4 + [1] * 4
    assert all(("cat" if r["label"] == 0 else "dog") in r["caption"] for r in rows)
    assert counts["excluded_held_out_class"] == 3 and counts["dropped_missing_cls"] == 1
    assert counts["samples_seen"] == 12 and counts["samples_kept"] == 8


def test_fashion_mnist_rows_exclude_held_out_classes(ray_local):
    prompts = load_prompts("", "", [0, 1, 2], fashion_mnist.CLASSES)
    ds = fashion_mnist.rows(*fashion_mnist.read("fashion-mnist", "t10k"), "t10k").limit(300)
    batch = ds.take_batch(300, batch_format="numpy")
    out = prompt_batch(batch, prompts=prompts, image_size=32, crop_scale_min=0.6,
                               tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=16,
                               report_name=None)
    keep = np.isin(batch["cls"], [0, 1, 2])
    assert out["label"].tolist() == batch["cls"][keep].tolist() and out["image"].shape[1:] == (3, 32, 32)
    assert all(fashion_mnist.CLASSES[c] in t for c, t in zip(out["label"], out["caption"]))


def test_the_image_label_stream_reads_what_the_run_needs_in_a_seeded_order(ray_local):
    """The Fashion-MNIST stream stops after the rows the run trains on (steps × accumulation × ranks × image-label
    rows per micro-batch, + one micro-batch per rank), not a whole epoch ahead of training; each seed draws its
    own photos, every one of a training class."""
    from rayvl.methods.unicl.rows import labeled_dataset
    from rayvl.methods.unicl.rows import resolve_prompts as image_label_prompts

    def keys(seed: int) -> list[str]:
        cfg = load_config(None, ["image_label.data=fashion-mnist", "image_label.train_classes=[0, 2, 4]",
                                 "image_label.weight=0.5", "train.micro_batch_size=8", "train.num_workers=2",
                                 "train.max_steps=5", "train.warmup_steps=1", "train.grad_accumulation=2",
                                 "data.image_size=32",
                                 f"train.seed={seed}", "loss.kind=unicl"])
        rows = labeled_dataset(cfg, image_label_prompts(cfg), None).take_all()
        assert set(rows[0]) == {"image", "input_ids", "attention_mask", "label"}
        assert {int(r["label"]) for r in rows} <= {0, 2, 4}
        return [r["image"].tobytes() for r in rows]

    a, b = keys(0), keys(1)
    assert len(a) == len(b) == (5 * 2 + 1) * 2 * 4
    assert len(set(a) & set(b)) < len(a) // 4  # other photos (the same few by chance at most)


def _check_image_label_stream(result, share: float, steps: list[int]) -> None:
    """Every micro-batch of the run holds exactly ``share`` image-label rows ([UniCL] App. B.2), and its data report
    counts what that stream read."""
    from rayvl.data.report import format_data_report

    history = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == steps and all(np.isfinite(h["loss"]) for h in history)
    assert all(h["labelled_share"] == share for h in history)
    lab = result.data_report["image_label"]["counts"]
    assert lab["samples_kept"] > 0 and lab["excluded_held_out_class"] > 0
    assert "image-label: seen" in format_data_report(result.data_report)


def test_unicl_mixes_half_image_label_rows_into_every_batch(unicl_mixed_run):
    """The session's UniCL run (conftest.UNICL_MIXED: 2 workers, a memory bank, bf16)."""
    _check_image_label_stream(unicl_mixed_run, 0.5, [1, 2, 3])
    assert "eval" in unicl_mixed_run.data_report


def test_ce_baseline_trains_on_image_label_rows_only(ray_local, demo_dir, tmp_path):
    """One worker: the mixed run above has two, and the CE objective reads no other rank's rows."""
    from rayvl.train.trainer import train

    result = train(small_config(demo_dir, tmp_path, "train.num_workers=1", "image_label.data=fashion-mnist",
                                "image_label.limit=1000", "image_label.train_classes=[0, 2, 4, 6]", "train.max_steps=2",
                                "loss.kind=ce",
                                "model.text_tower=class_embedding", "image_label.weight=1.0", "eval.tasks=[]"))
    _check_image_label_stream(result, 1.0, [1, 2])
    assert "eval" not in result.data_report  # the CE run reads no held-out split


def test_a_class_embedding_model_gets_its_classes_from_the_data_and_no_part_rewrites_the_config():
    """[UniCL] eq. (4)'s class embeddings: the driver sets model.num_classes from what a method's data part states
    (DataPart.classes); a part has no hook that returns a changed config."""
    from rayvl.config import load_config
    from rayvl.data.parts import DataPart
    from rayvl.methods.unicl.rows import UniclData
    from rayvl.train.datasets import with_classes

    class Ten(DataPart):
        def classes(self) -> int:
            return 10

    ce = load_config(None, ["loss.kind=ce", "model.text_tower=class_embedding", "image_label.data=fashion-mnist",
                            "image_label.weight=1.0", "eval.tasks=[]"])
    assert with_classes(ce, [DataPart(), Ten()]).model.num_classes == 10
    clip = load_config(None, [])
    assert with_classes(clip, [Ten()]) is clip  # a text tower of its own: nothing to set
    assert not any(hasattr(c, "run_config") for c in (DataPart, UniclData))


def test_held_out_confusion_and_recall_against_a_loop():
    """rayvl.methods.unicl.class_split.confusion: choosing among the held-out classes only, each row the share of a true
    class's images predicted as each class."""
    import torch

    from rayvl.methods.unicl.class_split import confusion, top1

    g = torch.Generator().manual_seed(0)
    class_emb = torch.nn.functional.normalize(torch.randn(10, 16, generator=g), dim=1)
    labels = torch.randint(0, 10, (400,), generator=g)
    image_emb = class_emb[labels] + 0.9 * torch.randn(400, 16, generator=g)
    held, names = [1, 5, 8], [f"c{i}" for i in range(10)]
    out = confusion(image_emb, labels, class_emb, held, names)
    for t in held:
        rows = [i for i in range(400) if labels[i] == t]
        preds = [max(held, key=lambda c: float(image_emb[i] @ class_emb[c])) for i in rows]
        for q in held:
            assert out["zs_heldout_confusion"][f"c{t}"][f"c{q}"] == pytest.approx(100 * preds.count(q) / len(rows))
        assert out[f"zs_heldout_recall_c{t}"] == out["zs_heldout_confusion"][f"c{t}"][f"c{t}"]
        assert sum(out["zs_heldout_confusion"][f"c{t}"].values()) == pytest.approx(100.0)
    counts = [int((labels == t).sum()) for t in held]
    recall = sum(out[f"zs_heldout_recall_c{t}"] * n for t, n in zip(held, counts)) / sum(counts)
    assert top1(image_emb, labels, class_emb, held) == pytest.approx(recall)


def test_captioned_pairs_for_concept_coverage(tmp_path):
    """[UniCL] Tables 5–6 at toy size: pairs from photos the labelled set does not read (index ≥ first), captions
    naming their garment in other words than the prompt templates; ``covered`` the same number per class over all 10
    classes, ``uncovered`` as many pairs over the training classes only; written once, rewritten when asked for
    other ones."""
    import io as _io

    from PIL import Image

    from rayvl.methods.unicl import fashion_captions
    from rayvl.data.tar import iter_tar_samples

    pixels, labels = fashion_mnist.read("fashion-mnist")
    held = [1, 5, 8]
    picked = fashion_captions.pick(labels, 50_000, held)
    covered, uncovered = (np.bincount(labels[picked[k]], minlength=10) for k in ("covered", "uncovered"))
    assert covered.sum() == uncovered.sum() > 6000 and len(set(covered)) == 1  # the same per class
    assert all(uncovered[c] == 0 for c in held) and len({uncovered[c] for c in range(10) if c not in held}) == 1
    assert min(picked["covered"].min(), picked["uncovered"].min()) >= 50_000

    root = fashion_captions.ensure_coverage(tmp_path, 58_000, held)
    done = json.loads((root / "DONE.json").read_text())
    for name in ("covered", "uncovered"):
        samples = [s for tar in sorted((root / name).glob("*.tar")) for s in iter_tar_samples(open(tar, "rb"))]
        assert len(samples) == sum(done["counts"][name].values()) > 0
        templates = {t.format("").strip() for t in prompt_templates()}
        for s in samples:
            meta, text = json.loads(s["json"]), s["txt"].decode()
            index = int(meta["url"].rsplit("/", 1)[1])
            assert index >= 58_000 and meta["cls"] == labels[index]
            stem = fashion_mnist.CLASSES[meta["cls"]].rstrip("s")  # "trousers", "a pair of ankle boots", "handbag"
            assert stem in text and text not in templates
            assert (name == "covered") or not any(fashion_mnist.CLASSES[c] in text for c in held)
            image = np.asarray(Image.open(_io.BytesIO(s["img"])).convert("L"), np.float64)
            assert np.abs(image - pixels[index]).mean() < 4  # the photo itself (JPEG at quality 95)
    assert sum(done["counts"]["covered"][fashion_mnist.CLASSES[c]] for c in held) > 0
    mtime = (root / "DONE.json").stat().st_mtime_ns
    assert fashion_captions.ensure_coverage(tmp_path, 58_000, held) == root
    assert (root / "DONE.json").stat().st_mtime_ns == mtime  # reused
    fashion_captions.ensure_coverage(tmp_path, 59_000, held)
    assert json.loads((root / "DONE.json").read_text())["first"] == 59_000  # other pairs asked for: rewritten
