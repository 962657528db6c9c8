"""[UniCL]'s part of a run's data report: its image-label stream's own counts (rayvl.plugins: ``Method.report``)."""
from __future__ import annotations

from rayvl.data.report import drop_lines


def statistics(counts: dict) -> dict:
    return {}


def lines(report: dict) -> list[str]:
    if "image_label" not in report:
        return []
    stream = report["image_label"]
    counts = stream.get("counts", {})
    return [f"image-label: seen {counts.get('samples_seen', 0)}, kept {counts.get('samples_kept', 0)}, "
            f"{counts.get('excluded_held_out_class', 0)} of held-out classes excluded", *drop_lines(stream)]
