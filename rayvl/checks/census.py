"""What one training step asks of the host, counted on a CPU: a proxy for the framework overhead of a GPU step.

    rayvl check census [--stages 0,1,2,3] [--precision bf16] [--methods] [--batch-path] [--top N]

(``python benchmarks/step_census.py ...`` in a checkout runs this same census; benchmarks/host_time.py times the
steps it builds.)

On a GPU every aten op the host dispatches is a kernel launch (5-15 µs of host time each), a scalar read
(``.item()``, ``bool(t)``: ``aten._local_scalar_dense``) or a device synchronisation stops the host until the
GPU has caught up, and a Python thread that holds the GIL delays the launches. None of that needs a GPU to count.
The census runs steady steps of

- **bare**: a hand-written loop — the same model, CLIP loss, bf16 autocast, ``clip_grad_norm_`` (foreach) and
  fused AdamW, the batch already in memory (the loop rayvl is measured against on GPUs, ``rayvl check gpu``);
- **rayvl ZeRO-n**: rayvl's own step (``rayvl.train.step.Step``: the objective, DeepSpeed's backward and
  step through ``rayvl.train.engine.build_engine``, the report window) on the same model and batch;

on a small model with the tensor layout of the laion_adapt recipe at ViT-B/32 (a 12-block ViT image tower, the
frozen MiniLM text tower with 2 alignment layers: 188 trainable tensors) and counts per step: aten ops, the ones
that launch a kernel (view and alias ops do not), scalar reads, device synchronisations (DeepSpeed's accelerator
and ``torch.cuda``) and Python threads alive. ``--batch-path`` adds rayvl ZeRO-2 fed through the real batch path:
a Ray Data dataset iterated by ``rayvl.train.batches.batch_stream`` (its producer thread, Ray Data's threads).
``--methods`` adds rayvl's stage-0 step with the training parts of a memory bank ([BoW]: EMA key encoders, a queue)
and of UniCL's label-aware loss (TOnICS's loss too), and a hand-written memory-bank loop beside the bare one.
``--clip`` adds the most common real use, a whole CLIP fine-tuned (configs/clip_finetune.yaml) at ViT-B/32's tensor
layout (12 blocks a tower, every tensor trained: 350, as a released ViT-B/32 has in rayvl, whose Hugging Face text
transformer holds q, k and v apart), rayvl's stage-0 step beside a bare loop of the same CLIP.

DeepSpeed gets the config a one-GPU run gets (the census checks they are equal: at world size 1 rayvl's GPU and
CPU DeepSpeed configs differ in nothing). Counts, not timings: ``tests/test_step_census.py`` pins them.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

# before DeepSpeed is imported: it picks its accelerator once, and the census counts on a CPU
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

IMAGE, TOKENS, BATCH = 32, 16, 4
# ops that allocate or alias without launching a kernel
NO_KERNEL = {"aten.empty", "aten.empty_strided", "aten.set_", "aten._unsafe_view", "aten.lift_fresh"}
SCALAR_READ = "aten._local_scalar_dense"
# ops that make a CUDA host wait for the GPU, which a CPU run does not show as a wait: a scalar read (.item(),
# bool(t)); a fresh tensor from host data (torch.tensor(x, device=cuda): a pageable copy, then a stream sync); a
# fill with a tensor-valued scalar (an .item() inside); nonzero (its output size is read back)
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.lift_fresh.default", "aten.masked_fill_.Tensor",
            "aten.masked_fill.Tensor", "aten.nonzero.default", "aten.masked_select.default"}


@dataclass
class Counts:
    """One step's census."""

    ops: int = 0
    kernels: int = 0
    scalar_reads: int = 0
    sync_ops: int = 0
    """ops of SYNC_OPS: each a wait for the GPU on CUDA"""
    synchronizes: int = 0
    threads: int = 0
    by_op: collections.Counter = field(default_factory=collections.Counter)


class Census(TorchDispatchMode):
    """Counts every aten op dispatched while it is active, and the device synchronisations asked for."""

    def __init__(self):
        super().__init__()
        self.counts = Counts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        c = self.counts
        c.ops += 1
        c.by_op[name] += 1
        if not func.is_view and name not in NO_KERNEL:
            c.kernels += 1
        if name == SCALAR_READ:
            c.scalar_reads += 1
        if str(func) in SYNC_OPS:
            c.sync_ops += 1
            c.by_op[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._restore = _count_synchronizes(self.counts)
        return super().__enter__()

    def __exit__(self, *exc):
        self._restore()
        self.counts.threads = max(self.counts.threads, threading.active_count())
        return super().__exit__(*exc)


def _count_synchronizes(counts: Counts) -> Callable[[], None]:
    """Wrap the device synchronisations a step could ask for (DeepSpeed's accelerator, torch.cuda's function,
    streams and events); returns the undo."""
    from deepspeed.accelerator import get_accelerator

    targets = [(get_accelerator(), "synchronize"), (torch.cuda, "synchronize"),
               (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]

    def wrap(original):
        def synchronize(*args, **kwargs):
            counts.synchronizes += 1
            return original(*args, **kwargs)
        return synchronize

    for obj, name, original in saved:
        setattr(obj, name, wrap(original))
    return lambda: [setattr(obj, name, original) for obj, name, original in saved]


def census(step: Callable[[], None], warmup: int = 2) -> Counts:
    """The counts of the last of ``warmup`` + 1 steps (the first ones create optimizer state and buffers)."""
    for _ in range(warmup):
        step()
    counter = Census()
    with counter:
        step()
    return counter.counts


# ----------------------------------------------------------------------------- the model and the batch

def config(stage: int, precision: str, overrides: list[str] = ()):
    from rayvl.config import installed_dir, load_config

    return load_config(installed_dir("--config") / "laion_adapt.yaml", [
        f"train.zero_stage={stage}", f"train.precision={precision}", f"train.micro_batch_size={BATCH}",
        f"data.image_size={IMAGE}", f"data.max_text_tokens={TOKENS}", "train.num_workers=1", *overrides])


# the whole-CLIP rows (--clip): rayvl's step and the bare loop it is measured against
CLIP_ROWS = ("bare loop, whole CLIP", "rayvl ZeRO-0, whole CLIP")
_clip_files: dict[str, str] = {}


def clip_file() -> str:
    """A CLIP with ViT-B/32's tensor layout — 12 residual blocks in each tower, one head 64 wide, 8 px patches at 32
    px, CLIP's vocabulary and 77 positions — as open_clip builds it, written once a process."""
    if "path" not in _clip_files:
        import tempfile
        from pathlib import Path

        from rayvl.compat import ensure_torchvision_importable

        ensure_torchvision_importable()  # open_clip imports torchvision, as timm does
        from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

        torch.manual_seed(0)
        model = CLIP(embed_dim=64, vision_cfg=CLIPVisionCfg(layers=12, width=64, head_width=64, patch_size=8,
                                                            image_size=IMAGE),
                     text_cfg=CLIPTextCfg(context_length=77, vocab_size=49408, width=64, heads=1, layers=12))
        path = Path(tempfile.mkdtemp(prefix="rayvl-census-clip-")) / "clip.pt"
        torch.save(model.state_dict(), path)
        _clip_files["path"] = str(path)
    return _clip_files["path"]


def clip_config(stage: int, precision: str):
    """configs/clip_finetune.yaml on clip_file's CLIP, at the census's batch, image size and tokens."""
    from rayvl.config import installed_dir, load_config

    return load_config(installed_dir("--config") / "clip_finetune.yaml", [
        f"model.init_from_clip={clip_file()}", f"train.zero_stage={stage}", f"train.precision={precision}",
        f"train.micro_batch_size={BATCH}", f"data.max_text_tokens={TOKENS}", "train.num_workers=1"])


def small_model(cfg):
    """The recipe's dual encoder with a ViT-B/32-shaped image tower shrunk to 64 channels at 32 px: the tensor
    layout of laion_adapt at ViT-B/32 (each trainable tensor a kernel launch of the optimizer), cheap on a CPU. For
    a whole CLIP's config (clip_config): that CLIP, already small."""
    from torch import nn

    from rayvl.compat import import_timm
    from rayvl.models.dual_encoder import DualEncoder

    if cfg.model.init_from_clip:
        from rayvl.models.dual_encoder import build_model

        return build_model(cfg.model, cfg.train.seed)
    timm = import_timm()
    torch.manual_seed(cfg.train.seed)
    model = DualEncoder(cfg.model)
    backbone = timm.create_model("vit_base_patch32_224", pretrained=False, img_size=IMAGE, embed_dim=64,
                                 num_heads=2, mlp_ratio=2.0)
    backbone.reset_classifier(0)
    model.vision.backbone, model.vision.out_dim = backbone, backbone.num_features
    model.vision_proj = nn.Linear(backbone.num_features, cfg.model.embed_dim, bias=False)
    return model


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[: BATCH // 2, TOKENS // 2:] = 0  # padded captions, as real batches have
    return {"image": torch.randint(0, 256, (BATCH, 3, IMAGE, IMAGE), dtype=torch.uint8, generator=g),
            "input_ids": torch.randint(1000, 2000, (BATCH, TOKENS), generator=g), "attention_mask": mask,
            "label": torch.full((BATCH,), -1), "row": torch.arange(BATCH)}


def trainable_tensors(model) -> int:
    return sum(1 for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- the steps

def bare_step(cfg) -> Callable[[], None]:
    """The hand-written loop: fp32 weights under bf16 autocast, fused AdamW, foreach clipping."""
    from rayvl.losses import clip_loss
    from rayvl.models.dual_encoder import param_groups

    model, b, t = small_model(cfg), batch(), cfg.train
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, eps=t.eps,
                                  fused=True)
    bf16 = cfg.train.precision == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            features = model(b["image"], b["input_ids"], b["attention_mask"])
        loss = clip_loss(*(f.float() for f in features))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _own_linear(step, torch._C._nn.linear)


# the method parts a step is counted with, at the auto layout (stage 0): their config and the hand-written loop
# each is measured against (a memory bank's own arithmetic, its EMA forward, is in its bare loop too)
METHODS = {"memory bank": (["memory_bank.size=64"], "bare loop + memory bank"),
           "label-aware loss": (["loss.kind=unicl"], "bare loop")}


def bare_memory_bank_step(cfg) -> Callable[[], None]:
    """The hand-written loop with [BoW]'s memory bank (rayvl.methods.bow.memory_bank, the method's own arithmetic):
    the EMA keys of the batch, the loss against them and the queue, the EMA update after the optimizer step."""
    from rayvl.losses import label_aware_loss
    from rayvl.methods.bow.memory_bank import MemoryBank
    from rayvl.models.dual_encoder import param_groups

    model, b, t, mb = small_model(cfg), batch(), cfg.train, cfg.memory_bank
    bf16 = t.precision == "bf16"
    bank = MemoryBank(model, mb.size, cfg.model.embed_dim, mb.momentum, torch.bfloat16 if bf16 else None)
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, eps=t.eps,
                                  fused=True)
    scale, state = torch.full((), 1.0 / mb.temperature), {"step": 0}

    def step():
        labels = -1 - (state["step"] * BATCH + torch.arange(BATCH))  # every pair its own, as rayvl.train.step's
        state["step"] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            image, text, _ = model(b["image"], b["input_ids"], b["attention_mask"])
        image_keys, text_keys = bank.encode(b["image"], b["input_ids"], b["attention_mask"])
        keys = dict(zip(("image_keys", "text_keys", "key_labels"), bank.keys(image_keys, text_keys, labels)))
        loss = label_aware_loss(image.float(), text.float(), scale, labels, **keys)
        bank.enqueue(image_keys, text_keys, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bank.update(model)
    return _own_linear(step, torch._C._nn.linear)


def _own_linear(step: Callable[[], None], linear) -> Callable[[], None]:
    """``step`` run with ``linear`` as ``torch.nn.functional.linear``: the one a process of its own would have. A
    ZeRO-3 engine's build (its zero.Init) puts DeepSpeed's memory-efficient linear there for the rest of the process
    ("this will persist unless manually reset"), and every step measured after it in one process would run it."""
    def step_with_linear():
        torch.nn.functional.linear = linear
        try:
            step()
        finally:
            torch.nn.functional.linear = torch._C._nn.linear  # torch's own
    return step_with_linear


def ensure_process_group() -> None:
    """A one-rank gloo group, as Ray Train makes for one worker (DeepSpeed joins it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(name, value)
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)


def rayvl_step(cfg, next_batch=None):
    """rayvl's step (rayvl.train.step.Step) through its DeepSpeed engine, with the training parts the config enables
    built as a worker builds them (rayvl.train.parts.train_parts: a memory bank's key encoders, UniCL's label-aware
    targets) and each part's ``after_step`` after every step, as the loop calls it; the batch is the census's own
    (``next_batch``), never a part's source (TOnICS's sampler is timed by benchmarks/tonics_batches.py); (step,
    engine)."""
    import dataclasses

    from rayvl.train.engine import build_engine, deepspeed_config
    from rayvl.train.parts import train_parts
    from rayvl.train.resume import TrainedRows
    from rayvl.train.step import Step
    from rayvl.train.window import Window
    from rayvl.train.worker import Worker, WorkerSetup

    on_gpu = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, use_gpu=True))
    if deepspeed_config(on_gpu, 1) != deepspeed_config(cfg, 1):
        raise AssertionError("a one-GPU run would get another DeepSpeed config than the census measures")
    ensure_process_group()
    model = small_model(cfg)
    parts = train_parts(Worker(WorkerSetup(cfg), cfg, 0, 1, torch.device("cpu"), None, None))
    for part in parts:
        part.model_built(model)
    torch.nn.functional.linear = torch._C._nn.linear  # what this layout's build installs, from torch's own
    engine = build_engine(model, cfg, 1)
    linear, torch.nn.functional.linear = torch.nn.functional.linear, torch._C._nn.linear  # see _own_linear
    rows, state = TrainedRows(), {"step": 0}
    train_step = Step(engine, parts, cfg, rows)
    b = batch()
    next_batch = next_batch or (lambda step, micro: (b, 0.0))

    def step():
        state["step"] += 1
        train_step.window = Window(first_step=state["step"])
        train_step(next_batch, state["step"])
        for part in parts:
            part.after_step(engine, state["step"])
        rows.parts.clear()  # flushed at checkpoints in a run: not a cost of the step
    return _own_linear(step, linear), engine


def ray_data_batches(cfg, rows: int = 64):
    """next_batch over a Ray Data dataset of the census's batches, through rayvl's batch stream (its producer
    thread and Ray Data's iterator threads) — the path a training worker's batches take."""
    import numpy as np
    import ray

    from rayvl.train.batches import batch_stream

    one = {k: v.numpy() for k, v in batch().items()}
    columns = {k: np.concatenate([v] * (rows // BATCH)) for k, v in one.items()}
    columns["row"] = np.arange(rows)
    ds = ray.data.from_items([{k: v[i] for k, v in columns.items()} for i in range(rows)])
    stream = batch_stream(ds.iterator(), cfg)
    return lambda step, micro: next(stream)


# ----------------------------------------------------------------------------- the table

def run(stages: list[int], precision: str, batch_path: bool, methods: bool = False,
        clip: bool = False) -> list[tuple[str, Counts]]:
    rows = [("bare loop", census(bare_step(config(0, precision))))]
    for stage in stages:
        step, _ = rayvl_step(config(stage, precision))
        rows.append((f"rayvl ZeRO-{stage}", census(step)))
    if methods:
        rows += [(name, census(step)) for name, step in method_steps(precision).items()]
    if clip:
        rows += [(name, census(step)) for name, step in clip_steps(precision).items()]
    if batch_path:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        cfg = config(2, precision)
        step, _ = rayvl_step(cfg, ray_data_batches(cfg))
        rows.append(("rayvl ZeRO-2, Ray Data batches", census(step)))
    return rows


def method_steps(precision: str) -> dict[str, Callable[[], None]]:
    """rayvl's stage-0 step with each of METHODS' parts, and the memory bank's bare loop, by name."""
    steps = {"bare loop + memory bank": bare_memory_bank_step(config(0, precision, METHODS["memory bank"][0]))}
    for name, (overrides, _) in METHODS.items():
        steps[f"rayvl ZeRO-0 + {name}"] = rayvl_step(config(0, precision, overrides))[0]
    return steps


def clip_steps(precision: str) -> dict[str, Callable[[], None]]:
    """The bare loop and rayvl's stage-0 step (auto's layout on one GPU) on clip_config's whole CLIP, by name."""
    cfg = clip_config(0, precision)
    return {CLIP_ROWS[0]: bare_step(cfg), CLIP_ROWS[1]: rayvl_step(cfg)[0]}


def baseline(name: str) -> str:
    """The hand-written loop a step is measured against: a method's own (METHODS), a whole CLIP's own, else the
    bare loop."""
    if name in CLIP_ROWS:
        return CLIP_ROWS[0]
    method = name.partition("ZeRO-0 + ")[2]
    return METHODS[method][1] if method in METHODS else "bare loop"


def table(rows: list[tuple[str, Counts]], precision: str) -> str:
    by_name = dict(rows)
    head = (f"{'step':<32} {'aten ops':>9} {'×bare':>6} {'kernels':>8} {'×bare':>6} {'scalar reads':>13} "
            f"{'sync ops':>9} {'synchronizes':>13} {'threads':>8}")
    lines = [f"step census, {precision}, 188 trainable tensors (a whole CLIP's rows 350), batch {BATCH}, counts per "
             f"optimizer step; ×bare: against the bare loop, a method's or a whole CLIP's row against its own loop",
             head, "-" * len(head)]
    for name, c in rows:
        base = by_name[baseline(name)]
        lines.append(f"{name:<32} {c.ops:>9} {c.ops / base.ops:>6.2f} {c.kernels:>8} {c.kernels / base.kernels:>6.2f} "
                     f"{c.scalar_reads:>13} {c.sync_ops:>9} {c.synchronizes:>13} {c.threads:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rayvl check census", description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to count, comma-separated")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--batch-path", action="store_true", help="also ZeRO-2 fed by Ray Data (starts a local Ray)")
    p.add_argument("--methods", action="store_true",
                   help="also stage 0 with a memory bank and with UniCL's label-aware loss, and a bare loop with "
                        "the memory bank")
    p.add_argument("--clip", action="store_true",
                   help="also a whole CLIP fine-tuned (ViT-B/32's tensor layout) at stage 0 and its bare loop")
    p.add_argument("--top", type=int, default=0, help="also list each step's N most frequent kernel ops")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rows = run([int(s) for s in args.stages.split(",") if s], args.precision, args.batch_path, args.methods,
               args.clip)
    print(table(rows, args.precision))
    for name, c in rows if args.top else []:
        print(f"\n{name}: " + ", ".join(f"{op} {n}" for op, n in c.by_op.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
