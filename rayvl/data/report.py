"""The run's data report: every sample seen, kept and dropped (by reason), counted across all Ray Data tasks, and
how it is printed. Nothing is lost silently: a dropped sample, a truncated shard or an emptied caption is a count
here, and the counts ride in every metrics report and in ``data_report.json``."""
from __future__ import annotations

from collections import Counter

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class DataPlaneError(RuntimeError):
    """The data path cannot produce training data (no shards, every sample dropped, a starved pipeline)."""


@ray.remote(num_cpus=0)
class DataReport:
    """Counts every sample seen and every sample dropped (by reason) across all Ray Data tasks of one run."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.bad_shards: dict[str, str] = {}

    def add(self, counts: dict, bad_shard: tuple[str, str] | None = None) -> None:
        self.counts.update(counts)
        if bad_shard:
            self.bad_shards[bad_shard[0]] = bad_shard[1]

    def snapshot(self) -> dict:
        return {"counts": dict(self.counts), "bad_shards": dict(self.bad_shards)}


_handles: dict = {}


def report_actor(name: str):
    """The run's DataReport actor. The driver calls this first, so the actor is owned by (and dies with) the
    driver; Ray Data tasks then find the existing one (get_if_exists makes that race-free)."""
    if name not in _handles:
        # on the driver's node: a worker node the autoscaler (or a spot market) takes away must not take the
        # run's counts with it
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        _handles[name] = DataReport.options(name=name, namespace="rayvl", get_if_exists=True,
                                            scheduling_strategy=here).remote()
    return _handles[name]


def record(report_name: str | None, counts: dict, bad_shard: tuple[str, str] | None = None) -> None:
    """Add counts to the named report. Waited for: the counts are recorded before the (last) batch they describe
    is emitted, so whoever has consumed the data also sees its counts — a fire-and-forget call could still be in
    flight. Callers batch their counts (a read task once per shard), so the round trip is not per batch."""
    if report_name:
        ray.get(report_actor(report_name).add.remote(counts, bad_shard))


def snapshot(report_name: str) -> dict:
    return ray.get(report_actor(report_name).snapshot.remote())


# ----------------------------------------------------------------------------- how a report reads

def caption_stats(counts: dict) -> dict:
    """Average caption length (words) of the kept samples and, with BoW, before deformation and the dataset-size
    change caused by emptied captions — the columns of [BoW] Tables 2 and 5."""
    out = {"avg_caption_words": counts.get("caption_words", 0) / max(1, counts.get("samples_kept", 0)),
           "bow_dataset_change_pct": 0.0}
    if counts.get("bow_captions_in"):
        n = counts["bow_captions_in"]
        out.update({"bow_avg_words_before": counts["bow_words_in"] / n,
                    "bow_dataset_change_pct": -100.0 * counts.get("dropped_bow_empty", 0) / n + 0.0,
                    "bow_base_share_pct": 100.0 * counts.get("bow_base_captions", 0) / n})
    return out


def _drop_lines(report: dict) -> list[str]:
    counts = report.get("counts", {})
    lines = [f"  {k}: {v}" for k, v in sorted(counts.items()) if k.startswith(("dropped_", "truncated_"))]
    return lines + [f"  bad shard {path}: {why}" for path, why in report.get("bad_shards", {}).items()]


def _caption_line(counts: dict) -> str:
    c = caption_stats(counts)
    if "bow_avg_words_before" not in c:
        return f"  captions: {c['avg_caption_words']:.1f} words on average"
    return (f"  captions: BoW {c['bow_avg_words_before']:.1f} → {c['avg_caption_words']:.1f} words on average, "
            f"dataset {c['bow_dataset_change_pct']:+.1f}% (emptied captions dropped), "
            f"{c['bow_base_share_pct']:.1f}% kept intact (base split)")


def format_data_report(report: dict) -> str:
    counts = report.get("counts", {})
    lines = [f"training: seen {counts.get('samples_seen', 0)}, kept {counts.get('samples_kept', 0)} "
             f"(all passes over the data; img2dataset lists {report.get('img2dataset_successes_per_pass')} "
             f"successful samples per pass)", _caption_line(counts), *_drop_lines(report)]
    if "tonics_rows" in counts:  # [TOnICS] App. A.1: one row per (pair, aligned noun)
        lines.insert(2, f"  TOnICS: {counts['tonics_rows']} rows from {counts.get('samples_kept', 0)} pairs; "
                        f"{counts.get('tonics_unaligned_pairs', 0)} pairs without an aligned noun (root-only rows)")
    if "image_label" in report:
        lab = report["image_label"].get("counts", {})
        lines += [f"image-label: seen {lab.get('samples_seen', 0)}, kept {lab.get('samples_kept', 0)}, "
                  f"{lab.get('excluded_held_out_class', 0)} of held-out classes excluded",
                  *_drop_lines(report["image_label"])]
    if "eval" in report:
        held = report["eval"].get("counts", {})
        lines += [f"held-out: seen {held.get('samples_seen', 0)}, kept {held.get('samples_kept', 0)} "
                  f"(every rank reads the whole held-out split)", *_drop_lines(report["eval"])]
    return "\n".join(lines)
