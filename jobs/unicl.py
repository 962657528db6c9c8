"""Seed unicl-image-text-label: a CE-style baseline vs UniCL, zero-shot on seen, held-out and all classes.

    python jobs/unicl.py [--set image_label.data=SHARDS_WITH_CLS --set image_label.classes=classes.json ...]
    ray job submit --working-dir . -- python jobs/unicl.py --data s3://bucket/cc3m/... --set image_label.data=...

- ce: the image tower with a learned class-embedding matrix ([UniCL] eq. (4): CE is UniCL whose text encoder
  is a linear embedding), trained on the image-label data of the 7 training classes only;
- unicl: the same image tower with the text tower, UniCL's label-aware loss, image-label prompts mixed 1:1 per
  batch with image-text pairs (the embedded demo's, or --data).

Both are evaluated zero-shot on the Fashion-MNIST test split (all 80 templates averaged): over all 10 classes, over
the 7 training classes, and over the 3 held-out classes. The CE model has no text encoder, so it can only score
the classes it has embeddings for ("–" on held-out classes; its 10-class accuracy counts them as misses).
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl.recipes import run_comparison  # noqa: E402

ROWS = [("zero-shot top-1, all 10 classes %", "zs_all_top1", ".1f"),
        ("zero-shot top-1, 7 training classes %", "zs_seen_top1", ".1f"),
        ("zero-shot top-1, 3 held-out classes %", "zs_heldout_top1", ".1f"),
        ("image-label share of training rows", "image_label_share", ".2f"),
        ("final training loss", "loss", ".3f")]
TEST_IMAGES = 2000


def zero_shot(result) -> dict:
    """Fashion-MNIST test images, zero-shot over all / seen / held-out classes (CLIP's 80 templates averaged)."""
    import numpy as np
    import torch

    from rayvl import assets
    from rayvl.checkpoints import load_model
    from rayvl.data import fashion_mnist
    from rayvl.data.prompts import templates
    from rayvl.eval.embed import ModelEmbedder
    from rayvl.eval.zeroshot import class_embeddings

    model, config = load_model(result.checkpoint_dir)
    pixels, labels = fashion_mnist.read("fashion-mnist", "t10k", TEST_IMAGES)
    images = np.stack([fashion_mnist.to_rgb(p, config["data"]["image_size"]) for p in pixels])
    labels = torch.from_numpy(labels)
    seen = sorted(config["image_label"]["train_classes"])
    held = [c for c in range(10) if c not in seen]
    if config["model"]["text_tower"] == "class_embedding":  # a CE model scores only its own classes
        with torch.no_grad():
            image_emb = torch.from_numpy(ModelEmbedder(model, "", 0).images(images))
            class_emb = model.encode_classes().clone()
        pred = torch.tensor(seen)[(image_emb @ class_emb[seen].T).argmax(1)]
        return {"zs_all_top1": 100.0 * (pred == labels).float().mean().item(),  # held-out images count as misses
                "zs_seen_top1": _top1(image_emb, labels, class_emb, seen)}
    embedder = ModelEmbedder(model, str(assets.text_model_path(config["model"]["text"])),
                             config["data"]["max_text_tokens"])
    image_emb = torch.from_numpy(embedder.images(images))
    names, chosen = fashion_mnist.CLASSES, templates("clip_imagenet")
    prompts = embedder.texts([t.format(c) for c in names for t in chosen]).reshape(len(names), len(chosen), -1)
    class_emb = torch.from_numpy(class_embeddings(prompts))
    return {"zs_all_top1": _top1(image_emb, labels, class_emb, list(range(10))),
            "zs_seen_top1": _top1(image_emb, labels, class_emb, seen),
            "zs_heldout_top1": _top1(image_emb, labels, class_emb, held)}


def _top1(image_emb, labels, class_emb, classes: list[int]) -> float:
    """Top-1 (%) over the images of ``classes``, choosing among those classes only."""
    import torch

    mask = torch.isin(labels, torch.tensor(classes))
    pred = torch.tensor(classes)[(image_emb[mask] @ class_emb[classes].T).argmax(1)]
    return 100.0 * (pred == labels[mask]).float().mean().item()


def main() -> int:
    ce = ["model.text_tower=class_embedding", "loss.kind=ce", "image_label.weight=1.0", "eval.tasks=[]"]
    return run_comparison(str(REPO / "configs" / "unicl.yaml"), {"ce": ce, "unicl": []}, ROWS, sys.argv[1:],
                          after=zero_shot)


if __name__ == "__main__":
    sys.exit(main())
