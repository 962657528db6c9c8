"""Zero-shot over the seen and the held-out classes of an image-label source ([UniCL] Tables 2–3 and 5–6: does
the text encoder carry concepts the image-label data never labelled?), on the Fashion-MNIST test split."""
from __future__ import annotations

import io

import numpy as np
import pyarrow.parquet as pq
import torch

TEST_IMAGES = 2000
HELD_OUT = ("trouser", "sandal", "bag")  # configs/unicl.yaml's image_label.train_classes leave these out
# a comparison's table rows of these metrics (jobs/unicl.py, jobs/unicl_coverage.py)
ROWS = [("zero-shot top-1, all 10 classes %", "zs_all_top1", ".1f"),
        ("zero-shot top-1, 7 training classes %", "zs_seen_top1", ".1f"),
        ("zero-shot top-1, 3 held-out classes %", "zs_heldout_top1", ".1f"),
        *((f"  recall of held-out {name} (among the 3) %", f"zs_heldout_recall_{name}", ".1f") for name in HELD_OUT),
        ("final training loss", "loss", ".3f")]


def fashion_mnist_split(result, test_images: int = TEST_IMAGES) -> dict:
    """A finished run's zero-shot top-1 (%) on Fashion-MNIST test images, CLIP's 80 templates averaged: over all 10
    classes (``zs_all_top1``), over the run's training classes (``zs_seen_top1``), over the others
    (``zs_heldout_top1``, choosing among the held-out classes only). A CE model (a class-embedding text tower) scores
    only the classes it has embeddings for: held-out images count as misses in its 10-class accuracy."""
    from rayvl import assets
    from rayvl.checkpoints import load_model
    from rayvl.data import fashion_mnist
    from rayvl.data.prompts import templates
    from rayvl.eval.embed import ModelEmbedder
    from rayvl.eval.zeroshot import class_embeddings

    model, config = load_model(result.checkpoint_dir)
    pixels, labels = fashion_mnist.read("fashion-mnist", "t10k", test_images)
    images = np.stack([fashion_mnist.to_rgb(p, config["data"]["image_size"]) for p in pixels])
    labels = torch.from_numpy(labels)
    seen = sorted(config["image_label"]["train_classes"])
    held = [c for c in range(10) if c not in seen]
    if config["model"]["text_tower"] == "class_embedding":
        with torch.no_grad():
            image_emb = torch.from_numpy(ModelEmbedder(model, "", 0).images(images))
            class_emb = model.encode_classes().clone()
        pred = torch.tensor(seen)[(image_emb @ class_emb[seen].T).argmax(1)]
        return {"zs_all_top1": 100.0 * (pred == labels).float().mean().item(),
                "zs_seen_top1": top1(image_emb, labels, class_emb, seen)}
    embedder = ModelEmbedder(model, str(assets.text_model_path(config["model"]["text"])),
                             config["data"]["max_text_tokens"])
    image_emb = torch.from_numpy(embedder.images(images))
    names, chosen = fashion_mnist.CLASSES, templates("clip_imagenet")
    prompts = embedder.texts([t.format(c) for c in names for t in chosen]).reshape(len(names), len(chosen), -1)
    class_emb = torch.from_numpy(class_embeddings(prompts))
    return {"zs_all_top1": top1(image_emb, labels, class_emb, list(range(10))),
            "zs_seen_top1": top1(image_emb, labels, class_emb, seen),
            "zs_heldout_top1": top1(image_emb, labels, class_emb, held),
            **confusion(image_emb, labels, class_emb, held, names)}


def coverage_split(result, test_images: int = TEST_IMAGES) -> dict:
    """``fashion_mnist_split`` and ``covered_share``: the % of the run's image-text captions (its data.train shards'
    img2dataset parquet files) that contain a held-out class name — the concept coverage the arm trained with."""
    from rayvl import storage
    from rayvl.checkpoints import checkpoint_uri, read_meta
    from rayvl.data import fashion_mnist
    from rayvl.data.specs import resolve_shards

    config = read_meta(checkpoint_uri(result.checkpoint_dir))["config"]
    held = [n for c, n in enumerate(fashion_mnist.CLASSES) if c not in config["image_label"]["train_classes"]]
    captions = []
    for tar in resolve_shards(config["data"]["train"]):
        table = pq.read_table(io.BytesIO(storage.read_bytes(tar[: -len(".tar")] + ".parquet")), columns=["caption"])
        captions += [c for c in table.column("caption").to_pylist() if c is not None]
    covered = sum(any(n in c.lower() for n in held) for c in captions)
    return {**fashion_mnist_split(result, test_images), "covered_share": 100.0 * covered / max(len(captions), 1)}


def confusion(image_emb: torch.Tensor, labels: torch.Tensor, class_emb: torch.Tensor, classes: list[int],
              names: list[str]) -> dict:
    """Among ``classes`` only: each class's recall (%) as ``zs_heldout_recall_<name>``, and the row-normalised
    confusion matrix (%) as ``zs_heldout_confusion`` {true name: {predicted name: %}}."""
    mask = torch.isin(labels, torch.tensor(classes))
    pred = torch.tensor(classes)[(image_emb[mask] @ class_emb[classes].T).argmax(1)]
    truth = labels[mask]
    matrix = {names[t]: {names[q]: 100.0 * (pred[truth == t] == q).float().mean().item() for q in classes}
              for t in classes if (truth == t).any()}
    return {**{f"zs_heldout_recall_{n.replace(' ', '_')}": row[n] for n, row in matrix.items()},
            "zs_heldout_confusion": matrix}


def mean_confusion(trials: list[dict]) -> str:
    """Per variant, the held-out confusion matrix (%) averaged over its finished seeds (a comparison's notes)."""
    lines = []
    for variant in dict.fromkeys(t["variant"] for t in trials):
        matrices = [t["metrics"]["zs_heldout_confusion"] for t in trials
                    if t["variant"] == variant and "zs_heldout_confusion" in t["metrics"]]
        if not matrices:
            continue
        names = list(matrices[0])
        lines += [f"\n{variant}: held-out confusion, % of each true class (rows) predicted as (columns), mean of "
                  f"{len(matrices)} seeds", " " * 12 + "".join(f"{n:>10}" for n in names)]
        lines += [f"{t:>12}" + "".join(f"{np.mean([m[t][q] for m in matrices]):>10.1f}" for q in names)
                  for t in names]
    return "\n".join(lines)


def top1(image_emb: torch.Tensor, labels: torch.Tensor, class_emb: torch.Tensor, classes: list[int]) -> float:
    """Top-1 (%) over the images of ``classes``, choosing among those classes only."""
    mask = torch.isin(labels, torch.tensor(classes))
    pred = torch.tensor(classes)[(image_emb[mask] @ class_emb[classes].T).argmax(1)]
    return 100.0 * (pred == labels[mask]).float().mean().item()
