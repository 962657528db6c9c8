"""Fashion-MNIST (real photos, 10 classes) from the Debian ``dataset-fashion-mnist`` package: the one reader used
by image-label training, evaluation and the UniCL job."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from rayvl import assets
from rayvl.data.images import crop

CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]


def root_of(spec: str) -> Path:
    """"fashion-mnist" = the installed Debian copy; anything else is a folder of IDX files."""
    if spec != "fashion-mnist":
        return Path(spec).expanduser()
    return assets.require_fashion_mnist()


def is_fashion_mnist(spec: str) -> bool:
    path = Path(spec).expanduser()
    return spec == "fashion-mnist" or (path.is_dir() and any(path.glob("*-images-idx3-ubyte*")))


def read(spec: str, split: str = "train", limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(pixels uint8 [N, 28, 28], labels int64 [N]) of a split ("train" or "t10k"), optionally the first ``limit``."""
    root = root_of(spec)

    def find(stem: str) -> Path:
        for name in (f"{stem}.gz", stem):
            if (root / name).exists():
                return root / name
        raise FileNotFoundError(f"{root / stem}(.gz) not found")

    pixels = assets.read_idx(find(f"{split}-images-idx3-ubyte"))
    labels = assets.read_idx(find(f"{split}-labels-idx1-ubyte")).astype(np.int64)
    return (pixels[:limit], labels[:limit]) if limit else (pixels, labels)


def to_rgb(pixels: np.ndarray, size: int, scale_min: float | None = None,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """A 28×28 grey image → uint8 (3, size, size): the whole image resized (``scale_min`` None), or a random
    resized crop for training."""
    return crop(Image.fromarray(np.asarray(pixels, np.uint8), "L").convert("RGB"), size, scale_min, rng)


def row_key(split: str, index: int) -> str:
    return f"fmnist-{split}-{index:05d}"


def rows(pixels: np.ndarray, labels: np.ndarray, split: str = "train"):
    """A Ray Dataset of rows {index, key, pixels, cls} (from ``read``) in file order."""
    import ray

    return ray.data.from_items([{"index": i, "key": row_key(split, i), "pixels": pixels[i], "cls": int(labels[i])}
                                for i in range(len(labels))])


def passes(pixels: np.ndarray, labels: np.ndarray, seed: int, n_passes: int, num_cpus: float, split: str = "train"):
    """A Ray Dataset of ``n_passes`` passes over ``read``'s photos as rows {index, key, pixels, cls, pass}, each pass
    in its own order drawn from (seed, pass). A task makes each pass as it is read, so a long run does not hold all
    of them in memory."""
    import ray

    # from_items, not range: a range is a read operator of a whole CPU, which Ray Data may never get beside training
    return ray.data.from_items([{"pass": p} for p in range(n_passes)], override_num_blocks=n_passes).map_batches(
        _pass_rows, batch_size=1, batch_format="numpy", num_cpus=num_cpus,
        fn_kwargs=dict(pixels=pixels, labels=labels, seed=seed, split=split))


def _pass_rows(batch: dict, pixels: np.ndarray, labels: np.ndarray, seed: int, split: str) -> dict:
    pass_ = int(batch["pass"][0])
    order = np.random.default_rng([seed, pass_]).permutation(len(labels))
    return {"index": order, "key": np.array([row_key(split, i) for i in order], dtype=object),
            "pixels": pixels[order], "cls": labels[order], "pass": np.full(len(order), pass_, np.int64)}
