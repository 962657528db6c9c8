"""`rayvl eval`: every evaluation task on a checkpoint, embeddings computed by one pool of warm actors fed by Ray
Data (on CPU, or each actor on its GPUs) — or, on a machine of its own with one model to run, by that model in this
process fed by a local DataLoader, with no Ray at all (``session.runs_without_ray``) —, the nearest-neighbour
searches of the tasks by faiss in this process (on every GPU it sees).

Each task writes ``<out>/<task>.json``; embeddings are saved as ``.npy`` next to them.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import ray
import torch

from rayvl import assets, http_objects, spec_syntax, storage
from rayvl.checkpoints import checkpoint_uri, read_meta
from rayvl.config import EvalConfig, from_dict
from rayvl.data import clip_benchmark
from rayvl.data.report import create_report, release_reports, snapshot
from rayvl.eval import data as eval_data
from rayvl.eval import local_read
from rayvl.eval.embed import ActorEmbedder, LocalEmbedder
from rayvl.eval.embed import batch_size as embed_batch
from rayvl.eval.linear_probe import ProbeSettings, ProbeTrain
from rayvl.eval.tasks import SKIP_REASONS, evaluate

log = logging.getLogger("rayvl")


@dataclass
class Sources:
    data: str
    kind: str
    classes: str = ""
    paraphrases: str = ""
    sts: str = ""
    probe_train: str = ""  # a CLIP_benchmark set's train split's shards: the linear probe's training images
    label_vectors: int = 0  # a multilabel set's class count: its samples' npy vectors are their classes


def default_sources(config: dict, data: str = "", kind: str = "auto", classes: str = "", paraphrases: str = "",
                    sts: str = "", probe_split: str = "") -> Sources:
    """Unset sources default to the checkpoint's own held-out data and files (the demo's when it trained on the
    demo), then to files of those names next to the data. A CLIP_benchmark set (its root or a split's folder,
    rayvl.data.clip_benchmark) is its split's shards with its class names and templates — and, given a
    ``probe_split`` the set has (another than the one evaluated), that split's shards for the linear probe."""
    d = config["data"]
    demo = Path(d["demo_dir"]).expanduser()
    own = not data  # the checkpoint's own held-out data: its own files go with it
    # a relative --data means this folder (Ray Data's read tasks run in others)
    data = (spec_syntax.absolute(data, os.getcwd()) if data and (os.sep in data or os.path.exists(data))
            else data or d["eval"] or (str(demo / "eval") if not d["train"] else ""))
    if not data:
        raise ValueError("no evaluation data: pass --data (the checkpoint's config names no data.eval)")
    beside = Path(data).expanduser().parent  # the demo layout keeps these files next to the eval split

    def pick(given: str, configured: str, name: str) -> str:
        return (given or (configured if own else "")
                or (str(beside / name) if (beside / name).exists() else ""))

    found = clip_benchmark.find(data) if kind in ("auto", "clip_benchmark") else None
    if found:
        log.info(f"eval: CLIP_benchmark set {found.root}, split {found.split}: {found.shards}")
        train = clip_benchmark.split(found, probe_split) if probe_split else None
        names = classes or (d["classes"] if own else "") or found.classes
        return Sources(found.shards, "shards", names, pick(paraphrases, d["paraphrases"], "paraphrases.jsonl"),
                       pick(sts, d["sts"], "sts.tsv"), train.shards if train else "",
                       clip_benchmark.label_vectors(found, names))
    if kind == "clip_benchmark":
        raise ValueError(f"--data {data}: no {clip_benchmark.NSHARDS} in it or in its {clip_benchmark.SPLIT}/ folder "
                         "(CLIP_benchmark's webdataset layout)")
    return Sources(data, eval_data.detect_kind(data) if kind == "auto" else kind,
                   pick(classes, d["classes"], "classes.json"),
                   pick(paraphrases, d["paraphrases"], "paraphrases.jsonl"), pick(sts, d["sts"], "sts.tsv"))


def load_local(sources: Sources, config: dict, workers: int = 0, limit: int = 0,
               batch_size: int = 64, decode: str = "cpu") -> eval_data.EvalData:
    """``load`` without Ray: the evaluation set streamed by a local loader's ``workers`` processes (0 = CPUs − 1),
    with its text sets; the samples its reading drops are counted in ``images.counts``."""
    cfg = from_dict(config)
    size = cfg.data.image_size
    if sources.kind == "shards":
        data = eval_data.local_shards(sources.data, size, str(assets.text_model_path(cfg.model.text)),
                                      cfg.data.max_text_tokens, workers, batch_size, decode, sources.label_vectors)
    elif sources.kind == "imagefolder":
        data = eval_data.local_imagefolder(sources.data, size, workers, batch_size)
    else:
        data = eval_data.local_fashion_mnist(sources.data, size, workers, batch_size, limit=limit)
    return data.with_text_sets(sources.classes, sources.paraphrases, sources.sts)


def load(sources: Sources, config: dict, read_cpus: float, limit: int = 0,
         batch_size: int = 64, decode: str = "cpu") -> tuple[eval_data.EvalData, str]:
    """(the evaluation set with its text sets — shards: a stream, read as it is embedded, their JPEGs decoded where
    ``decode`` says —, the name of the data report counting the samples its reading drops: shards only, else
    '')."""
    cfg = from_dict(config)
    size, report_name = cfg.data.image_size, ""
    try:
        if sources.kind == "shards":
            report_name = f"rayvl-eval-report-{uuid.uuid4().hex[:8]}"
            create_report(report_name)  # owned by this driver; counts the samples dropped while reading
            data = eval_data.load_shards(sources.data, size, str(assets.text_model_path(cfg.model.text)),
                                         cfg.data.max_text_tokens, read_cpus, report_name, cfg.data.read_threads,
                                         batch_size, decode, sources.label_vectors)
        elif sources.kind == "imagefolder":
            data = eval_data.load_imagefolder(sources.data, size, read_cpus)
        else:
            data = eval_data.load_fashion_mnist(sources.data, size, read_cpus, limit=limit)
        return data.with_text_sets(sources.classes, sources.paraphrases, sources.sts), report_name
    except BaseException:  # the caller never learns the report's name: it ends here
        release_reports([report_name] if report_name else [])
        raise


def pool_size(actors: int, gpus_per_actor: float, cpus_per_actor: float) -> int:
    """``actors``, or when 0: one CPU actor, or as many GPU actors as the cluster's GPUs hold now — and its CPUs,
    less one for Ray Data's reads (DESIGN: starvation) — at least one, for an autoscaler to add GPUs for."""
    if actors or not gpus_per_actor:
        return actors or 1
    have = ray.cluster_resources()
    by_cpus = (have.get("CPU", 0.0) - 1) / cpus_per_actor if cpus_per_actor else float("inf")
    return max(1, int(min(have.get("GPU", 0.0) / gpus_per_actor, by_cpus) + 1e-9))


def settings(config: dict, **given) -> EvalConfig:
    """The checkpoint's ``eval`` section (the config's defaults where its run set nothing), with each value given
    (not None) in its place: ``actors``, ``cpus_per_actor``, ``gpus_per_actor``, ``batch_size``,
    ``paraphrase_k``, ``loader_workers``, ``decode`` — and the batch size and the decoding by the actors' device
    where they are 0 and "auto" (``embed.batch_size``, ``EvalConfig.decode_on``)."""
    pool = replace(from_dict(config).eval, **{k: v for k, v in given.items() if v is not None})
    gpu = pool.gpus_per_actor > 0
    return replace(pool, batch_size=embed_batch(pool.batch_size, gpu), decode=pool.decode_on(gpu))


def run_eval(checkpoint: str, tasks: list[str] | None = None, sources: Sources | dict[str, Sources] | None = None,
             out: str | Path | None = None, actors: int | None = None, cpus_per_actor: float | None = None,
             batch_size: int | None = None, k: int | None = None, limit: int = 0,
             gpus_per_actor: float | None = None, without_ray: bool = False,
             loader_workers: int | None = None, decode: str | None = None,
             probe: ProbeSettings | None = None) -> dict:
    """Every task of ``tasks`` on a checkpoint; ``tasks`` and the actor pool's settings left None come from its
    config (``eval.checkpoint_tasks``, ``settings``). ``without_ray``: the model embeds in this process, fed by a
    local loader of ``loader_workers`` processes (``LocalEmbedder``, ``load_local``; ``session.runs_without_ray``
    says when), instead of the pool's actors fed by Ray Data. ``sources`` by name (CLIP_benchmark's way: many sets,
    one command): each set scored by the same warm model into ``<out>/<name>/``, the results by name, and
    ``<out>/summary.json`` the sets' headline metrics. ``probe``: the linear probe's settings where a set brings a
    train split (``Sources.probe_train``: CLIP_benchmark's protocol), CLIP_benchmark's defaults if None."""
    uri = checkpoint_uri(checkpoint)  # local or a URL; every embedding actor loads it on its own node
    meta = read_meta(uri)
    config = meta["config"]
    many = isinstance(sources, dict)
    named = sources if many else {"": sources or default_sources(config)}
    out = storage.normalize(out) if out else default_out(uri)
    pool = settings(config, actors=actors, cpus_per_actor=cpus_per_actor, gpus_per_actor=gpus_per_actor,
                    batch_size=batch_size, paraphrase_k=k, loader_workers=loader_workers, decode=decode)
    tasks = pool.checkpoint_tasks if tasks is None else tasks
    scored = {"checkpoint": uri, "step": meta["step"]}
    embedder = start_embedder(uri, pool, without_ray)
    results, reports = {}, []
    try:
        for name, one in named.items():
            where = storage.join(out, name) if name else out
            results[name] = scored_set(embedder, one, config, pool, tasks, limit, without_ray, where, scored,
                                       reports, probe or ProbeSettings())
    finally:
        try:
            embedder.close()
        finally:  # after the actors that may still record into them
            release_reports(reports)
    if not many:
        return results[""]
    storage.write_text(storage.join(out, "summary.json"), json.dumps(
        {**scored, "sets": {name: headline(r) for name, r in results.items()}}, indent=2))
    return results


def scored_set(embedder, sources: Sources, config: dict, pool: EvalConfig, tasks: list[str], limit: int,
               without_ray: bool, out: str, scored: dict, reports: list[str], probe: ProbeSettings) -> dict:
    """One evaluation set read, embedded by the warm ``embedder`` and scored; its results written under ``out``;
    the data report its reading counts into added to ``reports`` (the caller releases them). With the linear probe
    and a train split (``sources.probe_train``), that split is read and embedded too, and the probe trains on it."""
    log.info(f"eval: reading {sources.data} ({sources.kind}) for {', '.join(tasks)}")
    images, data, counts, speed = read_and_embed(embedder, sources, config, pool, limit, without_ray, reports)
    if pool.decode == "device" and sources.kind == "shards":
        log.info(f"eval: the images' JPEGs were decoded by {embedder.decoding()}")
    trained_on = {}
    if "linear_probe" in tasks and sources.probe_train and (data.labels >= 0).any():  # a set with classes
        data, trained_on = with_probe_train(embedder, data, sources, config, pool, without_ray, reports, probe, out)
    metrics, embeddings = evaluate(tasks, data, embedder, pool.paraphrase_k, images)
    results = {**({"data": counts} if counts else {}), "embedding": speed, **trained_on, **metrics}
    reasons = results.pop("skipped", {})
    skipped = [t for t in tasks if t not in metrics]
    if skipped:
        results["skipped"] = {t: reasons.get(t, SKIP_REASONS[t]) for t in skipped}
    write_results(out, scored, results, embeddings, data.keys)
    return results


def read_and_embed(embedder, sources: Sources, config: dict, pool: EvalConfig, limit: int, without_ray: bool,
                   reports: list[str]) -> tuple[np.ndarray, eval_data.EvalData, dict, dict]:
    """``sources`` read (by a local loader, or Ray Data with a data report added to ``reports``) and its images
    embedded: ``embedded``'s four."""
    report_name = ""
    if without_ray:
        data = load_local(sources, config, pool.loader_workers, limit, pool.batch_size, pool.decode)
    else:
        data, report_name = load(sources, config, pool.cpus_per_actor, limit, pool.batch_size, pool.decode)
        reports += [report_name] if report_name else []
    return embedded(embedder, data, sources, report_name)


def with_probe_train(embedder, data: eval_data.EvalData, sources: Sources, config: dict, pool: EvalConfig,
                     without_ray: bool, reports: list[str], probe: ProbeSettings,
                     out: str) -> tuple[eval_data.EvalData, dict]:
    """(the set with its train split's embeddings and classes for the linear probe, eval.json's ``probe_train``:
    what was read); the split's embeddings and class ids saved beside the set's (CLIP_benchmark caches its
    features: ``probe_train_embeddings.npy``, ``probe_train_labels.npy``)."""
    split = Sources(sources.probe_train, "shards")
    log.info(f"eval: reading the linear probe's {probe.train_split} split {split.data}")
    features, train, counts, speed = read_and_embed(embedder, split, config, pool, 0, without_ray, reports)
    write_array(out, "probe_train_embeddings", features)
    write_array(out, "probe_train_labels", train.labels)
    said = {"split": probe.train_split, "shards": split.data, "images": int(len(features)),
            "images_with_a_class": int((train.labels >= 0).sum()), "seconds": speed["seconds"],
            **{k: v for k, v in counts.items() if k.startswith("dropped_")}}
    return replace(data, probe=ProbeTrain(features, train.labels, probe)), {"probe_train": said}


def set_names(data: list[str]) -> list[str]:
    """A folder name for each of several evaluation sets: its last path component (``wds_imagenet1k``; of a Hugging
    Face Hub URL, of the path in its repository: ``…/clip-benchmark/wds_cars/tree/main`` → ``wds_cars``), characters
    a folder name should not hold replaced, a repeated name numbered."""
    names: list[str] = []
    for spec in data:
        last = http_objects.repository_path(spec).rstrip("/").rsplit("/", 1)[-1]
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", last).strip("_") or "set"
        names.append(base if base not in names else f"{base}-{sum(n.startswith(base) for n in names) + 1}")
    return names


# a set's headline numbers (summary.json, the printed summary): CLIP_benchmark's main metric of each task
HEADLINE = (("zero-shot top-1", "zeroshot", "zeroshot_top1"), ("zero-shot top-5", "zeroshot", "zeroshot_top5"),
            ("zero-shot mAP", "zeroshot", "zeroshot_mean_average_precision"),
            ("image→text R@5", "retrieval", "i2t_R@5"), ("text→image R@5", "retrieval", "t2i_R@5"),
            ("linear probe top-1", "linear_probe", "linear_probe_top1"), ("images", "embedding", "images"))


def headline(results: dict) -> dict:
    return {key: results[task][key] for _, task, key in HEADLINE if key in results.get(task, {})}


def start_embedder(uri: str, pool: EvalConfig, without_ray: bool) -> LocalEmbedder | ActorEmbedder:
    """The model in this process (its loader's workers start with the image pass, the model loads while they
    read), or the pool's actors (loading their model while the reading is planned and starts)."""
    if without_ray:
        embedder = LocalEmbedder(uri, pool.batch_size, torch.device("cuda" if pool.gpus_per_actor else "cpu"))
        log.info(f"eval: one model in this process on {embedder.device.type} ({pool.batch_size} images a forward), "
                 f"{local_read.loader_workers(pool.loader_workers)} loader worker(s) reading; no Ray")
        return embedder
    actors = pool_size(pool.actors, pool.gpus_per_actor, pool.cpus_per_actor)
    if pool.gpus_per_actor:
        log.info(f"eval: {actors} embedding actor(s) of {pool.gpus_per_actor:g} GPU(s) each")
    return ActorEmbedder(uri, actors, pool.cpus_per_actor, pool.batch_size, pool.gpus_per_actor)


def embedded(embedder, data: eval_data.EvalData, sources: Sources,
             report_name: str) -> tuple[np.ndarray, eval_data.EvalData, dict, dict]:
    """(the images' embeddings, the set with what its streamed rows said, the counts of the samples its reading
    dropped: shards only, else {}, the embedding's speed: eval.json's ``embedding``)."""
    started = time.time()
    images = embedder.images(data.images)
    ended, ready = time.time(), max(embedder.first_ready(), started)
    # the start-up (the model loaded and warmed up: EmbeddingActor) apart from the rate once running — counted from
    # the later of the model's readiness and this set's start (a later set of one command: its own start)
    speed = {"images": len(images), "seconds": round(ended - started, 3),
             "startup_s": round(ready - embedder.started, 3),
             "images_per_s_once_ready": round(len(images) / max(ended - ready, 1e-9), 1)}
    model = "embedding model in this process" if isinstance(embedder, LocalEmbedder) else "first embedding actor"
    log.info(f"eval: {len(images)} images embedded ({ended - started:.1f} s; the {model} ready "
             f"{speed['startup_s']:.1f} s after its start, {speed['images_per_s_once_ready']:.0f} images/s from then)")
    read_here = isinstance(data.images, local_read.Batches)  # a local loader counted its reading itself
    counts = data.images.counts if read_here else {}
    if not data.size:  # streamed: what the rows said came back with their embeddings
        data = data.with_rows(embedder.rows)
    if sources.kind == "shards":
        read = snapshot(report_name)["counts"] if report_name else dict(+counts)
        return images, data, with_dropped(read, embedder.dropped), speed
    if counts.get("dropped_corrupt_image"):  # as load_imagefolder says it, before the embedding, on Ray
        print(f"rayvl eval: dropped {counts['dropped_corrupt_image']} undecodable images under {sources.data}")
    return images, data, {}, speed


def with_dropped(counts: dict, dropped: dict) -> dict:
    """A shard read's ``counts`` with the change ``dropped`` of the rows its read tasks kept and the embedding
    model could not decode (device_decode: a JPEG whose header was whole), counted as the CPU path counts them."""
    total = Counter(counts)
    total.update(dropped)
    return dict(+total)


def write_results(out: str, scored: dict, results: dict, embeddings: dict, keys: list[str]) -> None:
    """``eval.json`` (``scored``: what it scored), each task's json, the embeddings as .npy, the key of each row."""
    for name, array in embeddings.items():
        write_array(out, f"{name}_embeddings", array)
    for task, values in results.items():
        if task not in ("data", "embedding", "skipped"):
            storage.write_text(storage.join(out, f"{task}.json"), json.dumps(values, indent=2))
    if keys:  # the sample of each row of the embeddings (shards: sorted by key)
        storage.write_text(storage.join(out, "keys.json"), json.dumps(keys))
    storage.write_text(storage.join(out, "eval.json"), json.dumps({**scored, **results}, indent=2))


def write_array(out: str, name: str, array: np.ndarray) -> None:
    """``<out>/<name>.npy``, local or on object storage."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    storage.write_bytes(storage.join(out, f"{name}.npy"), buffer.getvalue())


def default_out(checkpoint: str) -> str:
    """Where `rayvl eval` writes without --out: ``eval/`` beside the checkpoint (in its run directory); for a whole
    CLIP file or folder, ``eval-<its name>/`` beside it."""
    from rayvl.models import whole_clip

    if whole_clip.is_source(checkpoint):
        path = Path(checkpoint).expanduser().resolve()
        return str(path.parent / f"eval-{path.stem if path.is_file() else path.name}")
    return storage.join(storage.parent(checkpoint), "eval")


def after_training(result, data: str = "", tasks: tuple[str, ...] = ("retrieval",), prefix: str = "heldout_") -> dict:
    """A finished run's evaluation (a comparison's ``after``, rayvl.sweeps.comparison) on ``data`` — by default its
    own held-out data, with the files found as `rayvl eval` finds them: the numeric metrics of ``tasks``, each name
    prefixed; the files in ``<run>/eval-<prefix>``."""
    config = read_meta(checkpoint_uri(result.checkpoint_dir))["config"]
    out = run_eval(result.checkpoint_dir, list(tasks), default_sources(config, data),
                   out=storage.join(result.uri, "eval-" + (prefix.rstrip("_") or "after")))
    return {f"{prefix}{k}": v for task in tasks for k, v in out.get(task, {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
