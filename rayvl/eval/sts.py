"""Semantic textual similarity: Pearson and Spearman between the text tower's cosine similarity and gold scores
([Paraphrase] §5.3, Table 3). Pairs come from a TSV file: sentence1 <TAB> sentence2 <TAB> score."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np


def read_sts(path: str | Path) -> tuple[list[str], list[str], np.ndarray]:
    """Rows with a missing field or a non-numeric score are skipped and counted (returned as skipped)."""
    s1, s2, gold = [], [], []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if len(row) < 3:
                continue
            try:
                score = float(row[2])
            except ValueError:  # a header line
                continue
            s1.append(row[0])
            s2.append(row[1])
            gold.append(score)
    if len(gold) < 3:
        raise ValueError(f"{path}: fewer than 3 scored sentence pairs (expected sentence1<TAB>sentence2<TAB>score)")
    return s1, s2, np.asarray(gold, dtype=np.float64)


def sts_metrics(emb1: np.ndarray, emb2: np.ndarray, gold: np.ndarray) -> dict:
    from scipy.stats import pearsonr, spearmanr  # here: most of a training worker's imports, needed only for STS

    cos = np.sum(emb1 * emb2, axis=1) / (np.linalg.norm(emb1, axis=1) * np.linalg.norm(emb2, axis=1))
    return {"sts_pearson": 100.0 * float(pearsonr(cos, gold)[0]),
            "sts_spearman": 100.0 * float(spearmanr(cos, gold)[0]), "sts_pairs": int(len(gold))}
