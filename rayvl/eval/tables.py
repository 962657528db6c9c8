"""Tables a person reads: training-time evaluation next to chance, `rayvl eval`'s per-task tables, and
comparison runs side by side."""
from __future__ import annotations


def format_eval_table(metrics: dict) -> str:
    """Each metric next to its chance level."""
    rows = [("metric", "value %", "chance %")]
    if "zeroshot_top1" in metrics:
        n = metrics.get("zeroshot_classes", 0)
        rows.append((f"zero-shot top-1 ({n} classes)", f"{metrics['zeroshot_top1']:.1f}",
                     f"{metrics['zeroshot_chance_top1']:.1f}"))
        if "zeroshot_top5" in metrics:
            rows.append(("zero-shot top-5", f"{metrics['zeroshot_top5']:.1f}", f"{min(100, 500 / n):.1f}"))
        rows.append(("zero-shot mean per-class recall", f"{metrics['zeroshot_mean_per_class_recall']:.1f}",
                     f"{metrics['zeroshot_chance_top1']:.1f}"))
    if "zeroshot_mean_average_precision" in metrics:  # a multilabel set's (no chance level stated)
        rows.append((f"zero-shot mAP ({metrics.get('zeroshot_classes', 0)} classes, several an image)",
                     f"{metrics['zeroshot_mean_average_precision']:.1f}", "-"))
    for direction, label in (("i2t", "image→text"), ("t2i", "text→image")):
        for k in (1, 5, 10):
            key = f"{direction}_R@{k}"
            if key in metrics:
                rows.append((f"{label} R@{k} ({metrics.get('eval_images', '?')} pairs)", f"{metrics[key]:.1f}",
                             f"{metrics[f'{direction}_chance_R@{k}']:.1f}"))
    k = next((key.split("@")[1] for key in metrics if key.startswith("paraphrase_AO@")), None)
    if k:
        rows.append((f"paraphrase AO@{k} ({metrics['paraphrase_pairs']} pairs)",
                     f"{metrics[f'paraphrase_AO@{k}']:.1f}", "-"))
        rows.append((f"paraphrase JS@{k}", f"{metrics[f'paraphrase_JS@{k}']:.1f}", "-"))
    if "sts_spearman" in metrics:
        rows.append((f"STS Spearman ({metrics['sts_pairs']} pairs)", f"{metrics['sts_spearman']:.1f}", "0.0"))
        rows.append(("STS Pearson", f"{metrics['sts_pearson']:.1f}", "0.0"))
    if len(rows) == 1:
        return NO_EVALUATION
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>8}  {c:>8}" for a, b, c in rows)


NO_EVALUATION = "none ran: no held-out data (data.eval, --eval-data) or eval.tasks=[]"


def format_tables(results: dict) -> str:
    lines = []
    for task, metrics in results.items():
        if task == "skipped":
            lines += ["\n== skipped ==", *[f"{t}: {why}" for t, why in metrics.items()]]
            continue
        lines.append(f"\n== {task} ==")
        width = max(len(k) for k in metrics)
        for key, value in metrics.items():
            small = isinstance(value, float) and 0 < abs(value) < 0.01  # a searched weight decay, say
            shown = f"{value:>8.3g}" if small else f"{value:>8.2f}" if isinstance(value, float) else f"{value:>8}"
            lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)


def format_side_by_side(results: dict[str, dict], rows: list[tuple[str, str, str]]) -> str:
    names = list(results)
    table = [("", *names)] + [(label, *(format(results[n][key], fmt) if key in results[n] else "-" for n in names))
                              for label, key, fmt in rows]
    width = max(len(r[0]) for r in table)
    cols = [max(len(r[i]) for r in table) for i in range(1, len(names) + 1)]
    return "\n".join(f"{r[0]:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(r[1:], cols)) for r in table)
