"""Fine-tune a whole pretrained CLIP, as open_clip's training does: both towers, both projections and the temperature.

    python jobs/clip_finetune.py --set model.init_from_clip=FILE [--data SHARDS --eval-data SHARDS] [--set k=v ...]
    ray job submit --working-dir . -- python jobs/clip_finetune.py \
        --set model.init_from_clip=s3://bucket/models/ViT-B-32.pt --data 's3://bucket/laion400m/{00000..41407}.tar'

FILE: OpenAI's ViT-B-32.pt, an open_clip checkpoint or a Hugging Face CLIPModel folder, at a local path; on a
cluster, a weights file on object storage (each node copies it once) or a path on a mount every node shares. No
CLIP ships with rayvl: the run refuses to start without one. With no --data it trains on the embedded demo dataset.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `ray job submit --working-dir .` runs from a copy

from rayvl.cli.recipes import run_recipe  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_recipe(str(Path(__file__).resolve().parent.parent / "configs" / "clip_finetune.yaml")))
