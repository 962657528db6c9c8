"""Linear probes on frozen image features, two protocols.

- On the held-out set alone (``linear_probe``): multinomial logistic regression (scikit-learn's L-BFGS), the inverse
  regularisation strength C chosen on a validation split — CLIP's protocol ([CLIP] App. A.3: sweep C, keep the best
  on validation, report on test) — on a stratified 60/20/20 split of the set's own labelled images.
- On a set's train split (``clip_benchmark_probe``): CLIP_benchmark's ``linear_probe`` task, step for step — L2-normed
  features, a linear layer trained with AdamW and a cosine schedule without warm-up for ``epochs`` passes of shuffled
  batches, weight decay 0, or, given a validation share of the train split, the decay searched on it as
  CLIP_benchmark searches it (97 values from 1e-6 to 1e2, 7 first, then halving steps around the best) and the
  layer trained again on train + validation (few-shot: on the k shots alone); top-1, top-5 (past 5 classes) and the
  mean per-class recall on test. In fp32 (CLIP_benchmark: fp16 autocast on its GPU).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)
# CLIP_benchmark's weight-decay grid (np.logspace(-6, 2, 97)); its first pass tries every 16th value
DECAY_GRID = np.logspace(-6, 2, num=97)
DECAY_FIRST = tuple(range(0, len(DECAY_GRID), 16))


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


@dataclass(frozen=True)
class ProbeSettings:
    """CLIP_benchmark's linear-probe options, its defaults: ``--train_split``, ``--fewshot_k`` (-1: every image),
    ``--fewshot_epochs``, ``--fewshot_lr``, ``--batch_size`` (the probe's), ``--val_proportion``, ``--seed``."""

    train_split: str = "train"
    fewshot_k: int = -1
    epochs: int = 10
    lr: float = 0.1
    batch_size: int = 64
    val_proportion: float = 0.0
    seed: int = 0

    def check(self) -> None:
        if self.fewshot_k == 0 or self.fewshot_k < -1:
            raise ValueError(f"--fewshot-k {self.fewshot_k}: images per class, or -1 for all")
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError("--fewshot-epochs, --probe-batch-size, --fewshot-lr: must be > 0")
        if not 0 <= self.val_proportion < 1:
            raise ValueError(f"--val-proportion {self.val_proportion:g}: a share of the train split, in [0, 1)")


@dataclass
class ProbeTrain:
    """A set's train split as the probe takes it: its images' embeddings and class ids (-1: none), and how to fit."""

    features: np.ndarray
    labels: np.ndarray
    settings: ProbeSettings


class NotProbed(ValueError):
    """The train split cannot be probed as asked (no image with a class, fewer than k of a class): the task is
    skipped for the set, saying why, as CLIP_benchmark stops ("insufficient data for this eval")."""


def clip_benchmark_probe(train: ProbeTrain, test_x: np.ndarray, test_y: np.ndarray) -> dict:
    """CLIP_benchmark's linear probe (module docstring) of ``train`` scored on the test features, in percent: its
    cli's ``random_split`` of the train split into train and validation parts (``val_proportion``), then its
    ``evaluate``: k shots of each class from the train part, the weight decay searched on the validation part, the
    layer fitted to the shots and the validation part (every image) or to the shots alone (few-shot)."""
    s = train.settings
    known = train.labels >= 0
    x = torch.nn.functional.normalize(torch.as_tensor(train.features[known], dtype=torch.float32), dim=-1)
    y = torch.as_tensor(train.labels[known], dtype=torch.int64)
    if len(y) == 0:
        raise NotProbed(f"the {s.train_split} split has no image with a class")
    generator = torch.Generator().manual_seed(s.seed)
    rest, val = torch.arange(len(y)), torch.zeros(0, dtype=torch.int64)
    if s.val_proportion > 0:
        parts = torch.utils.data.random_split(rest, [1 - s.val_proportion, s.val_proportion], generator=generator)
        rest, val = (torch.as_tensor(part.indices, dtype=torch.int64) for part in parts)
        if not len(val) or not len(rest):
            raise NotProbed(f"--val-proportion {s.val_proportion:g} of {len(y)} images leaves a part empty")
    shots = rest[_fewshot(y[rest], s.fewshot_k, generator)]
    classes = int(y.max()) + 1  # CLIP_benchmark's outputs: the train split's classes (a test class past them: a miss)
    decay, fit_on = 0.0, shots
    if len(val):
        decay = _searched_decay((x[shots], y[shots]), (x[val], y[val]), classes, s)
        fit_on = torch.cat([shots, val]) if s.fewshot_k < 0 else shots
    fit_on = (x[fit_on], y[fit_on])
    layer = trained_layer(*fit_on, classes, decay, s)
    test = torch.nn.functional.normalize(torch.as_tensor(test_x, dtype=torch.float32), dim=-1)
    with torch.no_grad():
        logits = layer(test)
    target = torch.as_tensor(test_y, dtype=torch.int64)
    top = logits.topk(min(5, classes), dim=1).indices
    from sklearn.metrics import balanced_accuracy_score

    out = {"linear_probe_top1": 100.0 * float((top[:, 0] == target).double().mean()),
           "linear_probe_mean_per_class_recall": 100.0 * float(balanced_accuracy_score(target, top[:, 0])),
           "linear_probe_weight_decay": decay, "linear_probe_chance_top1": 100.0 / classes,
           "linear_probe_train": int(len(fit_on[1])), "linear_probe_test": int(len(target)),
           "linear_probe_protocol": "clip_benchmark", **{f"linear_probe_{k}": v for k, v in asdict(s).items()}}
    if int(target.max()) >= 5:  # CLIP_benchmark reports top-5 where the test labels go past 5 classes
        out["linear_probe_top5"] = 100.0 * float((top == target[:, None]).any(dim=1).double().mean())
    return out


def _fewshot(y: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Every row (k = -1), or the first k of each class in a seeded permutation; a class with fewer is an error
    (CLIP_benchmark stops: 'insufficient data for this eval')."""
    order = torch.randperm(len(y), generator=generator)
    if k < 0:
        return order
    taken: dict[int, int] = {}
    keep = []
    for i in order.tolist():
        c = int(y[i])
        if taken.get(c, 0) < k:
            taken[c] = taken.get(c, 0) + 1
            keep.append(i)
    short = sorted(c for c, n in taken.items() if n < k)
    if short:
        raise NotProbed(f"--fewshot-k {k}: the train split has fewer than {k} images of class(es) {short[:10]}")
    return torch.tensor(keep, dtype=torch.int64)


def trained_layer(x: torch.Tensor, y: torch.Tensor, classes: int, decay: float, s: ProbeSettings) -> torch.nn.Linear:
    """A linear layer fitted to (x, y) as CLIP_benchmark's ``train`` fits it: ``torch.manual_seed(seed)``, the layer
    built, then shuffled batches drawn from the same seeded RNG each epoch, AdamW, the learning rate
    cosine-annealed to 0 over every batch of every epoch (its ``cosine_lr`` with no warm-up), cross-entropy. The
    process's own RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        layer = torch.nn.Linear(x.shape[1], classes)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=s.batch_size,
                                             shuffle=True)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=s.lr, weight_decay=decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=s.epochs * len(loader), eta_min=0.0)
        for _ in range(s.epochs):
            for batch_x, batch_y in loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(layer(batch_x), batch_y).backward()
                optimizer.step()
                schedule.step()
    return layer.eval()


def _searched_decay(fit: tuple, val: tuple, classes: int, s: ProbeSettings) -> float:
    """CLIP_benchmark's weight-decay search: ``find_peak`` over DECAY_FIRST on validation top-1, then over the peak
    and its neighbours 8, 4, 2, 1 grid steps away — its rule exactly: the first strictly better one wins, from
    index 0 at accuracy 0."""
    scores: dict[int, float] = {}  # each decay's layer is trained once (the fit is deterministic)

    def find_peak(candidates) -> int:
        best, top = 0, 0.0
        for i in candidates:
            if i not in scores:
                layer = trained_layer(*fit, classes, float(DECAY_GRID[i]), s)
                with torch.no_grad():
                    scores[i] = float((layer(val[0]).argmax(1) == val[1]).float().mean())
            if top < scores[i]:
                best, top = i, scores[i]
        return best

    peak = find_peak(DECAY_FIRST)
    for span in (8, 4, 2, 1):
        peak = find_peak([max(peak - span, 0), peak, min(peak + span, len(DECAY_GRID) - 1)])
    return float(DECAY_GRID[peak])
