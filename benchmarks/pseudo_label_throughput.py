"""`rayvl pseudo-label` against a plain torch loop that decodes, crops, embeds and takes the top-k the same way, end
to end, on towers so small that their compute is ~0: what is left is what a GPU leaves — reading, decoding, cropping,
moving, searching, start-up (issue 55's CPU goal: ≥ 0.8× the plain loop).

    .venv/bin/python benchmarks/pseudo_label_throughput.py [--images 2000] [--out result.json] [--work DIR]

Both sides run as processes of their own, timed from process start to exit, one after the other in this one run,
over the same checkpoint (eval_throughput.py's tiny one: timm's ``test_efficientnet`` at 32 px, a one-layer
32-wide text tower), the same caption pool (the demo's first half of training shards, as ``jobs/pseudo_label.py``
cuts it) and the same unaligned images (the demo's training split copied under new keys until there are
``--images``):

- rayvl: the CLI, ``rayvl pseudo-label RUN --aligned A --unaligned U --out O``, at its defaults (one labeller, 10
  crops an image, k = 5, an exact index at this size) and no cluster named — on this one machine it starts no Ray
  (rayvl.session.runs_without_ray: the labeller in its process, cutting crops on every CPU; the aligned set read by
  local loaders); it also ranks words and writes the pseudo-captioned shards;
- plain: this script's ``--plain`` mode, what a user writes without rayvl — the pool's captions read from the tars
  and embedded in the main process, the same faiss index (``rayvl.eval.knn.build_index``), then a ``torch``
  DataLoader over the unaligned shards (loader workers = CPUs − 1, shards split over them) running rayvl's own
  per-image code in the workers (``pseudo_label.crops``: the same seeded random resized crops, decoded at a reduced
  JPEG scale and downscaled once, cut by Pillow), the main process embedding each batch's crops and searching the
  index, each image's k·c retrievals merged as rayvl merges them.

Lines are timed on arrival, so the phases come from the outside, the same way for both: start-up (start → the
caption pool's reading begins), the caption pool (→ its index is built), the labelling (→ every image labelled) and
the rest. The two sides' retrievals are compared image by image (pool keys and scores): they must agree.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_throughput as et  # noqa: E402  (the tiny checkpoint, the process timing)

GOAL = 0.8
SCORE_TOLERANCE = 2e-4  # rayvl writes scores rounded to 4 decimals
AGREE_SHARE = 0.99  # images whose retrievals agree (a tie between equal pool captions may swap two keys)

POOL = re.compile(r"caption pool: embedding (\d+) captions")
PLAIN_POOL = re.compile(r"plain: caption pool ")
INDEXED = re.compile(r"caption index: ")
PLAIN_INDEXED = re.compile(r"plain: caption index ")
LABELLED = re.compile(r"pseudo-label: shard (\d+)/(\d+) \| (\d+) images")
PLAIN_LABELLED = re.compile(r"plain: (\d+) images labelled")


# ----------------------------------------------------------------------------- the plain side

def pool_captions(aligned: str) -> tuple[list[str], list[str]]:
    """(keys, captions) of the pool's valid captions, sorted by key, read from the tars (as rayvl's read_pool)."""
    from rayvl.data.specs import resolve_shards
    from rayvl.data.tar import iter_tar_samples
    from rayvl.data.text import validate_caption

    pairs = []
    for shard in resolve_shards(aligned):
        with open(shard, "rb") as f:
            for s in iter_tar_samples(f, ("key", "txt")):
                text, reason = validate_caption(s.get("txt"))
                if not reason:
                    pairs.append((str(s["key"]), text))
    pairs.sort()
    return [k for k, _ in pairs], [c for _, c in pairs]


class Crops:
    """An IterableDataset over the unaligned shards: each loader worker reads its share, decodes every image and
    cuts its crops with rayvl's own code."""

    def __new__(cls, paths: list[str], settings, size: int):
        import torch

        class _Crops(torch.utils.data.IterableDataset):
            def __iter__(self):
                from rayvl.methods.bow import pseudo_label

                info = torch.utils.data.get_worker_info()
                mine = paths[info.id::info.num_workers] if info else paths
                for path in mine:
                    unit = pseudo_label.Unit(0, "tar", [path])
                    for key, data, *_ in pseudo_label.unit_samples(unit)[0]:
                        cut = pseudo_label.crops(data, key, settings, size) if data is not None else None
                        if cut is not None:
                            yield str(key), torch.from_numpy(cut)

        return _Crops()


def plain_label(checkpoint: str, aligned: str, unaligned: str, results: str, workers: int) -> int:
    import numpy as np
    import torch

    from rayvl import assets
    from rayvl.checkpoints import load_model
    from rayvl.methods.bow.config import PseudoLabelConfig
    from rayvl.data.specs import resolve_shards
    from rayvl.data.text import tokenize
    from rayvl.eval import knn

    x = PseudoLabelConfig()
    model, config = load_model(checkpoint)
    size = config["data"]["image_size"]
    et.say(f"plain: caption pool {aligned}")
    keys, captions = pool_captions(aligned)
    ids, mask = tokenize(captions, str(assets.text_model_path(config["model"]["text"])),
                         config["data"]["max_text_tokens"])
    with torch.inference_mode():
        pool = torch.cat([model.encode_text(torch.from_numpy(ids[i:i + 1024]), torch.from_numpy(mask[i:i + 1024]))
                          for i in range(0, len(ids), 1024)]).numpy()
    index = knn.build_index(pool, x.index, exact_max=x.index_exact_max, nlist=x.index_nlist, nprobe=x.index_nprobe,
                            seed=x.seed)
    et.say(f"plain: caption index {type(index).__name__} over {len(captions)} captions")
    per = max(1, x.batch_size // x.crops)  # images a forward, as rayvl's labelling actor takes them
    loader = torch.utils.data.DataLoader(Crops(resolve_shards(unaligned), x, size), batch_size=per,
                                         num_workers=workers, persistent_workers=False)
    found = {}
    with torch.inference_mode():
        for names, crops in loader:
            embedded = model.encode_image(crops.flatten(0, 1)).numpy()
            scores, hits = knn.search(index, embedded, x.k)
            for b, key in enumerate(names):
                s, i = scores[b * x.crops:(b + 1) * x.crops].ravel(), hits[b * x.crops:(b + 1) * x.crops].ravel()
                order = np.argsort(-s, kind="stable")
                keep = order[i[order] >= 0]
                found[key] = {"neighbours": [keys[j] for j in i[keep]],
                              "scores": [round(float(v), 4) for v in s[keep]]}
    et.say(f"plain: {len(found)} images labelled")
    Path(results).mkdir(parents=True, exist_ok=True)
    (Path(results) / "neighbours.json").write_text(json.dumps(found))
    return len(found)


# ----------------------------------------------------------------------------- comparing and reporting

def rayvl_neighbours(out: Path) -> dict:
    """{image key: its retrievals} from rayvl's output parquets (the first rule's: every rule holds the same)."""
    import pyarrow.parquet as pq

    rule = sorted(p for p in out.iterdir() if p.is_dir() and p.name != "index")[0]
    found = {}
    for parquet in sorted(rule.glob("*.parquet")):
        for row in pq.read_table(parquet, columns=["source", "status", "neighbours", "scores"]).to_pylist():
            if row["status"] != "failed_to_decode":
                found[row["source"]] = {"neighbours": row["neighbours"], "scores": row["scores"]}
    return found


def agreement(rayvl: dict, plain: dict) -> dict:
    same = 0
    for key, mine in rayvl.items():
        theirs = plain.get(key)
        if theirs is None or len(theirs["scores"]) != len(mine["scores"]):
            continue
        close = all(abs(a - b) <= SCORE_TOLERANCE for a, b in zip(mine["scores"], theirs["scores"]))
        same += close and Counter(mine["neighbours"]) == Counter(theirs["neighbours"])
    share = same / max(1, len(rayvl))
    return {"images": len(rayvl), "plain_images": len(plain), "same_keys": set(rayvl) == set(plain),
            "agreeing_share": share, "agree": set(rayvl) == set(plain) and share >= AGREE_SHARE}


def phases(run: dict, images: int, pool, indexed, labelled) -> dict:
    out = et.phases(run, images, pool, [labelled])
    began, built = et.first(run["lines"], pool), et.first(run["lines"], indexed)
    ends = [t for t, line in run["lines"] if labelled.search(line)]
    if began and built:
        out["pool_s"] = built[0] - began[0]
    if built and ends:
        out["labelling_s"] = max(ends) - built[0]
        out["labelling_images_per_s"] = images / max(out["labelling_s"], 1e-9)
        out["pipeline_s"] = max(ends) - began[0]
        out["rest_s"] = run["wall_s"] - max(ends)
    return out


def table(images: int, r: dict, p: dict, agreed: dict) -> str:
    num, ratio = et.num, et.ratio
    rows = [
        ("end to end, process start → exit: s", num(r["wall_s"]), num(p["wall_s"]), ""),
        ("end to end: **images/s**", num(r["images_per_s"]), num(p["images_per_s"]),
         f"**{ratio(r['images_per_s'], p['images_per_s'])}** (goal ≥ {GOAL}×)"),
        ("start-up, start → the caption pool's reading: s", num(r["startup_s"]), num(p["startup_s"]), ""),
        ("caption pool read, embedded, indexed: s", num(r.get("pool_s")), num(p.get("pool_s")), ""),
        ("labelling, index built → every image labelled: s", num(r.get("labelling_s")), num(p.get("labelling_s")),
         ""),
        ("labelling: images/s", num(r.get("labelling_images_per_s")), num(p.get("labelling_images_per_s")),
         ratio(r.get("labelling_images_per_s"), p.get("labelling_images_per_s"))),
        ("the rest (rayvl: summary; both: exit): s", num(r["rest_s"]), num(p["rest_s"]), ""),
    ]
    out = [f"pseudo-label of {images} unaligned images (10 crops each, top-5), towers of ~0 compute", "",
           "| | rayvl pseudo-label | plain loop | rayvl ÷ plain |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    out += ["", f"agree: {'yes' if agreed['agree'] else 'NO'} (the same images: {agreed['same_keys']}; "
                f"{100 * agreed['agreeing_share']:.1f}% of images with the same pool keys and scores within "
                f"{SCORE_TOLERANCE:g}; needed {100 * AGREE_SHARE:.0f}%)"]
    return "\n".join(out)


def benchmark(images: int, work: Path, workers: int) -> dict:
    from rayvl.checks import gpu as check

    et.say(f"writing the tiny checkpoint and {images} unaligned images under {work}")
    checkpoint = et.tiny_checkpoint(work)
    aligned = check.demo_halves()[0]
    unaligned = check.copied_shards(check.demo_shards("train"), images, work / "unaligned")
    rayvl_run = et.run_side("rayvl pseudo-label", [*et.rayvl_cli(), "pseudo-label", str(checkpoint),
                                                   "--aligned", aligned, "--unaligned", unaligned,
                                                   "--out", str(work / "rayvl-labels")])
    plain_run = et.run_side("the plain loop", [sys.executable, str(Path(__file__).resolve()), "--plain",
                                               str(checkpoint), "--aligned", aligned, "--unaligned", unaligned,
                                               "--results", str(work / "plain-labels"), "--workers", str(workers)])
    rayvl = phases(rayvl_run, images, POOL, INDEXED, LABELLED)
    plain = phases(plain_run, images, PLAIN_POOL, PLAIN_INDEXED, PLAIN_LABELLED)
    agreed = agreement(rayvl_neighbours(work / "rayvl-labels"),
                       json.loads((work / "plain-labels" / "neighbours.json").read_text()))
    return {"images": images, "workers": workers, "rayvl": rayvl, "plain": plain,
            "ratio_end_to_end": rayvl["images_per_s"] / plain["images_per_s"], "agreement": agreed,
            "rayvl_lines": et.lines(rayvl_run), "plain_lines": et.lines(plain_run)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    et.add_common_args(p, 2000, "unaligned")
    p.add_argument("--aligned", default="", help="with --plain: the caption pool's shards")
    p.add_argument("--unaligned", default="", help="with --plain: the images to label")
    p.add_argument("--results", default="", help="with --plain: where to write its retrievals")
    args = p.parse_args(argv)
    if args.plain:
        start = time.perf_counter()
        n = plain_label(args.plain, args.aligned, args.unaligned, args.results, args.workers)
        print(json.dumps({"images": n, "seconds": round(time.perf_counter() - start, 1)}))
        return 0
    return et.measure(args, "pseudo-label-throughput-", benchmark, table)


if __name__ == "__main__":
    sys.exit(main())
