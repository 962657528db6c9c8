"""Seed unicl-image-text-label: a CE-style baseline vs UniCL, zero-shot on seen, held-out and all classes.

    python jobs/unicl.py [--set image_label.data=SHARDS_WITH_CLS --set image_label.classes=classes.json ...]
    ray job submit --working-dir . -- python jobs/unicl.py --data s3://bucket/cc3m/... --set image_label.data=...

- ce: the image tower with a learned class-embedding matrix (seed unicl eq. (4): CE is UniCL whose text encoder
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

from rayvl.cli import run_comparison  # noqa: E402

ROWS = [("zero-shot top-1, all 10 classes %", "zs_all_top1", ".1f"),
        ("zero-shot top-1, 7 training classes %", "zs_seen_top1", ".1f"),
        ("zero-shot top-1, 3 held-out classes %", "zs_heldout_top1", ".1f"),
        ("image-label share of training rows", "image_label_share", ".2f"),
        ("final training loss", "loss", ".3f")]
TEST_IMAGES = 2000


def zero_shot(result) -> dict:
    """Fashion-MNIST test images, zero-shot over all / seen / held-out classes (templates averaged)."""
    import numpy as np
    import torch

    from rayvl import assets
    from rayvl.data.labeled import FASHION_MNIST_CLASSES, clip_templates
    from rayvl.data.text import tokenize
    from rayvl.eval.embed import embed_local, load_model
    from rayvl.eval.zeroshot import class_embeddings

    model, config = load_model(result.checkpoint_dir)
    root = assets.fashion_mnist_dir()
    pixels = assets.read_idx(root / "t10k-images-idx3-ubyte.gz")[:TEST_IMAGES]
    labels = torch.from_numpy(assets.read_idx(root / "t10k-labels-idx1-ubyte.gz")[:TEST_IMAGES].astype(np.int64))
    size = config["data"]["image_size"]
    from PIL import Image

    images = np.stack([np.asarray(Image.fromarray(p, "L").convert("RGB").resize((size, size), Image.BICUBIC),
                                  np.uint8).transpose(2, 0, 1) for p in pixels])
    with torch.no_grad():
        image_emb = torch.from_numpy(embed_local(model, images))
        seen = sorted(config["image_label"]["train_classes"])
        held = [c for c in range(10) if c not in seen]
        if config["model"]["text_tower"] == "class_embedding":
            class_emb = model.encode_classes().clone()
            class_emb[held] = float("nan")  # rows never trained: a CE model knows no unseen class
        else:
            tok_path = str(assets.text_model_path(config["model"]["text"]))
            tok = lambda xs: tuple(torch.from_numpy(a) for a in tokenize(xs, tok_path, 24))  # noqa: E731
            class_emb = class_embeddings(model.encode_text, tok, FASHION_MNIST_CLASSES, list(clip_templates()))

    def top1(classes: list[int]) -> float:
        mask = torch.isin(labels, torch.tensor(classes))
        emb = class_emb[classes]
        if torch.isnan(emb).any():
            return float("nan")
        pred = torch.tensor(classes)[(image_emb[mask] @ emb.T).argmax(1)]
        return 100.0 * (pred == labels[mask]).float().mean().item()

    if config["model"]["text_tower"] == "class_embedding":  # scores only its own classes: held-out = misses
        pred = (image_emb @ class_emb[seen].T).argmax(1)
        all_top1 = 100.0 * (torch.tensor(seen)[pred] == labels).float().mean().item()
        return {"zs_all_top1": all_top1, "zs_seen_top1": top1(seen)}
    return {"zs_all_top1": top1(list(range(10))), "zs_seen_top1": top1(seen), "zs_heldout_top1": top1(held)}


def main() -> int:
    ce = ["model.text_tower=class_embedding", "loss.kind=ce", "image_label.weight=1.0", "eval.tasks=[]"]
    return run_comparison(str(REPO / "configs" / "unicl.yaml"), {"ce": ce, "unicl": []}, ROWS, sys.argv[1:],
                          after=zero_shot)


if __name__ == "__main__":
    sys.exit(main())
