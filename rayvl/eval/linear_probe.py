"""Linear probe: multinomial logistic regression on frozen image features, C chosen on a validation split
(CLIP's protocol: sweep the inverse regularisation strength, keep the best on validation, report on test)."""
from __future__ import annotations

import numpy as np

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)


def linear_probe(train_x, train_y, val_x, val_y, test_x, test_y, c_grid=C_GRID, seed: int = 0) -> dict:
    from sklearn.linear_model import LogisticRegression

    best_c, best_acc = None, -1.0
    for c in c_grid:
        clf = LogisticRegression(C=c, max_iter=1000, random_state=seed).fit(train_x, train_y)
        acc = float(np.mean(clf.predict(val_x) == val_y))
        if acc > best_acc:
            best_c, best_acc = c, acc
    clf = LogisticRegression(C=best_c, max_iter=1000, random_state=seed).fit(
        np.concatenate([train_x, val_x]), np.concatenate([train_y, val_y]))
    classes = np.unique(np.concatenate([train_y, test_y]))
    return {"linear_probe_top1": 100.0 * float(np.mean(clf.predict(test_x) == test_y)),
            "linear_probe_C": best_c, "linear_probe_val_top1": 100.0 * best_acc,
            "linear_probe_chance_top1": 100.0 / len(classes), "linear_probe_train": int(len(train_y)),
            "linear_probe_test": int(len(test_y))}


def split_indices(labels: np.ndarray, fractions=(0.6, 0.2, 0.2), seed: int = 0):
    """Stratified train/val/test indices."""
    rng = np.random.default_rng(seed)
    parts = [[], [], []]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        a = int(round(fractions[0] * len(idx)))
        b = a + int(round(fractions[1] * len(idx)))
        for part, chunk in zip(parts, (idx[:a], idx[a:b], idx[b:])):
            part.extend(chunk.tolist())
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
