"""The five evaluation tasks, written once. Training-time evaluation and ``rayvl eval`` call ``evaluate`` with the
same data and differ only in the embedder (``rayvl.eval.embed``): the images and every text the tasks name are
embedded once, then each task turns the embeddings it needs into metrics with the functions of zeroshot /
retrieval / paraphrase / sts / linear_probe."""
from __future__ import annotations

import logging
import time

from typing import Protocol

import numpy as np
import torch

from rayvl.config import EVAL_TASKS
from rayvl.data.prompts import SINGLE_TEMPLATE
from rayvl.eval.data import EvalData
from rayvl.eval.linear_probe import NotProbed, clip_benchmark_probe
from rayvl.eval.linear_probe import linear_probe as fit_linear_probe
from rayvl.eval.linear_probe import split_indices
from rayvl.eval.paraphrase import expand_queries, paraphrase_metrics
from rayvl.eval.retrieval import retrieval_metrics
from rayvl.eval.sts import sts_metrics
from rayvl.eval.zeroshot import class_embeddings, multilabel_metrics, zeroshot_metrics

# the tasks training runs (config.EVAL_TASKS) and the linear probe, which fits a classifier: `rayvl eval` only
TASKS = (*EVAL_TASKS, "linear_probe")
SKIP_REASONS = {"zeroshot": "no class names or labels", "retrieval": "the data has no captions",
                "paraphrase": "no paraphrase file", "sts": "no STS file",
                "linear_probe": "fewer than 10 labelled images (with a train split: none in the evaluated split)"}
# what the tasks' metric names start with (training reports mix them with the training metrics)
log = logging.getLogger("rayvl")
METRIC_PREFIXES = ("eval_", "zeroshot", "single_template", "t2i", "i2t", "retrieval", "paraphrase", "qe_", "sts")
# parts of the names of what an evaluation reports about itself, not the model: chance levels and set sizes. They
# stay the same from one evaluation to the next; plots, TensorBoard and MLflow leave them out, metrics.jsonl holds
# each once (and again when it changes), eval.json all of them
CONSTANTS = ("_chance_", "zeroshot_classes", "zeroshot_templates", "_images", "_captions", "_pairs", "_queries",
             "linear_probe_train", "linear_probe_test")


def is_constant(key: str) -> bool:
    return any(part in key for part in CONSTANTS)


class Embedder(Protocol):
    def images(self, images) -> np.ndarray: ...

    def texts(self, texts: list[str]) -> np.ndarray: ...


def evaluate(tasks, data: EvalData, embedder: Embedder, k: int = 10,
             image_embeddings: np.ndarray | None = None) -> tuple[dict, dict]:
    """({task: metrics} for every task the data allows — and ``skipped``: {task: why} for one the data allows that
    could not run as asked —, {name: embeddings} computed on the way); the images are embedded here unless their
    ``image_embeddings`` are given."""
    if image_embeddings is None:
        image_embeddings = embedded_images(embedder, data.images)
    embeddings = {"image": image_embeddings}
    start = time.perf_counter()
    embedder = TextsOnce(embedder, [t for task in tasks for t in _TEXTS[task](data)])
    if embedder.rows:
        log.info(f"eval: {len(embedder.rows)} texts embedded ({time.perf_counter() - start:.1f} s)")
    results, reasons = {}, {}
    for i, task in enumerate(tasks):
        start = time.perf_counter()
        try:
            metrics = _RUN[task](data, embeddings, embedder, k)
        except NotProbed as e:  # the set cannot be probed as asked (its train split or labels): skipped
            log.warning(f"eval: linear_probe skipped: {e}")
            metrics, reasons[task] = None, str(e)
        if metrics is not None:
            results[task] = metrics
        log.info(f"eval: task {i + 1}/{len(tasks)} {task} {'done' if metrics is not None else 'skipped'} "
                 f"({time.perf_counter() - start:.1f} s)")
    if reasons:  # why a task the data allows did not run (the others: SKIP_REASONS)
        results["skipped"] = reasons
    return results, embeddings


def embedded_images(embedder: Embedder, images) -> np.ndarray:
    start = time.perf_counter()
    out = embedder.images(images)
    log.info(f"eval: {len(out)} images embedded ({time.perf_counter() - start:.1f} s)")
    return out


class TextsOnce:
    """Every text the tasks will ask for, embedded in one call: with Ray Data actors, one actor pool (each actor
    loading the checkpoint) instead of one per task."""

    def __init__(self, embedder: Embedder, texts: list[str]):
        self.embedder = embedder
        self.rows = {t: i for i, t in enumerate(dict.fromkeys(texts))}
        self.embeddings = embedder.texts(list(self.rows)) if self.rows else None

    def images(self, images) -> np.ndarray:
        return self.embedder.images(images)

    def texts(self, texts: list[str]) -> np.ndarray:
        return self.embeddings[[self.rows[t] for t in texts]]


def zeroshot(data: EvalData, emb: dict, embedder: Embedder, k: int) -> dict | None:
    """Template-ensemble class embeddings (CLIP) and one template alone: CLIP's "a photo of a {}." where the set
    has it, else its first."""
    prompts = zeroshot_texts(data)
    if not prompts:
        return None
    if data.multilabel:
        return zeroshot_multilabel(data, emb, embedder.texts(prompts))
    known = (data.labels >= 0) & (data.labels < len(data.classes))
    # a class id past the class list (a class file not the set's): those images are left out and counted
    unlisted = int((data.labels >= len(data.classes)).sum())
    if unlisted:
        log.warning(f"eval: zeroshot: {unlisted} images have a class id ≥ the {len(data.classes)} names of the class "
                    f"list (largest {int(data.labels.max())}); they are left out of the zero-shot metrics")
    if not known.any():
        return None
    images, labels = torch.from_numpy(emb["image"][known]), torch.from_numpy(data.labels[known])
    out = _ensemble_and_one_template(data, embedder.texts(prompts),
                                     lambda classes: zeroshot_metrics(images, labels, torch.from_numpy(classes)))
    if unlisted:
        out["zeroshot_unlisted_images"] = unlisted
    return out


def zeroshot_multilabel(data: EvalData, emb: dict, prompts: np.ndarray) -> dict | None:
    """A multilabel set's zero-shot score: mean average precision over its classes (CLIP_benchmark's), for the
    template ensemble and for one template alone, over the images whose label set is known (each a vector as long
    as the class list: pipeline._label_set)."""
    known = [i for i, s in enumerate(data.label_sets) if s is not None]
    if not known:
        return None
    targets = np.zeros((len(known), len(data.classes)), np.float64)
    for row, i in enumerate(known):
        targets[row, data.label_sets[i]] = 1.0
    images = emb["image"][known]
    out = _ensemble_and_one_template(data, prompts, lambda classes: multilabel_metrics(images, targets, classes))
    out["zeroshot_multilabel_images"] = len(known)
    return out


def _ensemble_and_one_template(data: EvalData, prompts: np.ndarray, score) -> dict:
    """``score`` of the class embeddings of the template ensemble, and (``single_template_…``, chance levels left
    out) of one template alone, with the class and template counts; ``prompts``: zeroshot_texts' embeddings."""
    per_template = prompts.reshape(len(data.classes), len(data.templates), -1)
    out = score(class_embeddings(per_template))
    one = data.templates.index(SINGLE_TEMPLATE) if SINGLE_TEMPLATE in data.templates else 0
    single = score(class_embeddings(per_template[:, one:one + 1]))
    out.update({f"single_template_{name}": v for name, v in single.items() if "chance" not in name})
    out["zeroshot_classes"], out["zeroshot_templates"] = len(data.classes), len(data.templates)
    return out


def zeroshot_texts(data: EvalData) -> list[str]:
    """Every class name in every template (none when no image has a known class)."""
    if not data.classes or not data.labelled():
        return []
    return [t.format(c) for c in data.classes for t in data.templates]


def retrieval(data: EvalData, emb: dict, embedder: Embedder, k: int) -> dict | None:
    if not data.captions:
        return None
    emb["caption"] = embedder.texts(data.captions)
    # the distinct images with captions: rows of one photo under several keys are one image with all their captions,
    # an image kept for the class tasks without one is left out (EvalData.captioned)
    rows, caption_to_image = data.captioned()
    return retrieval_metrics(emb["image"][rows], emb["caption"], caption_to_image)


def paraphrase(data: EvalData, emb: dict, embedder: Embedder, k: int) -> dict | None:
    """AO@k / JS@k ([Paraphrase] §3) and, when the pairs bring expansions, the query-expansion baseline (§5.2)."""
    pairs = data.paraphrases
    if not pairs:
        return None
    n, n_exp = len(pairs), _expansions(pairs)
    texts = embedder.texts(paraphrase_texts(data))
    queries, paraphrases = texts[:n], texts[n:2 * n]
    # the distinct images, as retrieval ranks them: one photo stored under several keys is one image of the lists
    gallery = emb["image"][data.retrieval_images()]
    out = paraphrase_metrics(gallery, queries, paraphrases, k)
    if n_exp:  # the query is replaced by eq. (5)'s average of itself and its expansions
        expanded = expand_queries(queries, texts[2 * n:].reshape(n, n_exp, -1))
        out.update({f"qe_{name}": v for name, v in paraphrase_metrics(gallery, expanded, paraphrases, k).items()
                    if name != "paraphrase_pairs"})
    return out


def _expansions(pairs: list[dict]) -> int:
    return min(len(p.get("expansions", [])) for p in pairs)


def paraphrase_texts(data: EvalData) -> list[str]:
    """The queries, then their paraphrases, then each query's expansions (as many per query as every pair has)."""
    pairs, n_exp = data.paraphrases, _expansions(data.paraphrases) if data.paraphrases else 0
    return ([p["caption"] for p in pairs] + [p["paraphrase"] for p in pairs]
            + [e for p in pairs for e in p.get("expansions", [])[:n_exp]])


def sts_texts(data: EvalData) -> list[str]:
    return data.sts[0] + data.sts[1] if data.sts is not None else []


def sts(data: EvalData, emb: dict, embedder: Embedder, k: int) -> dict | None:
    if data.sts is None:
        return None
    first, second, gold = data.sts
    texts = embedder.texts(sts_texts(data))
    return sts_metrics(texts[:len(first)], texts[len(first):], gold)


def linear_probe(data: EvalData, emb: dict, embedder: Embedder, k: int) -> dict | None:
    """CLIP_benchmark's probe, trained on the set's train split, where the set brings one (``data.probe``); else
    CLIP's logistic regression on a split of the set's own labelled images. A multilabel set is not probed
    (CLIP_benchmark's probe is single-label)."""
    if data.multilabel:
        raise NotProbed("a multilabel set (its images' classes from npy members): the linear probe fits one class "
                        "an image")
    known = np.flatnonzero(data.labels >= 0)
    if data.probe is not None:
        return clip_benchmark_probe(data.probe, emb["image"][known], data.labels[known]) if len(known) else None
    if len(known) < 10:
        return None
    x, y = emb["image"][known], data.labels[known]
    train, val, test = split_indices(y)
    return {**fit_linear_probe(x[train], y[train], x[val], y[val], x[test], y[test]),
            "linear_probe_protocol": "held_out_split"}


_RUN = {"zeroshot": zeroshot, "retrieval": retrieval, "paraphrase": paraphrase, "sts": sts,
        "linear_probe": linear_probe}
# the texts each task embeds (evaluate embeds them all at once, TextsOnce)
_TEXTS = {"zeroshot": zeroshot_texts, "retrieval": lambda data: list(data.captions), "paraphrase": paraphrase_texts,
          "sts": sts_texts, "linear_probe": lambda data: []}
