"""`rayvl eval`: every evaluation task on a checkpoint, embeddings computed by Ray Data actor pools.

Each task writes ``<out>/<task>.json``; embeddings are saved as ``.npy`` next to them.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from rayvl import assets
from rayvl.config import from_dict
from rayvl.data.shards import report_actor
from rayvl.data.text import tokenize
from rayvl.eval import datasets
from rayvl.eval.embed import ImageEmbedder, TextEmbedder, embed, load_model, resolve_checkpoint
from rayvl.eval.linear_probe import linear_probe, split_indices
from rayvl.eval.paraphrase import expand_queries, paraphrase_metrics
from rayvl.eval.retrieval import retrieval_metrics
from rayvl.eval.sts import read_sts, sts_metrics
from rayvl.eval.zeroshot import class_embeddings, zeroshot_metrics

TASKS = ("zeroshot", "retrieval", "paraphrase", "sts", "linear_probe")
SKIP_REASONS = {"zeroshot": "no class names or labels", "retrieval": "the data has no captions",
                "paraphrase": "no paraphrase file", "sts": "no STS file",
                "linear_probe": "fewer than 10 labelled images"}


@dataclass
class Sources:
    data: str
    kind: str
    classes: str = ""
    paraphrases: str = ""
    sts: str = ""


def default_sources(config: dict, data: str = "", kind: str = "auto", classes: str = "", paraphrases: str = "",
                    sts: str = "") -> Sources:
    """Unset sources default to the checkpoint's own held-out data (the demo's files when it trained on the demo)."""
    d = config["data"]
    demo = Path(d["demo_dir"]).expanduser()
    data = data or d["eval"] or (str(demo / "eval") if not d["train"] else "")
    if not data:
        raise ValueError("no evaluation data: pass --data (the checkpoint's config names no data.eval)")
    beside = Path(data).expanduser().parent  # the demo layout keeps these files next to the eval split
    pick = lambda given, name: given or (str(beside / name) if (beside / name).exists() else "")  # noqa: E731
    return Sources(data, datasets.detect_kind(data) if kind == "auto" else kind,
                   classes or d["classes"] or pick("", "classes.json"), pick(paraphrases, "paraphrases.jsonl"),
                   pick(sts, "sts.tsv"))


def _embed_texts(texts: list[str], checkpoint: Path, actors: int, cpus: float, batch_size: int) -> np.ndarray:
    ds = ray.data.from_items([{"index": i, "text": t} for i, t in enumerate(texts)])
    return embed(ds, TextEmbedder, str(checkpoint), actors=actors, cpus_per_actor=cpus, batch_size=batch_size)


def run_eval(checkpoint: str, tasks=TASKS, sources: Sources | None = None, out: str | Path | None = None,
             actors: int = 1, cpus_per_actor: float = 0.5, batch_size: int = 128, k: int = 10,
             limit: int = 0) -> dict:
    ckpt = resolve_checkpoint(checkpoint)
    model, config = load_model(ckpt)
    cfg = from_dict(config)
    sources = sources or default_sources(config)
    out = Path(out) if out else ckpt.parent / "eval"
    out.mkdir(parents=True, exist_ok=True)
    tok_path = str(assets.text_model_path(cfg.model.text))
    texts = lambda xs: _embed_texts(xs, ckpt, actors, cpus_per_actor, batch_size)  # noqa: E731
    results: dict = {}

    if sources.kind == "shards":
        report_name = f"rayvl-eval-report-{uuid.uuid4().hex[:8]}"
        report = report_actor(report_name)  # owned by this driver; counts the samples dropped while reading
        data = datasets.load_shards(sources.data, cfg.data.image_size, tok_path, cfg.data.max_text_tokens,
                                    cpus_per_actor, report_name)
        results["data"] = ray.get(report.snapshot.remote())["counts"]
    elif sources.kind == "imagefolder":
        data = datasets.load_imagefolder(sources.data, cfg.data.image_size, cpus_per_actor)
    else:
        data = datasets.load_fashion_mnist(sources.data, cfg.data.image_size, cpus_per_actor, limit=limit)
    if sources.classes:
        meta = json.loads(Path(sources.classes).read_text())
        data.classes, data.templates = meta["classes"], meta.get("templates") or datasets.DEFAULT_TEMPLATES
    image_emb = embed(data.images, ImageEmbedder, str(ckpt), actors=actors, cpus_per_actor=cpus_per_actor,
                      batch_size=batch_size, out=out / "image_embeddings.npy")

    if "zeroshot" in tasks and data.classes and (data.labels >= 0).any():
        def tok(xs):
            ids, mask = tokenize(xs, tok_path, cfg.data.max_text_tokens)
            return torch.from_numpy(ids), torch.from_numpy(mask)

        known = data.labels >= 0
        img, labels = torch.from_numpy(image_emb[known]), torch.from_numpy(data.labels[known])
        with torch.no_grad():
            ensemble = class_embeddings(model.encode_text, tok, data.classes, data.templates)
            single = class_embeddings(model.encode_text, tok, data.classes, data.templates[:1])
        r = zeroshot_metrics(img, labels, ensemble)
        r.update({f"single_template_{k_}": v for k_, v in zeroshot_metrics(img, labels, single).items()
                  if "chance" not in k_})
        r["zeroshot_classes"], r["zeroshot_templates"] = len(data.classes), len(data.templates)
        results["zeroshot"] = r
    if "retrieval" in tasks and data.captions:
        caption_emb = texts(data.captions)
        np.save(out / "caption_embeddings.npy", caption_emb)
        results["retrieval"] = retrieval_metrics(image_emb, caption_emb, data.caption_to_image)
    if "paraphrase" in tasks and sources.paraphrases:
        pairs = datasets.read_paraphrases(sources.paraphrases)
        n_exp = min((len(p.get("expansions", [])) for p in pairs), default=0)
        emb = texts([p["caption"] for p in pairs] + [p["paraphrase"] for p in pairs]
                    + [e for p in pairs for e in p.get("expansions", [])[:n_exp]])
        n = len(pairs)
        q, para = emb[:n], emb[n:2 * n]
        r = paraphrase_metrics(image_emb, q, para, k)
        if n_exp:  # seed 002 §5.2 query-expansion baseline: the query is replaced by eq. (5)'s average
            expanded = emb[2 * n:].reshape(n, n_exp, -1)
            r.update({f"qe_{k_}": v for k_, v in
                      paraphrase_metrics(image_emb, expand_queries(q, expanded), para, k).items()
                      if k_ != "paraphrase_pairs"})
        results["paraphrase"] = r
    if "sts" in tasks and sources.sts:
        s1, s2, gold = read_sts(sources.sts)
        emb = texts(s1 + s2)
        results["sts"] = sts_metrics(emb[:len(s1)], emb[len(s1):], gold)
    if "linear_probe" in tasks and (data.labels >= 0).sum() >= 10:
        known = np.flatnonzero(data.labels >= 0)
        tr, va, te = split_indices(data.labels[known])
        x, y = image_emb[known], data.labels[known]
        results["linear_probe"] = linear_probe(x[tr], y[tr], x[va], y[va], x[te], y[te])

    for task, metrics in results.items():
        if task in TASKS:
            (out / f"{task}.json").write_text(json.dumps(metrics, indent=2))
    skipped = [t for t in tasks if t not in results]  # "data" (read counts) is not a task
    if skipped:
        results["skipped"] = {t: SKIP_REASONS[t] for t in skipped}
    (out / "eval.json").write_text(json.dumps(results, indent=2))
    return results


def format_tables(results: dict) -> str:
    lines = []
    for task, metrics in results.items():
        if task == "skipped":
            lines += ["\n== skipped ==", *[f"{t}: {why}" for t, why in metrics.items()]]
            continue
        lines.append(f"\n== {task} ==")
        width = max(len(k) for k in metrics)
        for key, value in metrics.items():
            shown = f"{value:>8.2f}" if isinstance(value, float) else f"{value:>8}"
            lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)
