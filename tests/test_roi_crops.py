"""The pseudo-labeller's crops (rayvl/methods/bow/roi_crops.py): the boxes Pillow's path drew, images decoded at a
reduced JPEG scale and downscaled once, crops cut by Pillow on a CPU or by one grid_sample on a GPU (run here on CPU
tensors) — exact on a linear image, and within the stated tolerance of the crops Pillow cut from the full image."""
from __future__ import annotations

import io
from collections import Counter
from dataclasses import asdict

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import untrained_checkpoint
from rayvl.methods.bow import roi_crops
from rayvl.data.images import decode, random_resized_crop_box, random_resized_crop_boxes, resized
from rayvl.data.tar import iter_tar_samples

# mean |difference| a pixel (of 255) between a crop cut here and Pillow's bicubic crop of the full image: the two
# differ by resampling filter only (same box, same size). Any one crop stays under PIXEL_TOLERANCE; over the crops
# of a set of images the difference averages under MEAN_TOLERANCE (a small crop of a busy patch is the worst case,
# whichever generator calls drew its box)
PIXEL_TOLERANCE, MEAN_TOLERANCE = 4.0, 2.0


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=92)
    return buf.getvalue()


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth colour field with noise: what a resampling filter sees in a photo."""
    rng = np.random.default_rng(seed)
    field = np.asarray(Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height),
                                                                                               Image.BICUBIC))
    noise = rng.normal(0, 6, (height, width, 3))
    return Image.fromarray(np.clip(field + noise, 0, 255).astype(np.uint8))


def _pillow_crops(data: bytes, key: str, crops: int, size: int, scale_min: float, seed: int) -> np.ndarray:
    """What the labeller cut before: c bicubic crops of the full decoded image, boxes from the same generator."""
    img, rng = decode(data), roi_crops.rng_of(key, seed)
    return np.stack([resized(img, tuple(box), size) for box in random_resized_crop_boxes(*img.size, scale_min, rng,
                                                                                         crops)])


def test_boxes_drawn_at_once_are_drawn_as_one_by_one():
    """images.random_resized_crop_boxes (c boxes from one generator call) against random_resized_crop_box (one
    box, four or more calls): the same distribution of area fractions, aspect ratios, positions and fallbacks to the
    central square, on a photo's shape, a panorama (where some tries do not fit) and a strip (where most fall back)."""
    for width, height, scale_min in ((640, 480, 0.3), (900, 500, 0.5), (400, 200, 0.5)):
        rng = np.random.default_rng(0)
        one = np.array([random_resized_crop_box(width, height, scale_min, rng) for _ in range(20_000)])
        many = random_resized_crop_boxes(width, height, scale_min, np.random.default_rng(1), 20_000)
        assert many.dtype == np.int64 and many.shape == (20_000, 4)
        for boxes in (one, many):  # inside the image, at least a pixel a side
            assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
            assert ((boxes[:, 2:] - boxes[:, :2]) >= 1).all()

        def stats(b):
            w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
            side = min(width, height)
            central = (w == side) & (h == side) & (b[:, 0] == (width - side) // 2) & (b[:, 1] == (height - side) // 2)
            fitted = ~central
            return np.array([central.mean(), (w * h / (width * height))[fitted].mean(),
                             np.log(w / h)[fitted].mean(), (b[:, 0] / width)[fitted].mean()])

        # 20,000 draws: a share's standard error is ≤ 0.0036, a mean's well under the tolerances
        np.testing.assert_allclose(stats(many), stats(one), atol=0.015)
    assert random_resized_crop_boxes(64, 48, 0.5, np.random.default_rng(0), 0).shape == (0, 4)
    for width, height in ((2, 2), (2, 1), (1, 3)):  # the tiniest images: boxes inside them, a pixel a side at least
        b = random_resized_crop_boxes(width, height, 0.99, np.random.default_rng(0), 200)
        assert (b[:, :2] >= 0).all() and (b[:, 2] <= width).all() and (b[:, 3] <= height).all()
        assert ((b[:, 2:] - b[:, :2]) >= 1).all()


def test_boxes_are_the_ones_pillows_path_drew_on_the_full_image_and_a_large_jpeg_decodes_reduced():
    data = _jpeg(_photo(1600, 1200))
    source = roi_crops.prepare(data, "000123", 10, 64, 0.5, seed=7)
    side = roi_crops.source_side(64, 0.5)
    assert min(source.image.size) == side  # downscaled once to the side every crop needs
    drawn = random_resized_crop_boxes(1600, 1200, 0.5, roi_crops.rng_of("000123", 7), 10).astype(np.float32)
    np.testing.assert_allclose(source.boxes * (1600 / source.image.width), drawn, rtol=1e-4, atol=0.5)
    # libjpeg's DCT scaling: 1600 × 1200 decoded at 1/8 (200 × 150 ≥ side 105), never below the side
    img, full = roi_crops.decode_reduced(data, side)
    assert full == (1600, 1200) and img.size == (200, 150)
    assert roi_crops.decode_reduced(_jpeg(_photo(300, 200)), side)[0].size == (300, 200)  # 1/2 would be < side
    assert roi_crops.prepare(b"not an image", "k", 10, 64, 0.5, 0) is None


@pytest.mark.parametrize("cut", ["grid", "pillow"])
def test_a_crop_of_a_linear_image_is_exact(cut):
    """Bilinear and bicubic resampling reproduce a linear function: each crop pixel must be the image's value at
    the pixel's centre in the box — an off-by-half-pixel box, a swapped axis or crops of the wrong image show."""
    w, h, size = 240, 180, 32
    x = np.arange(w, dtype=np.float64)[None, :].repeat(h, 0)
    y = np.arange(h, dtype=np.float64)[:, None].repeat(w, 1)
    ramp = np.stack([x, y, 0.5 * x + 0.5 * y], -1)  # value = coordinate of the pixel centre − 0.5, per channel
    boxes = np.array([[20.0, 30.0, 180.0, 150.0], [100.25, 10.5, 220.75, 130.0]], np.float32)
    sources = [roi_crops.CropSource(Image.fromarray(ramp.astype(np.uint8)), boxes),
               roi_crops.CropSource(Image.fromarray((ramp * 0 + 77).astype(np.uint8)), boxes[:1].repeat(2, 0))]
    out = (roi_crops.cut(sources, size).numpy() if cut == "grid" else roi_crops.cut_on_cpu(sources, size))
    assert out.shape == (4, 3, size, size) and out.dtype == np.uint8
    for n, (x0, y0, x1, y1) in enumerate(boxes):
        t = (np.arange(size) + 0.5) / size
        cx, cy = x0 + t * (x1 - x0) - 0.5, y0 + t * (y1 - y0) - 0.5  # float64 reference
        want = np.stack([cx[None, :].repeat(size, 0), cy[:, None].repeat(size, 1),
                         0.5 * cx[None, :] + 0.5 * cy[:, None]])
        np.testing.assert_allclose(out[n].astype(np.float64), want, atol=1.01)  # the rounding to uint8, and
        # the ramp's own rounding into a uint8 image
    assert (out[2:] == 77).all()  # the second image's crops are the second image's


def test_crops_agree_with_pillows_full_image_crops_within_tolerance(demo_dir):
    """On the demo's photos (112 px) at 32 and 64 px and on large JPEGs at 224 px (decoded reduced, downscaled),
    both cuts stay within PIXEL_TOLERANCE of the crops Pillow cut from the full image, and of each other."""
    with open(demo_dir / "train" / "00000.tar", "rb") as f:
        demo = [(s["key"], s["img"]) for _, s in zip(range(12), iter_tar_samples(f))]
    large = [(f"big{i}", _jpeg(_photo(1024, 768, seed=i))) for i in range(4)]
    for samples, size in ((demo, 32), (demo, 64), (large, 224)):
        sources = [roi_crops.prepare(data, key, 4, size, 0.5, 0) for key, data in samples]
        grid, pillow = roi_crops.cut(sources, size).numpy().astype(int), roi_crops.cut_on_cpu(sources, size).astype(int)
        before = np.concatenate([_pillow_crops(data, key, 4, size, 0.5, 0) for key, data in samples]).astype(int)
        for name, mine in (("grid", grid), ("pillow", pillow)):
            per_crop = np.abs(mine - before).mean(axis=(1, 2, 3))
            assert per_crop.max() < PIXEL_TOLERANCE and per_crop.mean() < MEAN_TOLERANCE, (name, size, per_crop)
        assert np.abs(grid - pillow).mean(axis=(1, 2, 3)).max() < PIXEL_TOLERANCE


def test_an_images_crops_do_not_depend_on_the_images_cut_beside_it():
    """Images of other sizes share a canvas (padded) and a crop at an image's right or bottom edge samples that
    image alone: each image's crops cut with others equal its crops cut alone (to one level of 255 at a few pixels:
    float rounding) — and a banner beside portraits (a canvas mostly padding) starts a group of its own."""
    # boxes (seed 0) that give every image one sample count (s = 2: each image's largest box side within 48–96 px),
    # so that one canvas can hold the first five
    sources = [roi_crops.prepare(_jpeg(_photo(w, h, seed=i)), f"k{i}", 6, 48, 0.5, seed=0)
               for i, (w, h) in enumerate([(300, 200), (120, 90), (90, 130), (64, 64), (400, 60), (60, 400)])]
    edge = roi_crops.CropSource(sources[1].image, np.array([[40.0, 30.0, sources[1].image.width,
                                                            sources[1].image.height]] * 6, np.float32))
    sources.insert(4, edge)  # a box at the bottom-right corner of an image smaller than the canvas
    # the first five share one canvas; the banner and the portrait start groups of their own
    assert list(roi_crops._groups(sources, 48)) == [[0, 1, 2, 3, 4], [5], [6]]
    together = roi_crops.cut(sources, 48).numpy()
    alone = np.concatenate([roi_crops.cut([s], 48).numpy() for s in sources])
    assert together.shape == (42, 3, 48, 48)
    # equal up to the float rounding of a sampling coordinate normalised to another canvas size
    difference = np.abs(together.astype(int) - alone.astype(int))
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3
    corner = np.asarray(edge.image)[-8:, -8:].astype(int).mean()
    assert abs(together[24:30, :, -1, -1].astype(int).mean() - corner) < 25  # no dark edge from the padding


def test_small_crops_of_a_large_image_are_area_filtered_within_tolerance():
    """crop_scale_min=0.08: crops reduced up to 4× and more from the downscaled image — s × s samples a pixel keep
    them within tolerance of Pillow's full-image crops."""
    data = _jpeg(_photo(1024, 768, seed=5))
    source = roi_crops.prepare(data, "small", 8, 64, 0.08, seed=2)
    before = _pillow_crops(data, "small", 8, 64, 0.08, 2).astype(int)
    for mine in (roi_crops.cut([source], 64).numpy(), roi_crops.cut_on_cpu([source], 64)):
        assert np.abs(mine.astype(int) - before).mean(axis=(1, 2, 3)).max() < PIXEL_TOLERANCE


def test_the_gpu_paths_labels_are_the_cpu_paths(demo_dir, tmp_path, monkeypatch):
    """A labeller's neighbours with its crops cut in one op (the GPU's code, on CPU tensors) against its CPU
    threads' Pillow crops, on 24 demo images, the caption pool being the CPU path's own crops (each under its
    image's key): each image's retrievals are merged from its own crops, and a crop cut in one op scores within
    the resampling difference of the perfect score its Pillow twin gets."""
    import faiss

    from rayvl.methods.bow.config import PseudoLabelConfig
    from rayvl.eval import knn
    from rayvl.export import load
    from rayvl.methods.bow.pseudo_label import Labeler, Unit, crops, unit_samples, write_pool

    ckpt = untrained_checkpoint(demo_dir, tmp_path)
    model = load(ckpt)
    model.module.vision.to_channels_last()  # as the labeller embeds
    x = PseudoLabelConfig(rules=["max_count"], crops=4, k=4, batch_size=16)
    samples = unit_samples(Unit(0, "tar", [str(demo_dir / "train" / "00000.tar")]))[0][:24]
    vectors = np.concatenate([model.encode_image(crops(data, key, x, model.image_size)).numpy()
                              for key, data, *_ in samples])
    (tmp_path / "index").mkdir()
    faiss.write_index(knn.build_index(vectors, "flat"), str(tmp_path / "index" / "index.faiss"))
    write_pool(tmp_path / "index", [key for key, *_ in samples for _ in range(4)], ["a"] * 96)
    labeler = Labeler(str(next(ckpt.iterdir())), str(tmp_path / "index"), asdict(x), {}, str(tmp_path / "out"))
    on_cpu = labeler.neighbours(samples, model.image_size)
    labeler.cut_on_cpu = False  # the GPU's code on CPU tensors: the crops cut in one op, the exact pool searched
    labeler.index = knn.DeviceIndex.of(labeler.index, torch.device("cpu"))  # where they are (as on a cuda device)
    read_back = Counter()  # tensors copied to the host: on a GPU, each waits for it
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **kw: read_back.update(["cpu"]) or cpu(t, *a, **kw))
    in_one_op = labeler.neighbours(samples, model.image_size)
    # the unit's retrievals are read back once (scores, ids), however many chunks (6: 4 images a chunk); faiss's
    # search reads every chunk's embeddings back
    assert read_back["cpu"] == 2
    labeler.index = faiss.read_index(str(tmp_path / "index" / "index.faiss"))
    by_faiss = labeler.neighbours(samples, model.image_size)
    assert read_back["cpu"] == 2 + 6 + 2
    assert sorted(by_faiss) == list(range(24))
    for i in range(24):  # the same retrievals, but where two scores tie to float rounding
        np.testing.assert_allclose(by_faiss[i][1], in_one_op[i][1], atol=1e-5)
        tied = np.isclose(np.diff(by_faiss[i][1]), 0, atol=1e-5)
        tied = np.r_[tied, False] | np.r_[False, tied]  # a retrieval whose score equals a neighbour's in the order
        assert np.array_equal(by_faiss[i][0][~tied], in_one_op[i][0][~tied]), i
    assert sorted(on_cpu) == sorted(in_one_op) == list(range(24))
    # untrained towers put the demo's images close together (another image's crop may tie with an image's own),
    # so what is checked is the score: each CPU crop finds itself (cosine 1), each crop cut in one op finds a
    # crop as close as itself cut by Pillow
    for i in range(24):
        assert len(on_cpu[i][0]) == len(in_one_op[i][0]) == 16  # k · c retrievals, merged per image
        assert np.allclose(on_cpu[i][1][:4], 1.0, atol=1e-4)
        assert in_one_op[i][1][0] > 0.95, (i, in_one_op[i][1][0])
    assert crops(b"not an image", "k", x, model.image_size) is None
