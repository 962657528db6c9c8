"""Retrieval within same-object galleries: the contextual alignment [TOnICS] claims (§5: aligned nouns carry
their visual context). A caption query that names object o ranks only the images that also hold o, so R@1 there
needs the rest of the caption — colour, size, place, the other objects — not just the object's name."""
from __future__ import annotations

import io
import json

import numpy as np

from rayvl import storage


def same_object_recall(image_emb: np.ndarray, text_emb: np.ndarray, objects: list[set[int]]) -> dict:
    """Sample i is image i with caption i and the object classes ``objects[i]``. For each object, every sample
    holding it is a text→image query over the images holding it (and an image→text query over those captions);
    objects held by one sample only are skipped. R@1 (%) over all (sample, object) queries, with its chance level
    (the mean of 1 / gallery size) and the query count."""
    sims = np.asarray(text_emb, np.float64) @ np.asarray(image_emb, np.float64).T  # [captions, images]
    members: dict[int, list[int]] = {}
    for i, objs in enumerate(objects):
        for o in objs:
            members.setdefault(o, []).append(i)
    t2i = i2t = queries = 0
    chance = 0.0
    for group in members.values():
        if len(group) < 2:
            continue
        sub = sims[np.ix_(group, group)]
        own = np.arange(len(group))
        t2i += int((sub.argmax(1) == own).sum())
        i2t += int((sub.argmax(0) == own).sum())
        queries += len(group)
        chance += len(group) * (1.0 / len(group))
    if not queries:
        return {}
    return {"t2i_same_object_R@1": 100.0 * t2i / queries, "i2t_same_object_R@1": 100.0 * i2t / queries,
            "same_object_chance_R@1": 100.0 * chance / queries, "same_object_queries": queries}


def tonics_heldout(result, data: str = "") -> dict:
    """A finished TOnICS-recipe run (a comparison's ``after``): held-out retrieval as `rayvl eval` computes it
    (rayvl.eval.runner.after_training), then R@1 within same-object galleries, the objects of each held-out sample
    found by the run's own ontology (tonics.classes, its caption nouns and detector tags)."""
    from rayvl.checkpoints import checkpoint_uri, read_meta
    from rayvl.methods.tonics.ontology import UNALIGNED, Ontology
    from rayvl.data import clip_benchmark
    from rayvl.data.shard_io import open_shard
    from rayvl.data.specs import resolve_shards
    from rayvl.data.tar import DAMAGED, iter_tar_samples
    from rayvl.data.text import validate_caption_lines
    from rayvl.eval.runner import after_training

    out = after_training(result, data, ("retrieval",), "heldout_")
    where = storage.join(result.uri, "eval-heldout")
    keys = json.loads(storage.read_text(storage.join(where, "keys.json")))
    config = read_meta(checkpoint_uri(result.checkpoint_dir))["config"]
    x = config["tonics"]
    ontology = Ontology.build(x["classes"], x["overrides"], x["tags_field"])
    found: dict[str, set[int]] = {}
    spec = data or config["data"]["eval"]
    benchmark = clip_benchmark.find(spec)  # a CLIP_benchmark set's root: its split's shards
    spec = benchmark.shards if benchmark else spec
    lines: dict[str, int] = {}  # each sample's captions: `rayvl eval` embeds each line of a held-out caption
    for path in resolve_shards(spec):
        with open_shard(path) as f:
            try:
                for sample in iter_tar_samples(f, ("key", "txt", "json")):
                    text, reason = validate_caption_lines(sample.get("txt"))
                    if not reason:
                        found[sample["key"]] = set(ontology.row_objects(" ".join(text.split("\n")),
                                                                        sample.get("json"))) - {UNALIGNED}
                        lines[sample["key"]] = text.count("\n") + 1
            except DAMAGED:
                pass  # a damaged shard's tail: its samples were not evaluated either (counted in the eval's report)
    images, captions = (np.load(io.BytesIO(storage.read_bytes(storage.join(where, f"{name}_embeddings.npy"))))
                        for name in ("image", "caption"))
    per_row = [lines.get(k, 1) for k in keys]
    if len(captions) == sum(per_row) != len(keys):  # each row's first caption
        captions = captions[np.cumsum([0, *per_row[:-1]])]
    metrics = same_object_recall(images, captions, [found.get(k, set()) for k in keys])
    return {**out, **{f"heldout_{k}": v for k, v in metrics.items()}}
