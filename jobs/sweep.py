"""A hyperparameter sweep with Ray Tune over a search space of tune_spaces/ (the same as `rayvl tune`).

    python jobs/sweep.py tune_spaces/alignment_depth.yaml [--set key=value ...] [--name NAME] [--resume]
    ray job submit --working-dir . -- python jobs/sweep.py tune_spaces/memory_bank.yaml --set data.train=s3://...
        --set eval.every_steps=2000 --set train.max_steps=20000 ...   (with data given, the budget is yours)

Every key and domain of the space is checked against the config tree before Ray starts. At the end it prints the
trial table and writes trials.csv, the plots and best_config.yaml into the sweep directory.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `ray job submit --working-dir .` runs from a copy

from rayvl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
