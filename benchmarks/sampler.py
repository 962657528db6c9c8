"""Cost of the TOnICS sampler per micro-batch (node draw + bucket bookkeeping + stacking rows) next to one training
step of the laion_adapt model on the same micro-batch (forward, backward, AdamW; one process, one core), measured
in this one run. Goal: sampler < 2 % of the step. Prints a table.

    .venv/bin/python benchmarks/sampler.py [--data SHARDS] [--micro-batch 32] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rayvl import assets  # noqa: E402
from rayvl.config import load_config  # noqa: E402
from rayvl.data.pipeline import Rows, preprocess  # noqa: E402
from rayvl.data import tar  # noqa: E402
from rayvl.data.specs import resolve_shards  # noqa: E402
from rayvl.data.tar import iter_tar_samples  # noqa: E402
from rayvl.data.demo import SHAPES, write_demo  # noqa: E402
from rayvl.methods.tonics.ontology import Ontology  # noqa: E402
from rayvl.methods.tonics.rows import Objects  # noqa: E402
from rayvl.methods.tonics.sampler import BucketSampler, draw_node  # noqa: E402
from rayvl.losses import clip_loss  # noqa: E402
from rayvl.models.dual_encoder import build_model  # noqa: E402

COLUMNS = ["image", "input_ids", "attention_mask", "object"]


def rows(paths, ontology, micro_batch: int) -> list[dict]:
    """The demo's training rows (one per aligned noun), preprocessed once, in micro-batch-sized stream batches."""
    kw = Rows(image_size=64, crop_scale_min=0.6, train=True, tokenizer_path=str(assets.text_model_path("minilm-l6")),
              max_tokens=24, transforms=(Objects(ontology),))
    out = []
    for path in paths:
        with open(path, "rb") as f:
            samples = list(iter_tar_samples(f))
        for i in range(0, len(samples), 64):
            batch = preprocess({c: [s.get(c) for s in samples[i:i + 64]] for c in tar.COLUMNS}, Counter(), kw)
            out.append({c: batch[c] for c in COLUMNS})
    flat = {c: np.concatenate([b[c] for b in out]) for c in COLUMNS}
    return [{c: v[i:i + micro_batch] for c, v in flat.items()} for i in range(0, len(flat["object"]), micro_batch)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--train-steps", type=int, default=10)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    spec = args.data or str(write_demo(Path(tempfile.mkdtemp()) / "demo", 4000, 10) / "train")
    ontology = Ontology.build(SHAPES)
    stream_batches = rows(resolve_shards(spec), ontology, args.micro_batch)

    def stream():
        while True:
            yield from stream_batches

    sampler = BucketSampler(stream(), COLUMNS, args.micro_batch, buffer_rows=2048, max_wait_rows=4096, seed=0,
                            rank=0)
    p_s = np.array([0.5] + [0.5 / len(SHAPES)] * len(SHAPES))
    sampler.batch(0, 0)  # fills the buffer once (what start-up costs, not per batch)
    t = time.perf_counter()
    for step in range(1, args.steps + 1):
        sampler.batch(draw_node(p_s, 0, step), step)
    sampler_s = (time.perf_counter() - t) / args.steps

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "laion_adapt.yaml")
    model = build_model(cfg.model, seed=0)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    batch = {k: torch.from_numpy(v) for k, v in sampler.batch(0, 0).items()}
    times = []
    for _ in range(args.train_steps + 1):
        t = time.perf_counter()
        img, txt, scale = model(batch["image"], batch["input_ids"], batch["attention_mask"])
        loss = clip_loss(img, txt, scale, False)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times[1:]))  # the first step pays allocator warm-up
    print(f"\nmicro-batch {args.micro_batch}, buffer 2048 rows, {len(SHAPES)} object classes, P_S(root) 0.5; one core")
    print(f"{'measure':<44} {'value':>10}")
    print(f"{'sampler per micro-batch (mean of ' + str(args.steps) + ')':<44} {1e3 * sampler_s:>8.2f} ms")
    print(f"{'training step, laion_adapt model (median)':<44} {1e3 * step_s:>8.1f} ms")
    print(f"{'sampler share of a step':<44} {100 * sampler_s / (sampler_s + step_s):>8.2f} %")
    print(f"{'fallback rows':<44} {sampler.counts['tonics_fallback_rows']:>10}")


if __name__ == "__main__":
    main()
