"""[BoW]'s part of a run's data report: the caption lengths before and after the deformation and the dataset-size
change from emptied captions — the columns of [BoW] Tables 2 and 5 (rayvl.plugins: ``Method.report``)."""
from __future__ import annotations


def statistics(counts: dict) -> dict:
    """Words a caption had on average before the deformation, the dataset's change (emptied captions dropped) and
    the base split's share; the change is 0 for a run without BoW (a comparison's control arm)."""
    out = {"bow_dataset_change_pct": 0.0}
    n = counts.get("bow_captions_in")
    if n:
        out.update({"bow_avg_words_before": counts["bow_words_in"] / n,
                    "bow_dataset_change_pct": -100.0 * counts.get("dropped_bow_empty", 0) / n + 0.0,
                    "bow_base_share_pct": 100.0 * counts.get("bow_base_captions", 0) / n})
    return out


def lines(report: dict) -> list[str]:
    counts = report.get("counts", {})
    s = statistics(counts)
    if "bow_avg_words_before" not in s:
        return []
    pseudo = counts.get("pseudo_bow_captions")
    return [f"  BoW: {s['bow_avg_words_before']:.1f} words a caption before the deformation, dataset "
            f"{s['bow_dataset_change_pct']:+.1f}% (emptied captions dropped), {s['bow_base_share_pct']:.1f}% kept "
            f"intact (base split)" + (f", {pseudo} pseudo-BoW captions trained as they are" if pseudo else "")]
