"""[TOnICS]'s part of a run's data report: the training rows its ontology made (rayvl.plugins: ``Method.report``)."""
from __future__ import annotations


def statistics(counts: dict) -> dict:
    return {}


def lines(report: dict) -> list[str]:
    counts = report.get("counts", {})
    if "tonics_rows" not in counts:
        return []
    # [TOnICS] App. A.1: one row per (pair, aligned class)
    return [f"  TOnICS: {counts['tonics_rows']} rows from {counts.get('samples_kept', 0)} pairs; "
            f"{counts.get('tonics_unaligned_pairs', 0)} pairs without an aligned noun (root-only rows)"]
