"""rayvl's evaluation scores as open_clip and CLIP_benchmark score: the crop is open_clip's evaluation transform
(against its own ``preprocess``), retrieval groups an image's captions (the lines of one caption, one photo under
several keys) and counts a query right as CLIP_benchmark does (a float64 reference over `rayvl eval`'s saved
embeddings), zero-shot averages open_clip's 80 templates where a set brings none, ImageFolder trees are listed as
torchvision's ImageFolder lists them, CLIP_benchmark's webdataset sets are read as CLIP_benchmark reads them."""
from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from rayvl.compat import ensure_torchvision_importable

ensure_torchvision_importable()  # open_clip and torchvision's datasets import it


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A smooth photo-like RGB image: noise upsampled, so every crop offset and filter tap shows in the pixels."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8))
    return small.resize((width, height), Image.BICUBIC)


@pytest.mark.parametrize("size", [224, 32])
def test_the_evaluation_crop_is_open_clips_preprocess(size):
    """Landscape, portrait, near-square, odd and upscaled shapes: rayvl's crop (the CPU path, `rayvl eval`'s and
    rayvl.load's) equals open_clip's evaluation transform pixel for pixel."""
    import open_clip

    from rayvl.data.images import centre_crop, crop

    theirs = open_clip.image_transform(size, is_train=False)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(3, 1, 1)
    for i, (w, h) in enumerate([(640, 427), (427, 640), (512, 600), (225, 224), (1000, 333), (97, 150), (300, 300),
                                (223, 1000), (1001, 999), (33, 61)]):
        img = photo(w, h, i)
        levels = ((theirs(img) * std + mean) * 255).round().to(torch.uint8).numpy()
        mine = crop(img, size, None)
        assert mine.shape == (3, size, size) and np.array_equal(mine, centre_crop(img, size))
        assert np.abs(mine.astype(int) - levels.astype(int)).max() == 0, (w, h)


def test_the_device_paths_evaluation_crop_is_the_whole_frame_resized_then_cut(demo_dir):
    """--decode device: a JPEG's evaluation crop travels as its bytes with the CENTRE box; the device path (its
    tensor code, run here on CPU tensors) resizes the whole frame and cuts its centre, within its stated tolerance
    of the CPU path's crop."""
    from rayvl import device_decode
    from rayvl.data import encoded_jpegs
    from rayvl.data.images import decode_and_crop

    jpegs = []
    for i, (w, h) in enumerate([(300, 220), (180, 260), (224, 224), (400, 301)]):
        out = io.BytesIO()
        photo(w, h, i).save(out, "JPEG", quality=95)
        jpegs.append(out.getvalue())
    prepared = [encoded_jpegs.prepare(d, 64, None, None) for d in jpegs]
    assert all(box == (encoded_jpegs.CENTRE,) * 4 for _, box in prepared)
    crops, ok = device_decode.decoded([d for d, _ in prepared], [b for _, b in prepared], 64, torch.device("cpu"))
    reference = np.stack([decode_and_crop(d, 64, None) for d in jpegs]).astype(int)
    diff = np.abs(crops.numpy().astype(int) - reference)
    assert ok.all() and diff.mean() <= 0.5 and np.percentile(diff, 99.9) <= 4


def _coco_style_shard(demo_dir, out) -> tuple[int, int]:
    """The demo's held-out images stored as COCO-style shards store them — each photo under 3 keys with a caption
    each — and 4 more samples whose text holds 2 captions, one a line (CLIP_benchmark's retrieval shards); (distinct
    images, captions)."""
    with tarfile.open(demo_dir / "eval" / "00000.tar") as src:
        members = {m.name: src.extractfile(m).read() for m in src if m.isfile()}
    stems = sorted(n[:-4] for n in members if n.endswith(".jpg"))[:24]
    images, captions = 0, 0
    with tarfile.open(out, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for i, stem in enumerate(stems):
            caption = members[f"{stem}.txt"].decode()
            copies = [caption, f"{caption} again", f"another view: {caption}"] if i < 20 else [
                f"{caption}\n  a second  caption of it \n"]
            for j, text in enumerate(copies):
                key = f"{i:04d}{j}"
                add(f"{key}.jpg", members[f"{stem}.jpg"])
                add(f"{key}.txt", text.encode())
                add(f"{key}.json", b"{}")
            images += 1
            captions += 3 if i < 20 else 2
    return images, captions


def _clip_benchmark_recall(images: np.ndarray, texts: np.ndarray, positive: np.ndarray, k: int) -> tuple[float, float]:
    """CLIP_benchmark's zeroshot_retrieval: scores = texts @ images.T, positive pairs a (texts, images) matrix; a
    text is right when any of its positive images is in its top k, an image when any of its positive texts is."""
    scores = texts.astype(np.float64) @ images.astype(np.float64).T
    top_images = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    t2i = np.take_along_axis(positive, top_images, axis=1).any(1).mean()
    top_texts = np.argsort(-scores.T, axis=1, kind="stable")[:, :k]
    i2t = np.take_along_axis(positive.T, top_texts, axis=1).any(1).mean()
    return 100 * t2i, 100 * i2t


def test_retrieval_groups_an_images_captions_as_clip_benchmark_does(demo_dir, tmp_path):
    """`rayvl eval` (one model in its process, no Ray) of COCO-style shards: each distinct image once in the
    gallery with all its captions, and R@k as CLIP_benchmark's rule gives it from the same saved embeddings."""
    from conftest import untrained_checkpoint
    from rayvl.cli import main

    shards = tmp_path / "coco"
    shards.mkdir()
    images, captions = _coco_style_shard(demo_dir, shards / "00000.tar")
    checkpoint = untrained_checkpoint(demo_dir, tmp_path / "ckpt") / "checkpoint_000000"
    out = tmp_path / "eval"
    assert main(["eval", str(checkpoint), "--tasks", "retrieval", "--data", str(shards), "--out", str(out)]) == 0
    scored = json.loads((out / "eval.json").read_text())["retrieval"]
    assert (scored["retrieval_images"], scored["retrieval_captions"]) == (images, captions) == (24, 68)
    rows = np.load(out / "image_embeddings.npy")  # a row a sample: 68 - 4 = 64
    texts = np.load(out / "caption_embeddings.npy")
    keys = json.loads((out / "keys.json").read_text())
    assert len(rows) == len(keys) == 64 and len(texts) == captions
    # the reference's own grouping, from the keys this test wrote: photo i is samples "i j", its captions in order
    photo_of_row = np.array([int(k[:4]) for k in keys])
    gallery = np.array([np.flatnonzero(photo_of_row == i)[0] for i in range(images)])
    text_photo = np.concatenate([[int(k[:4])] * (1 if int(k[:4]) < 20 else 2) for k in keys])
    positive = text_photo[:, None] == np.arange(images)[None, :]
    for k in (1, 5, 10):
        t2i, i2t = _clip_benchmark_recall(rows[gallery], texts, positive, k)
        assert scored[f"t2i_R@{k}"] == pytest.approx(t2i, abs=1e-9) and scored[f"i2t_R@{k}"] == pytest.approx(
            i2t, abs=1e-9), k


def test_zero_shot_averages_open_clips_80_templates_where_a_set_brings_none(tmp_path):
    """A class file without templates gets open_clip's 80 (its OPENAI_IMAGENET_TEMPLATES, in order); the single-
    template rows take CLIP's "a photo of a {}."."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    from rayvl.data.prompts import SINGLE_TEMPLATE, read_class_file

    path = tmp_path / "classes.json"
    path.write_text(json.dumps(["cat", "dog"]))
    classes, templates = read_class_file(path)
    assert classes == ["cat", "dog"] and len(templates) == 80
    assert [t.format("cat") for t in templates] == [t("cat") for t in OPENAI_IMAGENET_TEMPLATES]
    assert SINGLE_TEMPLATE in templates and templates.index(SINGLE_TEMPLATE) > 0


def test_an_image_folder_lists_what_torchvisions_image_folder_lists(tmp_path, capsys):
    """Subfolders, upper-case and .tif files are images; a .txt is left out and said."""
    from torchvision.datasets import ImageFolder

    from rayvl.eval.data import _imagefolder_files

    for path in ("cat/a.jpg", "cat/nested/b.PNG", "cat/c.tif", "dog/d.webp", "dog/deeper/more/e.jpeg"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        photo(8, 8, 0).save(tmp_path / path, "TIFF" if path.endswith(".tif") else "PNG")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    classes, files, labels = _imagefolder_files(str(tmp_path))
    theirs = ImageFolder(str(tmp_path))
    assert classes == theirs.classes and [(f, int(c)) for f, c in zip(files, labels)] == theirs.samples
    assert "left out 1 files" in capsys.readouterr().out


def test_a_quick_held_out_check_takes_its_first_distinct_images_with_all_their_captions():
    """EvalData.head(n), TOnICS's refresh signal: n distinct images (not n samples, of which COCO-style shards hold
    five an image), each with every caption it has."""
    from rayvl.data.pipeline import DIGEST
    from rayvl.eval.data import EvalData

    rows = {"key": np.array(["a", "b", "c", "d", "e"]), "caption": np.array(["x", "y\nz", "w", "v", "u"], object),
            "cls": np.arange(5), DIGEST: np.array([5, 5, 9, 5, 7])}
    data = EvalData(np.arange(5 * 3 * 2 * 2).reshape(5, 3, 2, 2), 0, np.zeros(0, np.int64)).with_rows(rows)
    assert data.captions == ["x", "y", "z", "w", "v", "u"] and list(data.caption_to_image) == [0, 0, 0, 1, 0, 2]
    two = data.head(2)
    assert two.size == 2 and two.keys == ["a", "c"] and list(two.labels) == [0, 2]
    assert two.captions == ["x", "y", "z", "w", "v"] and list(two.caption_to_image) == [0, 0, 0, 1, 0]
    assert np.array_equal(two.images, data.images[[0, 2]]) and list(two.retrieval_images()) == [0, 1]
    # an image kept for the class tasks with no caption (a classification set's, beside captioned ones) is neither
    # in the quick check nor searched by retrieval: its rows and captions are those of the images that have some
    mixed = EvalData(np.arange(5 * 3 * 2 * 2).reshape(5, 3, 2, 2), 0, np.zeros(0, np.int64)).with_rows(
        {**rows, "caption": np.array(["x", "", "w", "v", ""], object)})
    assert mixed.captions == ["x", "w", "v"] and list(mixed.retrieval_images()) == [0, 2, 4]
    searched, caption_to_image = mixed.captioned()
    assert list(searched) == [0, 2] and list(caption_to_image) == [0, 1, 0]
    one = mixed.head(1)
    assert one.keys == ["a"] and one.captions == ["x", "v"] and list(one.caption_to_image) == [0, 0]


def test_a_cls_member_is_the_class_and_a_held_out_sample_with_one_needs_no_caption(demo_dir):
    """webdataset's ``cls`` member (CLIP_benchmark's and ImageNet-style classification shards) is a sample's class,
    before its JSON's; held out, a sample with a class and no caption is kept for the class tasks, one with neither
    dropped and counted; training still drops a sample without a caption (a method may source one: UniCL's prompts)."""
    from collections import Counter

    from rayvl import assets
    from rayvl.data.pipeline import Rows, class_of, label_vector, preprocess
    from rayvl.eval.data import from_batches

    with tarfile.open(demo_dir / "eval" / "00000.tar") as src:
        jpg = next(src.extractfile(m).read() for m in src if m.name.endswith(".jpg"))
    assert class_of({"cls": b"7", "json": b'{"cls": 3}'}) == 7 and class_of({"json": b'{"cls": 3}'}) == 3
    assert class_of({"cls": b"seven"}) == -1 and class_of({}) == -1
    # a multilabel set's npy member (a multi-hot vector, as webdataset saves an array): in a set of 4 classes
    # (Rows.label_vectors), a held-out row's label set; anything else that member may hold is no label
    assert label_vector(_saved(np.array([True, False]))).tolist() == [1, 0]
    for other in (np.array([1, -1, 0]), np.ones((2, 2)), np.array(["1", "0"]), np.array([0.5, 1.0])):
        assert label_vector(_saved(other)) is None, other  # VOC's devkit marks (-1/0/1), a matrix, text, scores
    npz = io.BytesIO()
    np.savez(npz, labels=np.array([0, 1]))
    assert label_vector(npz.getvalue()) is None and label_vector(b"\x93NUMPY, but cut") is None
    batch = {"key": ["a", "b", "c", "d"], "img": [jpg] * 4, "img_ext": ["jpg"] * 4,
             "txt": [None, None, b"a cat", None], "json": [None, None, b'{"cls": 1}', None],
             "cls": [b"4", None, None, None],
             "npy": [_saved(np.array([0, 1, 0, 1], np.float32)), None, b"\x93NUMPY, but cut", _saved(np.zeros(5))]}
    tokenizer = str(assets.text_model_path("minilm-l6"))
    for train, vectors, kept, dropped in ((False, 4, ["a", "c"], 2), (False, 0, ["a", "c"], 2),
                                          (True, 4, ["c"], 3)):
        counts: Counter = Counter()
        out = preprocess(batch, counts, Rows(16, 0.6, train, tokenizer, 8, label_vectors=vectors))
        assert list(out["key"]) == kept and counts["dropped_missing_caption"] == dropped, train
        assert list(out["cls"]) == ([4, 1] if not train else [1]) and counts["samples_kept"] == len(kept)
        if not train and vectors:  # no saved array, 5 entries of 4 classes: counted, that label set unknown
            assert list(out["label_set"]) == ["[1, 3]", ""] and counts["unreadable_label_vector"] == 2
            held_out = from_batches([out])  # as a training run's evaluation reads its rows
            assert held_out.multilabel and held_out.label_sets == [[1, 3], None] and held_out.labelled()
        else:  # training rows, and the held-out rows of any other set, carry none
            assert "label_set" not in out and "unreadable_label_vector" not in counts
    assert list(out["caption"]) == ["a cat"]


def _clip_benchmark_set(demo_dir, root, images: int = 24, retrieval: bool = False, train: int = 0,
                        multilabel: bool = False) -> list:
    """The demo's first held-out images as CLIP_benchmark's ``clip_benchmark_export_wds`` writes a set: lossless webp
    (the JPEG's pixels), keys s0000000…, two shards in ``test/`` with nshards.txt; a classification set has a
    ``cls`` member (the class index as text), classnames.txt and two templates with ``{c}``, and one more sample of
    a class id past the names; a retrieval set a ``txt`` of two captions, one a line, and dataset_type.txt. With
    ``train``, the next ``train`` held-out images are its ``train/`` split (one shard). Returns the test split's
    class ids, then the train split's. A ``multilabel`` set (VOC2007's layout) has an ``npy`` member instead of
    ``cls``: a float32 multi-hot vector (``_multi_hot``), saved as webdataset saves an array, and dataset_type.txt;
    its vectors are returned."""
    with tarfile.open(demo_dir / "eval" / "00000.tar") as src:
        members = {m.name: src.extractfile(m).read() for m in src if m.isfile()}
    stems = sorted(n[:-4] for n in members if n.endswith(".jpg"))
    classes = json.loads((demo_dir / "classes.json").read_text())["classes"]

    def write(split: str, chosen: list[str], shards: int, extra: list[int]) -> list[int]:
        (root / split).mkdir(parents=True)
        info = [json.loads(members[f"{s}.json"]) for s in chosen]
        labels = ([_multi_hot(x["cls"], i, len(classes)) for i, x in enumerate(info)] if multilabel
                  else [x["cls"] for x in info] + extra)
        for shard in range(shards):
            with tarfile.open(root / split / f"{shard}.tar", "w") as tar:
                for i in range(shard, len(labels), shards):
                    stem = chosen[i % len(chosen)]
                    webp = io.BytesIO()
                    Image.open(io.BytesIO(members[f"{stem}.jpg"])).save(webp, "webp", lossless=True)
                    caption = members[f"{stem}.txt"].decode()
                    other = (("txt", f"{caption}\nthe same picture".encode()) if retrieval else
                             ("npy", _saved(labels[i])) if multilabel else ("cls", str(labels[i]).encode()))
                    for ext, data in (("webp", webp.getvalue()), other):
                        info = tarfile.TarInfo(f"s{i:07d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        (root / split / "nshards.txt").write_text(f"{shards}\n")
        return labels

    labels = write("test", stems[:images], 2, [] if retrieval or multilabel else [len(classes) + 91])
    if train:
        labels += write("train", stems[images:images + train], 1, [])
    if retrieval or multilabel:
        (root / "dataset_type.txt").write_text("retrieval\n" if retrieval else "multilabel\n")
    if not retrieval:
        (root / "classnames.txt").write_text("\n".join(classes) + "\n")
        (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\na {c} in {braces}.\n")
    return labels


def _multi_hot(cls: int, i: int, classes: int) -> np.ndarray:
    """The image's class and, for every third image, the class 3 past it (the demo's scenes hold one shape each)."""
    vector = np.zeros(classes, np.float32)
    vector[[cls, (cls + 3) % classes] if i % 3 == 0 else [cls]] = 1
    return vector


def _saved(array: np.ndarray) -> bytes:
    """An array as webdataset writes an ``npy`` member (numpy's own format)."""
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_a_clip_benchmark_set_is_read_as_clip_benchmark_reads_it(demo_dir, tmp_path, capsys):
    """`rayvl eval --data ROOT` of a set in CLIP_benchmark's webdataset layout: its test split's shards, labels from
    their ``cls`` members, its class names and ``{c}`` templates — scoring exactly what the same images score as
    img2dataset shards with the class in their JSON and the same names and templates in a class file; a class id
    past the names is left out and counted; the linear probe trains on the set's train split, CLIP_benchmark's
    way, on the embeddings and classes it saved; ROOT/test names the same set; a retrieval set's captions are its
    lines; several sets in one command score as each alone; the folder works as training's held-out data;
    --kind clip_benchmark on other data and a --train-split the set lacks are refused, naming what is missing."""
    from conftest import untrained_checkpoint
    from rayvl.cli import main
    from rayvl.data.prompts import benchmark_template, read_class_file
    from rayvl.eval.linear_probe import ProbeSettings, ProbeTrain, clip_benchmark_probe
    from rayvl.eval.tasks import SKIP_REASONS

    assert benchmark_template(" a {c} in {braces}. ").format("cat") == "a cat in {braces}."
    root = tmp_path / "wds_shapes"
    labels = _clip_benchmark_set(demo_dir, root, train=30)
    classes, templates = read_class_file(root / "classnames.txt")
    assert templates == ["a photo of a {}.", "a {} in {{braces}}."] and len(classes) == 8
    checkpoint = untrained_checkpoint(demo_dir, tmp_path / "ckpt") / "checkpoint_000000"

    def scored(*args: str, tasks: str = "zeroshot,retrieval") -> dict:
        out = tmp_path / f"eval{len(list(tmp_path.glob('eval*')))}"
        assert main(["eval", str(checkpoint), "--tasks", tasks, *args, "--out", str(out)]) == 0, \
            capsys.readouterr().err
        return json.loads((out / "eval.json").read_text())

    ours = scored("--data", str(root), tasks="zeroshot,retrieval,linear_probe")
    assert ours["embedding"]["images"] == 25 and ours["skipped"] == {"retrieval": "the data has no captions"}
    zs = ours["zeroshot"]
    assert (zs["zeroshot_classes"], zs["zeroshot_templates"], zs["zeroshot_unlisted_images"]) == (8, 2, 1)
    # the linear probe, CLIP_benchmark's: trained on the train split's 30 images (their classes from their cls
    # members, embedded by the same model: the files it saved), scored on the test split's 25
    probe = ours["linear_probe"]
    assert (probe["linear_probe_protocol"], probe["linear_probe_train"], probe["linear_probe_test"]) == (
        "clip_benchmark", 30, 25)
    assert ours["probe_train"]["images"] == ours["probe_train"]["images_with_a_class"] == 30
    out = tmp_path / "eval0"
    train_labels = np.load(out / "probe_train_labels.npy")
    assert train_labels.tolist() == labels[25:]
    again = clip_benchmark_probe(ProbeTrain(np.load(out / "probe_train_embeddings.npy"), train_labels,
                                            ProbeSettings()), np.load(out / "image_embeddings.npy"), np.array(labels[:25]))
    assert again == probe

    # the same 24 images as img2dataset shards (JPEG, JSON cls, a caption), the names and templates in a class file
    plain = tmp_path / "plain"
    plain.mkdir()
    with tarfile.open(demo_dir / "eval" / "00000.tar") as src, tarfile.open(plain / "00000.tar", "w") as tar:
        members = {m.name: src.extractfile(m).read() for m in src if m.isfile()}
        for i, stem in enumerate(sorted(n[:-4] for n in members if n.endswith(".jpg"))[:24]):
            for ext in ("jpg", "txt", "json"):
                info = tarfile.TarInfo(f"s{i:07d}.{ext}")
                info.size = len(members[f"{stem}.{ext}"])
                tar.addfile(info, io.BytesIO(members[f"{stem}.{ext}"]))
    (tmp_path / "classes.json").write_text(json.dumps({"classes": classes, "templates": templates}))
    theirs = scored("--data", str(plain), "--classes", str(tmp_path / "classes.json"))["zeroshot"]
    assert {k: v for k, v in zs.items() if k != "zeroshot_unlisted_images"} == theirs

    # three sets in one command, CLIP_benchmark's way: one warm model, each set's results in its own folder, the
    # same numbers as alone, and a summary of their headline metrics; ROOT/test is ROOT's set; a retrieval set's
    # captions are the lines of its texts
    retrieval_root = tmp_path / "wds_captions"
    _clip_benchmark_set(demo_dir, retrieval_root, images=10, retrieval=True)
    both = tmp_path / "both"
    capsys.readouterr()
    assert main(["eval", str(checkpoint), "--tasks", "zeroshot,retrieval,linear_probe", "--data", str(root),
                 "--data", str(retrieval_root), "--data", str(root / "test"), "--out", str(both)]) == 0
    printed = capsys.readouterr().out
    here = {name: json.loads((both / name / "eval.json").read_text()) for name in ("wds_shapes", "wds_captions", "test")}
    assert {t: here["wds_shapes"].get(t) for t in ("zeroshot", "linear_probe", "skipped")} == {
        t: ours.get(t) for t in ("zeroshot", "linear_probe", "skipped")}
    assert here["test"]["zeroshot"] == zs and here["test"]["linear_probe"] == probe  # ROOT/test: ROOT's train split
    r = here["wds_captions"]
    assert (r["retrieval"]["retrieval_images"], r["retrieval"]["retrieval_captions"]) == (10, 20)
    # no labels: neither zero-shot nor the probe (a retrieval set has no train split to train one on)
    assert r["skipped"] == {"zeroshot": "no class names or labels", "linear_probe": SKIP_REASONS["linear_probe"]}
    assert all(f"##### {name}" in printed for name in here)
    summary = json.loads((both / "summary.json").read_text())["sets"]
    assert summary["wds_shapes"] == {"zeroshot_top1": zs["zeroshot_top1"], "zeroshot_top5": zs["zeroshot_top5"],
                                     "linear_probe_top1": probe["linear_probe_top1"], "images": 25}
    assert summary["wds_captions"] == {"i2t_R@5": r["retrieval"]["i2t_R@5"], "t2i_R@5": r["retrieval"]["t2i_R@5"],
                                       "images": 10}
    assert "##### summary" in printed and "linear probe top-1" in printed.split("##### summary")[1]
    # more shots than a class has: the probe is skipped, saying why (CLIP_benchmark: "insufficient data")
    few = scored("--data", str(root), "--fewshot-k", "20", tasks="linear_probe")
    assert few["skipped"]["linear_probe"].startswith("--fewshot-k 20: the train split has fewer than 20 images")
    # a split the probe is told to train on must be there (checked before anything is embedded)
    assert main(["eval", str(checkpoint), "--tasks", "linear_probe", "--data", str(root), "--train-split",
                 "val"]) == 2
    assert f"--train-split val: no such split beside {root}/test/{{0..1}}.tar" in capsys.readouterr().err

    # the same folder as a training run's held-out data: its split's shards, its class names, zero-shot runs
    assert main(["train", "--dry-run", "--data", str(demo_dir / "train"), "--eval-data", str(root)]) == 0
    out = capsys.readouterr().out
    assert "data.eval: 2 shards" in out and f"{root}/test/0.tar: s0000000: 112×112 webp, 'class " in out
    assert "  zeroshot: runs" in out and "  retrieval: skipped" in out

    assert main(["eval", str(checkpoint), "--data", str(plain), "--kind", "clip_benchmark"]) == 2
    assert "no nshards.txt in it or in its test/ folder" in capsys.readouterr().err


def _clip_benchmark_ap(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CLIP_benchmark's ``average_precision_per_class`` (zeroshot_classification.py), as it is written but for a
    stable sort: per class, the images sorted by score, the precision curve of the true ones' cumulative count,
    summed at the true ones."""
    ap = torch.zeros(scores.size(1), dtype=torch.float64)
    rg = torch.arange(1, scores.size(0) + 1).double()
    for k in range(scores.size(1)):
        _, sortind = torch.sort(scores[:, k], stable=True, dim=0, descending=True)
        truth = targets[:, k][sortind]
        precision = truth.double().cumsum(0).div(rg)
        ap[k] = precision[truth.bool()].sum() / max(float(truth.sum()), 1)
    return ap


def test_a_clip_benchmark_multilabel_set_is_scored_by_mean_average_precision(demo_dir, tmp_path, capsys):
    """A multilabel set as CLIP_benchmark's exporter writes VOC2007's (dataset_type.txt ``multilabel``, an ``npy``
    multi-hot vector a sample): `rayvl eval`'s zero-shot task is CLIP_benchmark's mean average precision over the
    classes — its loop, in float64, on the image embeddings rayvl saved and the same model's class embeddings —
    for the template ensemble and one template; an npy that is no multi-hot vector of the 8 classes is counted (its
    image, without a class or a caption, dropped); the linear probe is skipped saying why; the summary and the
    table give the mAP; a training run's dry run with the set as held-out data runs zero-shot; a multilabel set
    without class names is refused."""
    from conftest import untrained_checkpoint
    from rayvl import assets
    from rayvl.checkpoints import load_model
    from rayvl.cli import main
    from rayvl.eval.embed import ModelEmbedder
    from rayvl.eval.runner import headline
    from rayvl.eval.tables import format_eval_table

    root = tmp_path / "wds_shapes_multilabel"
    vectors = _clip_benchmark_set(demo_dir, root, images=20, multilabel=True)
    assert {int(v.sum()) for v in vectors} == {1, 2}  # scenes of one shape and of two
    with tarfile.open(root / "test" / "2.tar", "w") as tar:  # a third shard: keys after the others'
        with tarfile.open(root / "test" / "0.tar") as first:
            image = first.extractfile(first.getmember("s0000000.webp")).read()
        for key, label in (("s0000100", b"\x93NUMPY cut short"), ("s0000101", _saved(np.ones(9, np.float32))),
                           ("s0000102", _saved(np.array([1, -1, -1, -1, -1, -1, -1, -1], np.float32)))):
            for ext, data in (("webp", image), ("npy", label)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (root / "test" / "nshards.txt").write_text("3\n")
    checkpoint = untrained_checkpoint(demo_dir, tmp_path / "ckpt") / "checkpoint_000000"
    out = tmp_path / "eval"
    assert main(["eval", str(checkpoint), "--data", str(root), "--tasks", "zeroshot,linear_probe",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    ours = json.loads((out / "eval.json").read_text())
    zs = ours["zeroshot"]
    assert (zs["zeroshot_classes"], zs["zeroshot_templates"], zs["zeroshot_multilabel_images"]) == (8, 2, 20)
    assert "zeroshot_top1" not in zs
    assert ours["skipped"] == {"linear_probe": "a multilabel set (its images' classes from npy members): the linear "
                                               "probe fits one class an image"}
    assert (ours["data"]["unreadable_label_vector"], ours["data"]["dropped_missing_caption"]) == (3, 3)
    assert "zeroshot_mean_average_precision" in printed

    # CLIP_benchmark's numbers from the same embeddings: each class's prompts normalised, averaged, normalised again
    images = torch.from_numpy(np.load(out / "image_embeddings.npy")).double()
    assert len(images) == 20  # s00001xx: neither a class nor a caption, dropped (and counted)
    model, _ = load_model(checkpoint)
    embedder = ModelEmbedder(model, str(assets.text_model_path("minilm-l6")), 16)
    names = (root / "classnames.txt").read_text().split()
    templates = ["a photo of a {c}.", "a {c} in {braces}."]
    prompts = torch.from_numpy(embedder.texts([t.replace("{c}", c) for c in names for t in templates])).double()
    prompts = torch.nn.functional.normalize(prompts, dim=-1).reshape(8, 2, -1)
    targets = torch.from_numpy(np.stack(vectors))
    for key, per_class in (("zeroshot_mean_average_precision", prompts.mean(1)),
                           ("single_template_zeroshot_mean_average_precision", prompts[:, 0])):
        classifier = torch.nn.functional.normalize(per_class, dim=-1).T
        reference = 100 * _clip_benchmark_ap(100.0 * images @ classifier, targets).mean().item()
        assert zs[key] == pytest.approx(reference, abs=1e-9), key
    assert headline(ours) == {"zeroshot_mean_average_precision": zs["zeroshot_mean_average_precision"], "images": 20}
    assert "zero-shot mAP (8 classes, several an image)" in format_eval_table(zs)

    assert main(["train", "--dry-run", "--data", str(demo_dir / "train"), "--eval-data", str(root)]) == 0
    printed = capsys.readouterr().out
    assert "  zeroshot: runs" in printed and f"{root}/test/0.tar: s0000000: 112×112 webp, 'classes [" in printed
    (root / "classnames.txt").unlink()
    assert main(["eval", str(checkpoint), "--data", str(root)]) == 2
    assert f"{root}: a multilabel set without classnames.txt" in capsys.readouterr().err
