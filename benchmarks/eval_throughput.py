"""`rayvl eval` against a plain torch loop over the same held-out shards and checkpoint, end to end, on towers so
small that their compute is ~0: what is left is what a GPU leaves — reading, decoding, moving, start-up (issue 55's
CPU goal: ≥ 0.8× the plain loop).

    .venv/bin/python benchmarks/eval_throughput.py [--images 4000] [--out result.json] [--work DIR]

Both sides run as processes of their own, timed from process start to exit, one after the other in this one run:

- rayvl: the CLI, ``rayvl eval CHECKPOINT --tasks retrieval --data SHARDS --kind shards``, with the checkpoint's
  ``eval`` settings (the defaults: one model on CPU, batches of 128) and no cluster named — on this one machine it
  starts no Ray (rayvl.session.runs_without_ray: the model in its process, a local DataLoader of CPUs − 1
  workers reading);
- plain: this script's ``--plain`` mode, what a user writes without rayvl — a ``torch`` DataLoader over an
  IterableDataset of the tar shards (loader workers = CPUs − 1, shards split over them), rayvl's own
  per-sample code in the workers (``rayvl.data.pipeline.preprocess``: caption checks, decode, centre crop,
  tokenize), the model loaded in the main process by ``rayvl.checkpoints.load_model`` embedding each batch's
  images and captions, then the same retrieval metric (``rayvl.eval.retrieval``) over the rows in key order, and
  the same files ``rayvl eval`` writes. (rayvl embeds each distinct caption once, the plain loop every row's: at ~0
  compute a difference of nothing.)

The checkpoint is an untrained model (built and saved as the tests' ``untrained_checkpoint`` does, no training) of
the laion_adapt recipe at the smallest sizes its config allows: timm's ``test_efficientnet`` image tower at 32 px, a
one-layer 32-wide BERT text tower (the MiniLM tokenizer's, written here as an HF model folder), one alignment layer,
32-d embeddings. The held-out images are the embedded demo's held-out split copied under new keys until there are
``--images`` of them (``rayvl check gpu``'s ``copied_shards``, as its eval case does).

Each line either side writes is timed on arrival, so the phases come from the outside, the same way for both:
start-up (process start → reading begins: imports, Ray's start, the plain side's model load), the pipeline (reading
begins → every image and caption embedded) and the rest (metrics, files, exit); rayvl's own log splits its
pipeline into the planning of the read, the image pass (reading, decoding and embedding streamed together, the
model loading beside the first reads) and the text pass of the same model. The two
sides' retrieval metrics and embeddings are compared: they must agree (same model, same rows, same order; the
tolerances are ``METRIC_TOLERANCE`` and ``EMBEDDING_TOLERANCE``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GOAL = 0.8  # rayvl eval ÷ the plain loop, end to end (issue 55)
VISION, IMAGE_SIZE, TOKENS, EMBED_DIM = "test_efficientnet", 32, 16, 32
TEXT_WIDTH = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
# the two sides run the same fp32 forward on the same rows, in batches cut differently: a row may differ by float32
# rounding at most (tests/test_eval_embed.py holds rayvl's actor pools to one process at 1e-5 too)
EMBEDDING_TOLERANCE = 1e-5
# where rows differ by rounding, a query whose candidates tie may rank them either way; the copied held-out set is
# made of ties (at 4,000 images each image and caption is there 8 times), so a recall may move by a few queries
METRIC_TOLERANCE = 0.5  # percentage points (20 queries at 4,000 images)

READING = re.compile(r"eval: reading ")
IMAGES = re.compile(r"eval: (\d+) images embedded \(([\d.]+) s[;)]")
RUNNING = re.compile(r"(?:first embedding actor|embedding model in this process) ready ([\d.]+) s after its start, "
                     r"(\d+) images/s from then")
TEXTS = re.compile(r"eval: (\d+) texts embedded \(([\d.]+) s\)")
PLAIN_READING = re.compile(r"plain: reading ")
PLAIN_EMBEDDED = re.compile(r"plain: (\d+) images and captions embedded \(([\d.]+) s\)")


# ----------------------------------------------------------------------------- the checkpoint and the data

def tiny_text_tower(out: Path) -> Path:
    """An HF model folder: MiniLM's tokenizer with a one-layer BERT of width 32, random weights (``model.text``
    takes any local HF model folder)."""
    import torch

    from rayvl import assets
    from rayvl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()  # transformers' BertModel imports torchvision (rayvl/compat.py)
    from transformers import AutoConfig, AutoModel

    source = assets.text_model_path("minilm-l6")
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    config.update(TEXT_WIDTH)
    torch.manual_seed(0)
    AutoModel.from_config(config, add_pooling_layer=False).save_pretrained(out)
    return out


def tiny_config(text_dir: Path, image_size: int = IMAGE_SIZE):
    from rayvl.config import load_config

    return load_config(REPO / "configs" / "laion_adapt.yaml", [
        f"model.vision={VISION}", f"model.text={text_dir}", "model.alignment_layers=1",
        f"model.embed_dim={EMBED_DIM}", f"data.image_size={image_size}", f"data.max_text_tokens={TOKENS}"])


def tiny_checkpoint(out: Path, seed: int = 0, image_size: int = IMAGE_SIZE) -> Path:
    """``out/run/checkpoint_000000``: an untrained tiny model's consolidated weights and config, the layout a final
    checkpoint has (tests/conftest.py's ``untrained_checkpoint``)."""
    import torch

    from rayvl.checkpoints import META_FILE, MODEL_FILE
    from rayvl.models.dual_encoder import build_model

    cfg = tiny_config(tiny_text_tower(out / "text"), image_size)
    ckpt = out / "run" / "checkpoint_000000"
    ckpt.mkdir(parents=True)
    torch.save(build_model(cfg.model, seed=seed).state_dict(), ckpt / MODEL_FILE)
    (ckpt / META_FILE).write_text(json.dumps({"step": 0, "config": cfg.to_dict(), "final": True}))
    return ckpt


def held_out(images: int, out: Path) -> str:
    """``images`` held-out samples as shards under ``out``: the demo's held-out split, copied under new keys."""
    from rayvl.checks import gpu as check  # its import loads nothing but the standard library

    return check.copied_shards(check.demo_shards("eval"), images, out)


# ----------------------------------------------------------------------------- the plain side

def plain_loader(paths: list[str], rows, batch_size: int, workers: int):
    """A DataLoader of model-input batches of the shards, each loader worker reading its share of the shards."""
    import torch

    from rayvl.data.pipeline import preprocess
    from rayvl.data.tar import COLUMNS, iter_tar_samples

    class Shards(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            mine = paths[info.id::info.num_workers] if info else paths
            samples: list[dict] = []
            for path in mine:
                with open(path, "rb") as f:
                    for sample in iter_tar_samples(f):
                        samples.append(sample)
                        if len(samples) == batch_size:
                            yield self.batch(samples)
                            samples = []
            if samples:
                yield self.batch(samples)

        def batch(self, samples: list[dict]) -> dict:
            return preprocess({c: [s.get(c) for s in samples] for c in COLUMNS}, Counter(), rows)

    return torch.utils.data.DataLoader(Shards(), batch_size=None, num_workers=workers)


def plain_eval(checkpoint: str, data: str, results: str, workers: int) -> dict:
    """The plain loop, start to end, in this process: its retrieval metrics; the files it writes under ``results``
    are those ``rayvl eval --tasks retrieval`` writes (retrieval.json, the embeddings, keys.json)."""
    import numpy as np
    import torch

    from rayvl import assets
    from rayvl.checkpoints import load_model
    from rayvl.data.pipeline import Rows
    from rayvl.data.specs import resolve_shards
    from rayvl.eval.embed import batch_size
    from rayvl.eval.retrieval import retrieval_metrics

    model, config = load_model(checkpoint)
    rows = Rows(config["data"]["image_size"], 1.0, False, str(assets.text_model_path(config["model"]["text"])),
                config["data"]["max_text_tokens"])
    loader = plain_loader(resolve_shards(data), rows, batch_size(config["eval"]["batch_size"], gpu=False), workers)
    say(f"plain: reading {data} with {workers} loader worker(s)")
    start = time.perf_counter()
    images, captions, keys = [], [], []
    with torch.inference_mode():
        for batch in loader:
            images.append(model.encode_image(batch["image"]))
            captions.append(model.encode_text(batch["input_ids"], batch["attention_mask"]))
            keys += [str(k) for k in batch["key"]]
    order = np.argsort(np.array(keys, dtype=str), kind="stable")  # rayvl eval's row order: by sample key
    image_emb, caption_emb = (torch.cat(e).float().numpy()[order] for e in (images, captions))
    say(f"plain: {len(keys)} images and captions embedded ({time.perf_counter() - start:.1f} s)")
    metrics = retrieval_metrics(image_emb, caption_emb, np.arange(len(keys)))
    out = Path(results)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "image_embeddings.npy", image_emb)
    np.save(out / "caption_embeddings.npy", caption_emb)
    (out / "keys.json").write_text(json.dumps([keys[i] for i in order]))
    (out / "retrieval.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus - 1)


# ----------------------------------------------------------------------------- timing the two processes

def timed(command: list[str], env: dict | None = None) -> dict:
    """Run ``command``; its exit status, wall seconds from start to exit, and every line it wrote with the seconds
    since start at which it arrived (stdout and stderr, each read as it comes)."""
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read(pipe) -> None:
        for line in pipe:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in (proc.stdout, proc.stderr)]
    for r in readers:
        r.start()
    code = proc.wait()
    wall = time.perf_counter() - start
    for r in readers:
        r.join()
    return {"returncode": code, "wall_s": wall, "lines": sorted(lines)}


def first(lines: list[tuple[float, str]], pattern: re.Pattern) -> tuple[float, re.Match] | None:
    return next(((t, m) for t, line in lines if (m := pattern.search(line))), None)


def phases(run: dict, images: int, reading: re.Pattern, embedded: list[re.Pattern]) -> dict:
    """Seconds of start-up (start → the ``reading`` line), pipeline (→ the last of ``embedded``'s lines) and the
    rest (→ exit), and images/s end to end and over the pipeline; a phase whose lines are missing is None."""
    out = {"wall_s": run["wall_s"], "images_per_s": images / run["wall_s"], "startup_s": None, "pipeline_s": None,
           "pipeline_images_per_s": None, "rest_s": None}
    began, ends = first(run["lines"], reading), [first(run["lines"], p) for p in embedded]
    if began:
        out["startup_s"] = began[0]
    if began and all(ends):
        end = max(t for t, _ in ends)
        out["pipeline_s"] = end - began[0]
        out["pipeline_images_per_s"] = images / max(end - began[0], 1e-9)
        out["rest_s"] = run["wall_s"] - end
    return out


def rayvl_phases(run: dict, images: int) -> dict:
    """``phases`` of `rayvl eval`, its pipeline split by its own log: the read planned before the image pass, the
    image pass (read, decode and embed, streamed), the text pass (the same actors)."""
    out = phases(run, images, READING, [IMAGES, TEXTS])
    began, image_pass, text_pass = (first(run["lines"], p) for p in (READING, IMAGES, TEXTS))
    if began and image_pass:
        out["images_s"] = float(image_pass[1].group(2))
        out["read_s"] = image_pass[0] - out["images_s"] - began[0]
    if text_pass:
        out["texts_s"] = float(text_pass[1].group(2))
    running = first(run["lines"], RUNNING)
    if running:
        out["actor_startup_s"], out["running_images_per_s"] = float(running[1].group(1)), int(running[1].group(2))
    return out


def agreement(rayvl_dir: Path, plain_dir: Path, metric_tolerance: float = METRIC_TOLERANCE) -> dict:
    """How far apart the two sides' retrieval metrics and embeddings are (rows matched by key), and whether that is
    within the tolerances."""
    import numpy as np

    metrics = [json.loads((d / "retrieval.json").read_text()) for d in (rayvl_dir, plain_dir)]
    keys = [json.loads((d / "keys.json").read_text()) for d in (rayvl_dir, plain_dir)]
    out = {"same_keys": keys[0] == keys[1],
           "metric_max_diff": max(abs(metrics[0][k] - metrics[1][k]) for k in metrics[0]),
           "metric_tolerance": metric_tolerance, "rayvl": metrics[0], "plain": metrics[1]}
    if out["same_keys"]:
        out["embedding_max_diff"] = max(
            float(np.abs(np.load(rayvl_dir / f) - np.load(plain_dir / f)).max())
            for f in ("image_embeddings.npy", "caption_embeddings.npy"))
    out["agree"] = (out["same_keys"] and out["embedding_max_diff"] <= EMBEDDING_TOLERANCE
                    and out["metric_max_diff"] <= metric_tolerance)
    return out


# ----------------------------------------------------------------------------- the report

def ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


def num(x, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def table(images: int, rayvl: dict, plain: dict, agreed: dict) -> str:
    r, p = rayvl, plain
    rows = [
        ("end to end, process start → exit: s", num(r["wall_s"]), num(p["wall_s"]), ""),
        ("end to end: **images/s**", num(r["images_per_s"]), num(p["images_per_s"]),
         f"**{ratio(r['images_per_s'], p['images_per_s'])}** (goal ≥ {GOAL}×)"),
        ("start-up, start → reading begins: s", num(r["startup_s"]), num(p["startup_s"]), ""),
        ("pipeline, reading → every image and caption embedded: s", num(r["pipeline_s"]), num(p["pipeline_s"]),
         ""),
        ("pipeline: images/s", num(r["pipeline_images_per_s"]), num(p["pipeline_images_per_s"]),
         ratio(r["pipeline_images_per_s"], p["pipeline_images_per_s"])),
        ("… rayvl: read planned, before the image pass: s", num(r.get("read_s")), "", ""),
        ("… rayvl: image pass, read + decode + embed streamed (its log): s", num(r.get("images_s")), "", ""),
        ("… rayvl: its embedding model ready (in its process, or the first actor), after its start: s",
         num(r.get("actor_startup_s")), "", ""),
        ("… rayvl: images/s from then (its log)", num(r.get("running_images_per_s"), "{:.0f}"), "", ""),
        ("… rayvl: text pass, the same actors (its log): s", num(r.get("texts_s")), "", ""),
        ("metrics, files, exit: s", num(r["rest_s"]), num(p["rest_s"]), ""),
    ]
    out = [f"eval of {images} held-out images (retrieval), towers of ~0 compute", "",
           "| | rayvl eval | plain loop | rayvl ÷ plain |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    names = [k for k in agreed["rayvl"] if k.startswith(("t2i_R", "i2t_R"))]
    out += ["", "| retrieval | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {side} | " + " | ".join(f"{agreed[key][k]:.2f}" for k in names) + " |"
            for side, key in (("rayvl eval", "rayvl"), ("plain loop", "plain"))]
    out += ["", f"agree: {'yes' if agreed['agree'] else 'NO'} (the same rows in the same order: {agreed['same_keys']}; "
                f"largest metric difference {agreed['metric_max_diff']:.3f} points, tolerance "
                f"{agreed['metric_tolerance']:g}; largest embedding difference "
                f"{num(agreed.get('embedding_max_diff'), '{:.1e}')}, tolerance {EMBEDDING_TOLERANCE:.0e})"]
    return "\n".join(out)


def rayvl_args(checkpoint: Path, data: str, out: Path) -> list[str]:
    """`rayvl eval`'s arguments: retrieval over the shards, the checkpoint's own eval settings."""
    return ["eval", str(checkpoint), "--tasks", "retrieval", "--data", data, "--kind", "shards", "--out", str(out)]


def rayvl_cli() -> list[str]:
    """The venv's ``rayvl`` entry point, as a user runs it (else the module)."""
    cli = Path(sys.executable).parent / "rayvl"
    return [str(cli)] if cli.exists() else [sys.executable, "-m", "rayvl.cli"]


def rayvl_command(checkpoint: Path, data: str, out: Path) -> list[str]:
    return [*rayvl_cli(), *rayvl_args(checkpoint, data, out)]


def plain_command(checkpoint: Path, data: str, out: Path, workers: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--plain", str(checkpoint), "--data", data,
            "--results", str(out), "--workers", str(workers)]


def child_env() -> dict:
    # a Ray of its own for `rayvl eval` (not one this shell may name), every line as written
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def failed(name: str, run: dict) -> str:
    tail = "\n".join(line for _, line in run["lines"][-15:])
    return f"{name} exited with status {run['returncode']}:\n{tail}"


def run_side(name: str, command: list[str]) -> dict:
    """``timed(command)`` in the children's environment; the benchmark stops where that side failed."""
    say(f"{name} ...")
    run = timed(command, child_env())
    if run["returncode"]:
        raise SystemExit(failed(name, run))
    return run


def lines(run: dict) -> list:
    """A run's lines with their arrival in seconds, for the JSON record."""
    return [[round(t, 2), line] for t, line in run["lines"]]


def benchmark(images: int, work: Path, workers: int) -> dict:
    say(f"writing the tiny checkpoint and {images} held-out images under {work}")
    checkpoint = tiny_checkpoint(work)
    data = held_out(images, work / "held-out")
    rayvl_run = run_side("rayvl eval", rayvl_command(checkpoint, data, work / "rayvl-eval"))
    plain_run = run_side("the plain loop", plain_command(checkpoint, data, work / "plain-eval", workers))
    rayvl = rayvl_phases(rayvl_run, images)
    plain = phases(plain_run, images, PLAIN_READING, [PLAIN_EMBEDDED])
    agreed = agreement(work / "rayvl-eval", work / "plain-eval")
    return {"images": images, "workers": workers, "rayvl": rayvl, "plain": plain,
            "ratio_end_to_end": rayvl["images_per_s"] / plain["images_per_s"],
            "ratio_pipeline": (rayvl["pipeline_images_per_s"] / plain["pipeline_images_per_s"]
                               if rayvl["pipeline_images_per_s"] and plain["pipeline_images_per_s"] else None),
            "agreement": agreed, "rayvl_lines": lines(rayvl_run), "plain_lines": lines(plain_run)}


def add_common_args(p: argparse.ArgumentParser, images: int, what: str) -> None:
    """The options both benchmarks share: how many ``what`` images, where to keep things, the plain side."""
    p.add_argument("--images", type=int, default=images, help=f"{what} images (default {images})")
    p.add_argument("--out", default="", help="also write the measurements as JSON here")
    p.add_argument("--work", default="", help="a new folder to keep the checkpoint, shards and outputs in "
                                              "(default: a temporary folder, removed)")
    p.add_argument("--workers", type=int, default=default_workers(), help="the plain loop's loader workers "
                                                                          "(default: CPUs − 1)")
    p.add_argument("--plain", default="", metavar="CHECKPOINT", help="run the plain loop alone on this checkpoint "
                                                                     "(the benchmark runs it so)")


def measure(args: argparse.Namespace, prefix: str, run, report) -> int:
    """``run(images, work, workers)`` in ``--work`` (or a temporary folder), its ``report`` printed and its
    record written to ``--out``; 0 where the two sides agreed."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(args.work or tmp)
        if args.work and work.exists() and any(work.iterdir()):
            raise SystemExit(f"--work {work}: not empty (give a new folder)")
        result = run(args.images, work, args.workers)
    print(report(args.images, result["rayvl"], result["plain"], result["agreement"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if result["agreement"]["agree"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, 4000, "held-out")
    p.add_argument("--data", default="", help="with --plain: the shards")
    p.add_argument("--results", default="", help="with --plain: where to write its eval files")
    args = p.parse_args(argv)
    if args.plain:
        metrics = plain_eval(args.plain, args.data, args.results, args.workers)
        print(json.dumps({"retrieval": metrics}))
        return 0
    return measure(args, "eval-throughput-", benchmark, table)


if __name__ == "__main__":
    sys.exit(main())
