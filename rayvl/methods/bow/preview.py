"""`rayvl bow preview`: the configured BoW cascade ([BoW] §2.2) on the first N captions — what a user reads before
committing to a BoW run. The base-split statistics come from the same Ray Data pass training uses."""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from rayvl import session
from rayvl.config import RayvlConfig
from rayvl.data.demo import DEMO_SEED, ensure_demo
from rayvl.data.shard_io import open_shard
from rayvl.data.specs import resolve_shards
from rayvl.data.tar import DAMAGED, iter_tar_samples
from rayvl.data.text import validate_caption
from rayvl.methods.bow.check import needs_stats as bow_needs_stats
from rayvl.methods.bow.check import parse_ops as parse_bow_ops
from rayvl.methods.bow.rows import deformer as bow_deformer


def preview(cfg: RayvlConfig, data: str = "", n: int = 20, stats: str = "") -> None:
    """Print intact → deformed captions of the first ``n`` samples and the average length before and after.
    Raises ConfigError / DataPlaneError for bad settings or data."""
    if not data:
        d = cfg.data
        data = str(ensure_demo(d.demo_dir, d.demo_samples, d.demo_eval_samples, seed=DEMO_SEED) / "train")
    paths = resolve_shards(data)
    # the preview shows the cascade whether or not the recipe switches it on
    cfg = dataclasses.replace(cfg, bow=dataclasses.replace(
        cfg.bow, enabled=True, stats_path=stats or str(Path(tempfile.mkdtemp()) / "bow_stats.json")))
    if bow_needs_stats(parse_bow_ops(cfg.bow.ops)):  # the statistics pass runs on Ray Data
        session.connect(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    deform = bow_deformer(cfg, data, "")
    print(f"cascade: {' + '.join(op.name + (f'({op.arg})' if op.arg is not None else '') for op in deform.ops)}; "
          f"base split {cfg.bow.base_fraction:.0%}\n")
    shown = before = after = emptied = 0
    for key, text in _captions(paths, n):
        out, base = deform(key, text)
        note = "  (base: intact)" if base else ("  (emptied: sample dropped)" if not out else "")
        print(f"{key}: {text}\n{'':>{len(key)}}  → {out}{note}")
        shown, before, after, emptied = shown + 1, before + len(text.split()), after + len(out.split()), emptied
        emptied += not out
    print(f"\n{shown} captions: {before / max(1, shown):.1f} → {after / max(1, shown - emptied):.1f} words on "
          f"average, {emptied} emptied")


def _captions(paths: list[str], n: int):
    """(key, caption) of the first n samples with a valid caption."""
    shown = 0
    for path in paths:
        with open_shard(path) as f:
            try:
                for sample in iter_tar_samples(f, ("key", "txt")):
                    text, reason = validate_caption(sample.get("txt"))
                    if reason:
                        continue
                    yield sample["key"], text
                    shown += 1
                    if shown >= n:
                        return
            except DAMAGED:
                continue  # a damaged shard's tail: the next shard's captions
