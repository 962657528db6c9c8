"""Captioned Fashion-MNIST photos: image-text pairs for UniCL's concept-coverage comparison ([UniCL] Tables 5–6,
App. D.2 — image-text pairs help zero-shot on the concepts their captions cover).

The pairs are made from the *last* training photos (index ≥ ``first``), which the image-label set does not read
(configs/unicl.yaml: ``image_label.limit`` = ``first``). Each photo gets one free-form caption that names its
garment the way a product listing would ("dark trousers on a black background", "a pair of strappy sandals") —
other words than CLIP's prompt templates, which only zero-shot evaluation uses. Two sets of the same size:

- ``covered``: photos of all 10 classes, the same number per class, so the captions name the classes the
  image-label set holds out;
- ``uncovered``: photos of the training classes only — the same number of pairs and words, none naming a
  held-out class (the control: image-text pairs without the concepts).

Both are img2dataset-layout shards (jpg, txt, json with ``cls``), written once and reused (``ensure_coverage``).
"""
from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import numpy as np
from PIL import Image

from rayvl.data import fashion_mnist
from rayvl.data.demo import write_shard

FORMAT = 1  # bump when the files written change
# noun phrases per class (index = Fashion-MNIST class id); every one names the class by its word or plural
GARMENTS = [
    ["t-shirt", "short-sleeved t-shirt", "plain t-shirt", "cotton t-shirt"],
    ["trousers", "pair of trousers", "long trousers", "trouser"],
    ["pullover", "knitted pullover", "warm pullover", "pullover sweater"],
    ["dress", "sleeveless dress", "summer dress", "long dress"],
    ["coat", "long coat", "winter coat", "buttoned coat"],
    ["sandal", "pair of sandals", "strappy sandal", "flat sandal"],
    ["shirt", "long-sleeved shirt", "button-up shirt", "collared shirt"],
    ["sneaker", "running sneaker", "low sneaker", "canvas sneaker"],
    ["bag", "handbag", "leather bag", "shoulder bag"],
    ["ankle boot", "leather ankle boot", "heeled ankle boot", "pair of ankle boots"],
]
FRAMES = ["{}", "{} on a black background", "product photo of {}", "catalogue picture: {}", "{}, seen from above",
          "small grayscale picture of {}"]


def shade(pixels: np.ndarray) -> str:
    """The garment's tone from the photo itself: mean intensity of its non-background pixels."""
    fg = pixels[pixels > 20]
    level = float(fg.mean()) if fg.size else 0.0
    return "dark" if level < 90 else "grey" if level < 150 else "light"


def caption(cls: int, pixels: np.ndarray, rng: np.random.Generator) -> str:
    noun = GARMENTS[cls][int(rng.integers(len(GARMENTS[cls])))]
    adjective = shade(pixels) + " " if rng.random() < 0.6 else ""
    if noun.startswith("pair of "):
        phrase = f"a pair of {adjective}{noun[len('pair of '):]}"
    elif noun.endswith("trousers"):  # a plural noun takes no article
        phrase = adjective + noun
    else:
        phrase = ("an " if (adjective or noun)[0] in "aeiou" else "a ") + adjective + noun
    return FRAMES[int(rng.integers(len(FRAMES)))].format(phrase)


def pick(labels: np.ndarray, first: int, held_out: list[int]) -> dict[str, np.ndarray]:
    """Photo indices of the two sets, all ≥ ``first``: ``covered`` k per class for all classes, ``uncovered`` the
    same total evenly over the training classes (10k / 7 each for 7), k as large as the rarest class allows."""
    classes = list(range(len(fashion_mnist.CLASSES)))
    train = [c for c in classes if c not in held_out]
    idx = {c: (i := np.flatnonzero(labels == c))[i >= first] for c in classes}
    most = min(len(i) for i in idx.values())
    k = next(k for k in range(most, 0, -1)
             if k * len(classes) % len(train) == 0 and k * len(classes) // len(train) <= most)
    each = k * len(classes) // len(train)
    return {"covered": np.sort(np.concatenate([idx[c][:k] for c in classes])),
            "uncovered": np.sort(np.concatenate([idx[c][:each] for c in train]))}


def write_coverage(out: str | Path, first: int, held_out: list[int], seed: int = 0, shard_size: int = 1000,
                   source: str = "fashion-mnist") -> Path:
    out = Path(out).expanduser()
    pixels, labels = fashion_mnist.read(source)
    if not 0 < first < len(labels):
        raise ValueError(f"image_label.limit: the captioned pairs use the training photos from index {first} on; "
                         f"it must be in (0, {len(labels)})")
    counts = {}
    for name, chosen in pick(labels, first, held_out).items():
        shutil.rmtree(out / name, ignore_errors=True)
        (out / name).mkdir(parents=True)
        rng = np.random.default_rng([seed, len(name)])
        rows, started = [], time.time()
        for n, i in enumerate(chosen):
            buf = io.BytesIO()
            Image.fromarray(pixels[i], "L").convert("RGB").save(buf, format="JPEG", quality=95)
            cls = int(labels[i])
            rows.append({"key": f"{n // shard_size:05d}{n % shard_size:04d}", "url": f"fashion-mnist://train/{i}",
                         "caption": caption(cls, pixels[i], rng), "status": "success", "error_message": None,
                         "width": 28, "height": 28, "original_width": 28, "original_height": 28, "exif": "{}",
                         "cls": cls, "jpg": buf.getvalue()})
            if len(rows) == shard_size or n == len(chosen) - 1:
                write_shard(out / name, n // shard_size, rows, started)
                rows, started = [], time.time()
        counts[name] = {fashion_mnist.CLASSES[c]: int((labels[chosen] == c).sum()) for c in range(10)}
    (out / "DONE.json").write_text(json.dumps({"first": first, "held_out": sorted(held_out), "seed": seed,
                                               "format": FORMAT, "counts": counts}, indent=2))
    return out


def ensure_coverage(out: str | Path, first: int, held_out: list[int], seed: int = 0) -> Path:
    """Write the two sets unless the same ones are already there."""
    out = Path(out).expanduser()
    done = out / "DONE.json"
    if done.exists():
        have = json.loads(done.read_text())
        if {k: have.get(k) for k in ("first", "held_out", "seed", "format")} == {
                "first": first, "held_out": sorted(held_out), "seed": seed, "format": FORMAT}:
            return out
    return write_coverage(out, first, held_out, seed)
