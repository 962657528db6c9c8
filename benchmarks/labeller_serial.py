"""What one pseudo-labeller does per image on its one Python thread at a time, phase by phase — the ceiling on its
images/s however many CPUs it holds (issue 55: a GPU labeller with 15 CPUs labelled 474 images/s, 2026-11-28,
docs/gpu.md).

    .venv/bin/python benchmarks/labeller_serial.py [--images 1000] [--repeats 3]

A labeller (``rayvl.methods.bow.pseudo_label.Labeler``) prepares each image's crops on its threads (the decoder's and
the resize's C work releases the interpreter's lock; the box draws and the calls around them do not); its finisher
(``Finisher``: in the labeller's process without Ray, an actor of its own on Ray) counts the words of the image's
k·c retrieved captions, ranks them, builds the rows and writes the shard. This runs each phase with rayvl's own
functions over the embedded demo's first training shard, on one thread, and prints the median milliseconds an
image of ``--repeats`` rounds: the Python phases of one interpreter bound its rate, which no CPU count and no GPU
raises — on Ray the labeller's and its finisher's are two interpreters, without Ray one. The retrievals are drawn
at random from the demo's caption pool (the job's, the training split's first half); embedding and the index search
are left out (the GPU's, which releases the lock).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's rayvl, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # pseudo_label_throughput: the caption pool

from pseudo_label_throughput import pool_captions  # noqa: E402

from rayvl.checks.gpu import demo_halves  # noqa: E402
from rayvl.methods.bow import roi_crops  # noqa: E402
from rayvl.data.images import random_resized_crop_box, random_resized_crop_boxes  # noqa: E402
from rayvl.data.tar import write_img2dataset_shard  # noqa: E402
from rayvl.methods.bow.config import PseudoLabelConfig  # noqa: E402
from rayvl.methods.bow.pseudo_label import Finisher, Unit, mapped_pool, unit_samples, write_pool  # noqa: E402
from rayvl.methods.bow.word_rank import WordRanker, caption_words, count_words, neighbour_counts  # noqa: E402

SIZE = 224  # the crops' side at ViT-B/32's 224 px


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    x = PseudoLabelConfig()
    aligned, unaligned = demo_halves()
    samples = unit_samples(Unit(0, "shard", [unaligned.split(",")[0]]))[0][:args.images]
    keys, captions = pool_captions(aligned)
    n, retrieved = len(samples), x.k * x.crops
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, len(captions), retrieved) for _ in range(n)]
    df = Counter(w for c in captions for w in caption_words(c))  # document frequencies: each word once a caption
    out = Path(tempfile.mkdtemp(prefix="labeller-serial-"))
    write_pool(out, keys, captions)
    finisher = Finisher.__new__(Finisher)  # the row code alone: the pool mapped as a finisher maps it, no index
    finisher.x, (finisher.keys, finisher.captions) = x, mapped_pool(out)
    finisher.ranker = WordRanker(df, x.words, x.top_t, x.seed)
    side = roi_crops.source_side(SIZE, x.crop_scale_min)

    def decode():
        return [roi_crops.decode_reduced(s[1], side) for s in samples]

    decoded = decode()

    def image_boxes_one_by_one(key: str, w: int, h: int) -> np.ndarray:  # as roi_crops.prepare drew them before
        rng = roi_crops.rng_of(key, x.seed)
        return np.array([random_resized_crop_box(w, h, x.crop_scale_min, rng) for _ in range(x.crops)], np.float32)

    def image_boxes(key: str, w: int, h: int) -> np.ndarray:  # as roi_crops.prepare draws them
        return random_resized_crop_boxes(w, h, x.crop_scale_min, roi_crops.rng_of(key, x.seed), x.crops).astype(
            np.float32)

    def boxes_one_by_one():
        return [image_boxes_one_by_one(s[0], w, h) for s, (_, (w, h)) in zip(samples, decoded)]

    def boxes():
        return [image_boxes(s[0], w, h) for s, (_, (w, h)) in zip(samples, decoded)]

    drawn = boxes()
    cached = lru_cache(maxsize=None)(lambda j: caption_words(captions[j]))
    found = [count_words(map(cached, i.tolist())) for i in ids]
    scores = np.linspace(1, 0, retrieved, dtype=np.float32)
    rows: list = []

    def build():
        rows[:] = [finisher._row(x.rules[0], s, (i, scores, f), Counter())
                   for s, i, f in zip(samples, ids, found)]

    build()
    phases = {
        "decode at a reduced scale (Pillow; its C work releases the lock)": decode,
        "draw 10 crop boxes one by one (before)": boxes_one_by_one,
        "draw 10 crop boxes from one generator call (now)": boxes,
        "downscale once (Pillow)": lambda: [roi_crops.from_image(img, b, full, side)
                                            for (img, full), b in zip(decoded, drawn)],
        "count retrieved words, each caption split again (before)": lambda: [
            neighbour_counts([captions[j] for j in i]) for i in ids],
        "count retrieved words, each pool caption split once (now)": lambda: [
            count_words(map(cached, i.tolist())) for i in ids],
        "rank words and build rows (Python)": build,
        "write the shard (Python: tar and JSON)": lambda: write_img2dataset_shard(out, "00000", rows, {}),
    }
    ms = {name: 1e3 * statistics.median(timed(work) for _ in range(args.repeats)) / n for name, work in phases.items()}
    print(f"labeller_serial: {n} demo images ({decoded[0][1][0]}×{decoded[0][1][1]} px), {retrieved} retrievals an "
          f"image, {len(captions)} pool captions, median of {args.repeats}, one thread")
    print(f"{'phase':<64} {'ms/image':>9}")
    for name, v in ms.items():
        print(f"{name:<64} {v:9.3f}")
    python = [k for k in ms if "(Pillow" not in k and "(before)" not in k]
    labeller = [k for k in python if "boxes" in k]
    for name, names in (("the labeller's Python phases now (box draws)", labeller),
                        ("its finisher's (counting, rows, shard)", [k for k in python if k not in labeller]),
                        ("both in one interpreter (without Ray)", python)):
        total = sum(ms[k] for k in names)
        print(f"{name:<64} {total:9.3f}  → at most {1e3 / total:,.0f} images/s")


if __name__ == "__main__":
    main()
