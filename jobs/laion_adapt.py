"""[Paraphrase]'s LAION adaptation recipe: frozen pretrained text encoder + appended alignment layers.

    python jobs/laion_adapt.py [--config configs/laion_adapt.yaml] [--data SHARDS] [--set key=value ...]
    ray job submit --working-dir . -- python jobs/laion_adapt.py --data 's3://bucket/laion400m/{00000..41407}.tar'

With no --data it trains on the embedded demo dataset (generated on first use).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `ray job submit --working-dir .` runs from a copy

from rayvl.cli.recipes import run_recipe  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_recipe(str(Path(__file__).resolve().parent.parent / "configs" / "laion_adapt.yaml")))
