"""What open_clip users reach for, as arms of one comparison: CLIP's softmax loss vs SigLIP's sigmoid loss (Zhai et
al. 2023, arXiv:2303.15343), and a fine-tuned vs a locked image tower (LiT, Zhai et al. 2022, arXiv:2111.07991) — on
the laion_adapt recipe, same data and steps, 3 seeds each, mean ± std per metric (rayvl.sweeps.comparison).

    python jobs/open_clip_options.py [--data SHARDS --eval-data SHARDS] [--seeds 3] [--variants A,B|all]
                                     [--set key=value ...] [--name NAME [--resume]] [--report DIR]

- clip: the recipe as it is (InfoNCE over the gathered batch, the image tower fine-tuned);
- siglip: loss.kind=siglip (t and b from the paper's 10 and −10);
- locked_image: the pretrained image tower locked, its projection and the text side trained;
- locked_image_siglip: both (--variants all);
- vit, vit_patch_dropout: a ViT image tower (timm's vit_tiny_patch16_224 at its 224 px, from a random init: no ViT
  weights ship in a package) without and with FLIP's patch dropout (Li et al. 2023, arXiv:2212.00794) of half the
  patch tokens. On a GPU cluster, the same two arms with a pretrained ViT: --variants vit,vit_patch_dropout
  --set model.vision=vit_base_patch16_224 --set model.vision_checkpoint=<weights>.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `ray job submit --working-dir .` runs from a copy

from rayvl.sweeps.comparison import Comparison  # noqa: E402

ROWS = [("zero-shot top-1 %", "zeroshot_top1", ".1f"),
        *((f"{label} R@{k} %", f"{d}_R@{k}", ".1f") for d, label in (("t2i", "text→image"), ("i2t", "image→text"))
          for k in (1, 5, 10)),
        ("paraphrase AO@10 %", "paraphrase_AO@10", ".1f"), ("STS Spearman ×100", "sts_spearman", ".1f"),
        ("final training loss", "loss", ".3f"), ("training samples/s (last window)", "samples_per_s", ".1f")]
LOCKED = "model.vision_strategy=frozen"
VIT = ["model.vision=vit_tiny_patch16_224", "data.image_size=224"]
COMPARISON = Comparison(
    "open_clip_options (CLIP vs SigLIP loss, fine-tuned vs locked image tower, ViT with and without patch dropout)",
    str(REPO / "configs" / "laion_adapt.yaml"),
    {"clip": [], "siglip": ["loss.kind=siglip"], "locked_image": [LOCKED],
     "locked_image_siglip": [LOCKED, "loss.kind=siglip"],
     "vit": VIT, "vit_patch_dropout": [*VIT, "model.patch_dropout=0.5"]},
    ROWS, fixed=["train.report_to=[]"],
    # one trial at a time on 2 cores, as paraphrase_strategies; the two losses' training losses are on different
    # scales (a softmax over the batch vs a sum of binary terms): compare the evaluations, not the last row
    demo=["train.cpus_per_worker=0.45", "train.max_steps=40", "train.warmup_steps=5", "train.checkpoint_every=40"],
    demo_variants=("clip", "siglip", "locked_image"))

if __name__ == "__main__":
    sys.exit(COMPARISON.main())
