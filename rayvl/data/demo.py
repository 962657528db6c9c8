"""The embedded demo dataset: generated scenes written in img2dataset's layout.

Deterministic from a seed. Each image is a small scene of 1–3 coloured shapes; its caption is varied natural
English with stop words, adjectives and spatial relations ("a small red circle to the left of a blue square").
The output is read by exactly the code that reads LAION shards:

    OUT/train/00000.tar (KEY.jpg KEY.txt KEY.json) 00000.parquet 00000_stats.json ...
    OUT/eval/...            held-out scenes, one object each (json carries the class id for zero-shot)
    OUT/classes.json        class names + prompt templates for zero-shot
    OUT/paraphrases.jsonl   the fixed paraphrase set (caption, paraphrase, 3 expansions): WordNet synonyms,
                            reordered relations, function words (rayvl/data/paraphrases.py)
    OUT/sts.tsv             sentence1, sentence2, gold score 0-5 (thesaurus paraphrases 5; else the share of scene
                            attributes)
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from rayvl.data.paraphrases import paraphrase_set
from rayvl.data.prompts import templates
from rayvl.data.tar import write_img2dataset_shard

SHAPES = ["circle", "square", "triangle", "star", "cross", "diamond", "hexagon", "ring"]
COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
    "purple": (140, 50, 180), "orange": (245, 140, 30), "black": (25, 25, 25), "white": (245, 245, 245),
}
SIZES = {"small": (10, 15), "large": (22, 30)}
FORMAT = 3  # bump when the files written change, so ensure_demo regenerates older demo folders

# a small thesaurus: (caption word, its synonyms), for the STS pairs' paraphrases
SYNONYMS = {
    "small": ["little", "tiny"], "large": ["big", "huge"], "circle": ["round disc"], "square": ["box shape"],
    "picture": ["photo", "snapshot"], "star": ["star shape"], "ring": ["hoop"], "diamond": ["rhombus"],
}
POSITIONS = {"top left": (0.25, 0.25), "top right": (0.75, 0.25), "bottom left": (0.25, 0.75),
             "bottom right": (0.75, 0.75), "center": (0.5, 0.5), "top": (0.5, 0.22), "bottom": (0.5, 0.78),
             "left": (0.22, 0.5), "right": (0.78, 0.5)}

WHERE = {"center": "in the center", "top": "at the top", "bottom": "at the bottom", "left": "on the left",
         "right": "on the right"}


@dataclass
class Obj:
    shape: str
    color: str
    size: str
    position: str


def _polygon(shape: str, cx: float, cy: float, r: float, rot: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        angles, radii = [rot + k * 2 * math.pi / 3 for k in range(3)], [r] * 3
    elif shape == "star":
        angles = [rot + k * math.pi / 5 for k in range(10)]
        radii = [r if k % 2 == 0 else r * 0.45 for k in range(10)]
    elif shape == "diamond":
        angles, radii = [rot + k * math.pi / 2 for k in range(4)], [r, r * 0.65, r, r * 0.65]
    elif shape == "hexagon":
        angles, radii = [rot + k * math.pi / 3 for k in range(6)], [r] * 6
    elif shape == "cross":
        w = r * 0.35
        pts = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w),
               (-w, -w)]
        return [(cx + x, cy + y) for x, y in pts]
    else:
        raise ValueError(shape)
    return [(cx + rr * math.sin(a), cy - rr * math.cos(a)) for a, rr in zip(angles, radii)]


def render(objects: list[Obj], rng: np.random.Generator, size: int = 112) -> Image.Image:
    base = rng.integers(110, 190, size=3)
    noise = rng.normal(0, 8, size=(size, size, 1))
    canvas = np.clip(base[None, None, :] + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(canvas, "RGB")
    draw = ImageDraw.Draw(img)
    for o in objects:
        fx, fy = POSITIONS[o.position]
        cx = fx * size + rng.uniform(-4, 4)
        cy = fy * size + rng.uniform(-4, 4)
        r = rng.uniform(*SIZES[o.size])
        color = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in COLORS[o.color])
        box = [cx - r, cy - r, cx + r, cy + r]
        if o.shape == "circle":
            draw.ellipse(box, fill=color)
        elif o.shape == "ring":
            draw.ellipse(box, outline=color, width=max(3, int(r / 3)))
        elif o.shape == "square":
            draw.rectangle([cx - r * 0.85, cy - r * 0.85, cx + r * 0.85, cy + r * 0.85], fill=color)
        else:
            draw.polygon(_polygon(o.shape, cx, cy, r, rng.uniform(-0.2, 0.2)), fill=color)
    return img


def _relation(a: Obj, b: Obj) -> str:
    (ax, ay), (bx, by) = POSITIONS[a.position], POSITIONS[b.position]
    if abs(ax - bx) >= abs(ay - by):
        return "to the left of" if ax < bx else "to the right of"
    return "above" if ay < by else "below"


def _np(o: Obj, with_size: bool) -> str:
    words = ([o.size] if with_size else []) + [o.color, o.shape]
    article = "an" if words[0][0] in "aeiou" else "a"
    return f"{article} {' '.join(words)}"


def caption(objects: list[Obj], rng: np.random.Generator) -> str:
    first = objects[0]
    if len(objects) == 1:
        t = rng.integers(4)
        np_ = _np(first, with_size=True)
        where = WHERE.get(first.position, f"in the {first.position}")
        return [f"{np_} {where}", f"there is {np_} {where} of the picture",
                f"a picture of {np_} {where}", f"{np_} on a gray background"][t]
    if len(objects) == 2:
        second = objects[1]
        rel = _relation(first, second)
        t = rng.integers(3)
        return [f"{_np(first, True)} {rel} {_np(second, False)}",
                f"there is {_np(first, True)} {rel} {_np(second, True)}",
                f"a picture of {_np(first, False)} {rel} {_np(second, True)}"][t]
    a, b, c = (_np(o, with_size=bool(rng.integers(2))) for o in objects)
    return [f"{a}, {b} and {c}", f"a picture with {a}, {b} and {c}"][int(rng.integers(2))]


def thesaurus_paraphrase(text: str, rng: np.random.Generator) -> str:
    """Synonym substitution from SYNONYMS + fixed rephrasings: the STS set's score-5 pairs. Its draws come from the
    held-out split's random stream, so they stay: the held-out images are those of format 2. The evaluation's
    paraphrase set is richer (rayvl/data/paraphrases.py)."""
    words = []
    for w in text.split():
        syn = SYNONYMS.get(w)
        words.append(syn[int(rng.integers(len(syn)))] if syn else w)
    out = " ".join(words)
    for old, new in (("there is ", "we can see "), ("in the center", "in the middle"), ("a picture of ", "")):
        out = out.replace(old, new)
    return out if out != text else f"an image showing {out}"


def sample_scene(rng: np.random.Generator, n_objects: int) -> list[Obj]:
    positions = list(rng.choice(list(POSITIONS), size=n_objects, replace=False))
    return [Obj(SHAPES[int(rng.integers(len(SHAPES)))], list(COLORS)[int(rng.integers(len(COLORS)))],
                list(SIZES)[int(rng.integers(len(SIZES)))], p) for p in positions]


def write_shard(out: Path, shard_id: int, rows: list[dict], started: float) -> None:
    stats = {"count": len(rows), "successes": len(rows), "failed_to_download": 0, "failed_to_resize": 0,
             "duration": time.time() - started, "status_dict": {"success": len(rows)}}
    write_img2dataset_shard(out, f"{shard_id:05d}", rows, stats)


def write_split(out: Path, n: int, seed: int, single_object: bool, shard_size: int,
                paraphrases: list | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows, shard_id, started = [], 0, time.time()
    for i in range(n):
        n_objects = 1 if single_object else int(rng.choice([1, 2, 3], p=[0.4, 0.4, 0.2]))
        objects = sample_scene(rng, n_objects)
        buf = io.BytesIO()
        render(objects, rng).save(buf, format="JPEG", quality=90)
        jpg = buf.getvalue()
        text = caption(objects, rng)
        key = f"{shard_id:05d}{len(rows):04d}"
        rows.append({"key": key, "url": f"demo://{seed}/{i}", "caption": text, "status": "success",
                     "error_message": None, "width": 112, "height": 112, "original_width": 112,
                     "original_height": 112, "exif": "{}", "sha256": hashlib.sha256(jpg).hexdigest(),
                     "cls": SHAPES.index(objects[0].shape),
                     "objects": [[o.shape, o.color, o.size, o.position] for o in objects], "jpg": jpg})
        if paraphrases is not None:
            paraphrases.append({"key": key, "caption": text, "paraphrase": thesaurus_paraphrase(text, rng),
                                "expansions": [thesaurus_paraphrase(text, rng) for _ in range(3)],
                                "objects": rows[-1]["objects"]})
        if len(rows) == shard_size or i == n - 1:
            write_shard(out, shard_id, rows, started)
            rows, shard_id, started = [], shard_id + 1, time.time()


def write_sts(path: Path, pairs: list[dict], rng: np.random.Generator, n_random: int = 300) -> None:
    """Sentence pairs with graded gold similarity: a caption and its paraphrase score 5; two captions of different
    single-object scenes score 5 × (shared attributes among shape, colour, size, position) / 4."""
    rows = [(p["caption"], p["paraphrase"], 5.0) for p in pairs[: len(pairs) // 2]]
    for _ in range(n_random):
        a, b = rng.choice(len(pairs), size=2, replace=False)
        shared = sum(x == y for x, y in zip(pairs[a]["objects"][0], pairs[b]["objects"][0]))
        rows.append((pairs[a]["caption"], pairs[b]["caption"], 5.0 * shared / 4))
    path.write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s:.2f}\n" for a, b, s in rows))


def _paraphrase_set(held_out: list[dict], n: int, seed: int) -> list[dict]:
    """n pairs: the first held-out captions (one object each), then captions of unrendered 2–3 object scenes."""
    scenes = np.random.default_rng(seed + 2_000_003)
    multi = [caption(sample_scene(scenes, int(scenes.integers(2, 4))), scenes) for _ in range(n // 2)]
    return paraphrase_set([p["caption"] for p in held_out[: n - n // 2]], multi, seed + 11)


DEMO_SHARD_SIZE = 1000  # samples a shard of the demo holds (its last shard: the rest)


def write_demo(out: str | Path, samples: int = 6000, eval_samples: int = 500, seed: int = 0,
               shard_size: int = DEMO_SHARD_SIZE) -> Path:
    out = Path(out).expanduser()
    for split in ("train", "eval"):
        shutil.rmtree(out / split, ignore_errors=True)  # a smaller dataset must not inherit stale shards
    write_split(out / "train", samples, seed, single_object=False, shard_size=shard_size)
    pairs: list = []
    write_split(out / "eval", eval_samples, seed + 1_000_003, single_object=True, shard_size=shard_size,
                paraphrases=pairs)
    classes = {"classes": SHAPES, "templates": list(templates("demo_shapes"))}
    (out / "classes.json").write_text(json.dumps(classes, indent=2))
    with open(out / "paraphrases.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in _paraphrase_set(pairs, eval_samples, seed))
    write_sts(out / "sts.tsv", pairs, np.random.default_rng(seed + 7))
    (out / "DONE.json").write_text(json.dumps({"samples": samples, "eval_samples": eval_samples, "seed": seed,
                                               "format": FORMAT}))
    return out


DEMO_SEED = 0  # the embedded demo dataset is one dataset: it does not change with a run's train.seed


def ensure_demo(out: str | Path, samples: int, eval_samples: int, seed: int = 0) -> Path:
    """Generate the demo dataset unless the same one is already there."""
    out = Path(out).expanduser()
    done = out / "DONE.json"
    want = {"samples": samples, "eval_samples": eval_samples, "seed": seed, "format": FORMAT}
    if done.exists() and json.loads(done.read_text()) == want:
        return out
    return write_demo(out, samples, eval_samples, seed)
