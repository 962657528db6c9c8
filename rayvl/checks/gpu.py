"""The GPU check (issues 35, 44, 54): does rayvl train, label and evaluate on this machine's GPUs, and how fast
against a hand-written loop — about ten minutes on one GPU.

    rayvl check gpu [--quick] [--out PATH] [--cases bare,zero0,eval] [--batch 256] [--batches 256,1024,max]
                    [--profile zero0] [--profile-startup zero0] [--eval-images 20000] [--set k=v ...]
                    [--deadline-s 400]
    make gpu-check GPU=1 ARGS='...'

(``python benchmarks/gpu_check.py ...`` in a checkout runs this same check: the offline bundle's GPU workflow calls
that path.)

Every training case is a short run on the embedded demo dataset at 224 px with a ViT-B/32 image tower (timm
``vit_base_patch32_224``, random init: nothing is downloaded), bf16, one Ray Train worker per GPU:

- bare: a hand-written PyTorch loop with zero2's model and loss — bf16 autocast, fused AdamW, foreach clipping,
  uint8 images and tokens already on the GPU, no Ray, no DeepSpeed: what the hardware gives without a framework.
  Every training case's samples/s is also printed as a ratio to it (at the case's batch);
- zero0: stage 0, torch autocast over fp32 weights and no ZeRO hooks — the layout ``train.zero_stage=auto`` picks
  where the model fits one GPU, so the recommended one; zero1: ZeRO-1; zero2: ZeRO-2 (its run is the one the eval and
  pseudo-label cases use); zero3: ZeRO-3; tonics: the TOnICS recipe (configs/tonics.yaml), memory_bank: the EMA
  memory bank, both at stage 0 (auto's layout on one GPU), so compared with zero0;
- pseudo_label: ``rayvl pseudo-label`` of ``--eval-images`` images (the demo's training shards copied under new
  keys until there are that many) with zero2's model, its actors on GPUs, its exact caption index searched there;
- eval: ``rayvl eval --gpus 1`` of zero2's run joined to the check's Ray (as on a cluster: GPU actors fed by Ray
  Data), retrieval over ``--eval-images`` held-out images (copied likewise): images/s once running, not start-up;
  its actors decode the JPEGs on their GPU (``--decode device``);
- zero0_decode: zero0 with ``data.decode=device`` (the workers' GPUs decode the JPEGs the read tasks keep encoded);
- eval_cpu_decode: the same with ``--decode cpu`` (Ray Data's read tasks decode), its retrieval metrics within 1
  point of the eval case's where that ran;
- eval_here: the same command with no cluster named (one model in the command's process fed by a local loader, no
  Ray: what one machine runs);
- bare_clip, clip: the most common real use — clip fine-tunes a whole ViT-B/32 CLIP (configs/clip_finetune.yaml:
  every weight trains, 77 tokens, auto's layout), bare_clip is the same CLIP in the bare loop, which clip's samples/s
  is divided by. The CLIP is ``--clip FILE``, else open_clip's ViT-B-32 architecture with a random init (written
  once into the check's storage; open_clip_torch and ftfy, rayvl's dependencies, must be importable);
- compile: zero2 through ``torch.compile`` (inductor), not in the default cases;
- kill_resume: a worker killed (SIGKILL, ``RAYVL_FAIL_AT``) between two checkpoints; the run must resume from the
  earlier one and end at its last step, no row trained twice.

``--batches 256,1024,max`` runs bare, zero0-zero3, bare_clip and clip at each micro-batch (``max``: the largest
power of two the bare loop fits, found by doubling until the GPU runs out of memory). ``--profile CASE`` writes a
torch.profiler trace of steps 6-8 of that training case (``RAYVL_PROFILE``, rayvl/train/profiling.py) or of a bare
loop to ``<--out>-profile/``; ``--profile-startup CASE`` writes there where rank 0's start of that case spends its
time until its first step, by function (``RAYVL_PROFILE_STARTUP``). Every training case's steps from the third on
run under ``torch.cuda.set_sync_debug_mode`` (``RAYVL_SYNC_DEBUG``, set before this check starts Ray, so its workers
inherit it); the bare loops' timed steps too, and the pseudo-labellers' units from the third (a unit's chunks: cut,
embedded and searched on the GPU, its retrievals read back after). The synchronisations caught a step (a unit) are
a column, where the first was made in the notes.

A case passes when it ran correctly. Its samples/s, MFU (rayvl.train.flops) and data-wait share are those of the
windows after the first (which holds the start-up), printed beside the goals (``GOALS``: issue 44's MFU and data
wait, issue 54's ratios, the time to the first step, no synchronisation in a step), which are separate columns and
notes, not pass/fail. Exit status 0 when every case passed, 1 when one failed, 2 when torch sees no CUDA GPU (said
before anything else starts).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

VISION, IMAGE_SIZE, PRECISION = "vit_base_patch32_224", 224, "bf16"
# on one H100 or H200 at bf16: MFU and data wait from issue 44, the rest from issue 54
GOALS = {"mfu": 0.35, "data_wait_share": 0.02, "first_step_s": 20.0, "syncs_per_step": 0,
         # samples/s (or MFU, "of": "mfu") over another case's at the same micro-batch: the goal, at these batches
         # (empty: any)
         "ratios": [{"case": "zero0", "over": "bare", "goal": 1.0, "batches": [256, 1024]},  # the recommended layout
                    {"case": "zero2", "over": "bare", "goal": 0.85, "batches": [1024]},
                    {"case": "zero3", "over": "zero2", "goal": 0.7, "batches": []},
                    # the methods at the plain step's layout (zero0, auto's on one GPU)
                    {"case": "tonics", "over": "zero0", "goal": 0.9, "batches": []},
                    # the EMA key encoders' forward is a third more FLOPs a sample ([BoW] §2.1: its samples/s can
                    # reach ~0.75× zero0's at most), so the plain step's speed is its MFU, which counts them
                    {"case": "memory_bank", "over": "zero0", "goal": 0.9, "batches": [], "of": "mfu"},
                    # a whole CLIP fine-tuned over the bare loop of the same CLIP ("bare": each case's own)
                    {"case": "clip", "over": "bare", "goal": 1.0, "batches": [256, 1024]}]}
PROFILED_STEPS = (6, 3)  # (first step, steps): steady steps, after compilation and the data plane's warm-up
NO_EVAL = "eval.tasks=[]"  # in-training evaluation off: the eval case evaluates on the GPU itself
PROG = "rayvl check gpu"  # the command, in its usage line and in the report (benchmarks/gpu_check.py runs the same)


class CaseFailed(Exception):
    """A case ran but did not do what it checks (its measurements so far are kept)."""


@dataclass
class Outcome:
    """One row of the table."""

    case: str
    what: str
    batch: int = 0
    passed: bool = False
    error: str = ""
    samples_per_s: float | None = None
    mfu: float | None = None
    mfu_source: str = ""
    data_wait_share: float | None = None
    windows: int = 0
    seconds: float = 0.0
    cpus: int = 0
    gpus: int = 0
    notes: str = ""
    run_dir: str = ""
    vs_bare: float | None = None
    """samples/s over the bare loop's at the same batch"""
    vs_zero0: float | None = None
    """samples/s over zero0's (the plain step at auto's layout) at the same batch"""
    vs_zero2: float | None = None
    """samples/s over zero2's at the same batch (every other training case)"""
    mfu_vs_zero0: float | None = None
    """MFU over zero0's at the same batch: the step's speed a FLOP, for a method whose sample costs more FLOPs"""
    syncs_per_step: float | None = None
    """host synchronisations caught a watched step, over every rank (RAYVL_SYNC_DEBUG)"""
    sync_watch: dict = field(default_factory=dict)
    """rayvl.train.profiling.read_syncs of the case's steps: the steps with any, the first stacks"""
    first_step_s: float | None = None
    """from ``train()`` to the end of the first optimizer step (its first report's ``startup_total_s``)"""


@dataclass
class Check:
    """What every case shares: the options, where runs go, the machine, and what earlier cases left."""

    args: argparse.Namespace
    storage: Path
    gpus: int
    device_name: str
    runs: dict = field(default_factory=dict)  # case name → its RunResult
    flops: dict = field(default_factory=dict)  # model settings → training FLOPs per sample
    batch: int = 0
    """the micro-batch of the case running now (0: --batch)"""

    @property
    def micro_batch(self) -> int:
        return self.batch or self.args.batch

    @property
    def steps(self) -> int:
        return self.args.steps or (30 if self.args.quick else 80)

    @property
    def log_every(self) -> int:
        return 5 if self.args.quick else 10


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    run: Callable[[Check, "Case", Outcome], None]
    recipe: str = ""
    """configs/<recipe>.yaml for a training case ('' = none)."""
    settings: Callable[[Check], list[str]] = lambda check: []
    """the case's own config overrides, after the check's common ones."""
    per_batch: bool = False
    """run once per --batches entry"""
    bare: str = "bare"
    """the bare-loop case a training case's samples/s is divided by (its ``× bare``): the one of its model"""
    model_of: str = "zero2"
    """for a bare-loop case: the training case whose config (model, loss, batch) its loop builds"""


# ----------------------------------------------------------------------------- no GPU: say so, start nothing

def no_gpu_message() -> str | None:
    """Why this machine cannot run the check (None when torch sees a CUDA GPU)."""
    import torch

    if torch.cuda.is_available():
        return None
    return (f"gpu_check: no CUDA GPU visible to torch (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda or 'none'}) — run it on a GPU machine; see docs/gpu.md")


# ----------------------------------------------------------------------------- training cases

def train_config(check: Check, case: Case):
    """The case's config: the recipe, the check's common settings, the case's own, then the user's ``--set``."""
    from rayvl.config import installed_dir, load_config

    a = check.args
    # a whole CLIP's towers come from its weights (model.init_from_clip), the others' image tower is timm's ViT-B/32
    tower = [f"model.init_from_clip={clip_file(check)}"] if case.recipe == CLIP_RECIPE else [f"model.vision={VISION}"]
    common = [*tower, f"data.image_size={IMAGE_SIZE}", "train.use_gpu=true",
              f"train.num_workers={check.gpus}", f"train.precision={PRECISION}",
              f"train.micro_batch_size={check.micro_batch}",
              f"train.max_steps={check.steps}", f"train.warmup_steps={check.steps // 4}",
              f"train.log_every={check.log_every}", f"train.checkpoint_every={check.steps}",
              f"train.storage_path={check.storage}", f"train.run_name={run_name(check, case)}",
              "train.report_to=[tensorboard]"]
    recipe = installed_dir("--config") / f"{case.recipe}.yaml"  # the installed recipes: no checkout needed
    return load_config(recipe, common + case.settings(check) + list(a.set))


CLIP_RECIPE = "clip_finetune"


def clip_file(check: Check) -> str:
    """The whole CLIP the clip cases fine-tune: ``--clip FILE``, else open_clip's ViT-B-32 with a random init (its
    architecture and sizes, not its weights: nothing is downloaded), written once into the check's storage."""
    if check.args.clip:
        return str(Path(check.args.clip).expanduser().resolve())
    path = check.storage / "clip-vit-b-32-random-init.pt"
    if not path.is_file():
        import torch

        try:
            import open_clip
        except ImportError as e:
            raise CaseFailed(f"the clip cases build open_clip's ViT-B-32: {e} (pip install open_clip_torch ftfy, "
                             f"rayvl's own dependencies; or give --clip FILE)") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(open_clip.create_model("ViT-B-32", pretrained=None).state_dict(), path)
    return str(path)


def run_name(check: Check, case: Case) -> str:
    return f"gpu-check-{case.name}" + (f"-b{check.batch}" if check.batch and check.batch != check.args.batch else "")


def run_training(check: Check, case: Case, outcome: Outcome, env: dict | None = None):
    """Train the case's config (in a task carrying ``env`` to the run's workers when given), measure it, keep it
    for the cases that use its run; the config and the RunResult."""
    cfg = train_config(check, case)
    if check.args.profile == case.name and check.micro_batch == check.args.batch:
        from rayvl.train.profiling import ENV

        env = {**(env or {}), ENV: f"{profile_dir(check)}:{PROFILED_STEPS[0]}:{PROFILED_STEPS[1]}"}
    if check.args.profile_startup == case.name and check.micro_batch == check.args.batch:
        from rayvl.train.profiling import STARTUP_ENV

        env = {**(env or {}), STARTUP_ENV: str(profile_dir(check))}
        outcome.notes = "start-up profiled (cProfile: its phases slower than without)"
    watched = sync_files()
    if env is None:
        from rayvl.train.trainer import train

        result = train(cfg, progress=True, verbose=check.args.verbose)
    else:
        result = _train_with_env(check, cfg, env)
    check.runs[run_name(check, case)] = result
    outcome.run_dir = str(result.uri)
    measure(check, cfg, read_rows(result), outcome)
    note_syncs(outcome, sync_files_since(watched))
    return cfg, result


def _train_with_env(check: Check, cfg, env: dict):
    """train() in a CPU-less task whose environment (and so its run's controller's and workers') holds ``env``, as
    `ray job submit` runs a driver; the progress lines come from this process, following the run's metrics."""
    import ray

    from rayvl.checkpoints import METRICS_FILE
    from rayvl.session import WORKER_ENV
    from rayvl.train.progress import ProgressPrinter
    from rayvl.train.trainer import train

    connect(check)
    # rayvl's own function, which every worker imports (a function of a script run as __main__ would not be)
    task = ray.remote(num_cpus=0, max_retries=0, runtime_env={"env_vars": {**WORKER_ENV, **env}})(train)
    printer = ProgressPrinter(check.storage / cfg.train.run_name / METRICS_FILE, cfg.train.max_steps,
                              cfg.train.num_workers)
    printer.start()
    try:
        return ray.get(task.remote(cfg))
    finally:
        printer.stop()


def read_rows(result) -> list[dict]:
    """The run's reports (metrics.jsonl: at the end, the history of the steps that count)."""
    text = (Path(result.run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def steady_state(rows: list[dict], per_step: int, skip: range = range(0)) -> dict:
    """samples/s, data-wait share and MFU (when every window has one) over the windows after the first and after
    each restart's first (start-up, compilation, a restored engine), each window weighted by its seconds; windows
    holding a step of ``skip`` (the profiled ones, slowed by the profiler) are left out."""
    def profiled(r: dict) -> bool:
        return any(s in skip for s in range(r.get("first_step", r["step"]), r["step"] + 1))

    windows = [r for i, r in enumerate(rows) if i > 0 and r.get("resumed_from") is None and not profiled(r)] \
        or rows[-1:]
    samples = seconds = waited = mfu_seconds = 0.0
    for row in windows:
        n = (row["step"] - row.get("first_step", row["step"]) + 1) * per_step
        s = n / row["samples_per_s"]
        samples, seconds, waited = samples + n, seconds + s, waited + s * row["data_wait_share"]
        mfu_seconds += s * row["mfu"] if row.get("mfu") is not None else float("nan")
    return {"samples_per_s": samples / seconds, "data_wait_share": waited / seconds, "windows": len(windows),
            "mfu": mfu_seconds / seconds if mfu_seconds == mfu_seconds else None}


def driver_clock(rows: list[dict], per_step: int) -> float | None:
    """samples/s by the driver's clock (``elapsed_s`` as each report arrived) from the first report to the last
    before the final one (which carries the final checkpoint): the windows' rate checked against the wall time
    (a report that waited for Ray Train's poll once went uncounted by its window); the evaluations in between are
    left out, as the windows leave them out. None for a restarted run, too few reports, or rows without the
    driver's stamp."""
    if len(rows) < 3 or any(r.get("resumed_from") is not None or "elapsed_s" not in r for r in rows):
        return None
    first, last = rows[0], rows[-2]
    seconds = last["elapsed_s"] - first["elapsed_s"] - sum(r.get("evaluation_s", 0.0) for r in rows[1:-1])
    return (last["step"] - first["step"]) * per_step / seconds if seconds > 0 else None


def measure(check: Check, cfg, rows: list[dict], outcome: Outcome) -> None:
    """The run's steady samples/s and data wait; its MFU from its reports when the training loop wrote one,
    else from this check's FLOPs count and the device's peak (none for a GPU the peak table lacks)."""
    from rayvl.train import startup
    from rayvl.train.flops import mfu, peak_flops, table_precision

    t = cfg.train
    profiled = check.args.profile and check.args.profile == outcome.case and check.micro_batch == check.args.batch
    skip = range(PROFILED_STEPS[0], sum(PROFILED_STEPS)) if profiled else range(0)
    steady = steady_state(rows, t.num_workers * t.micro_batch_size * t.grad_accumulation, skip)
    outcome.samples_per_s, outcome.data_wait_share = steady["samples_per_s"], steady["data_wait_share"]
    if rows and (phases := startup.summary(rows[0])) is not None:  # where the time before the first step went
        outcome.first_step_s = rows[0]["startup_total_s"]
        outcome.notes = "; ".join(x for x in (outcome.notes, phases) if x)
    outcome.windows = steady["windows"]
    clock = None if profiled else driver_clock(rows, t.num_workers * t.micro_batch_size * t.grad_accumulation)
    if clock is not None:  # a profiled case's clock holds the profiled steps, which its windows leave out
        outcome.notes = "; ".join(x for x in (outcome.notes, f"{clock:.0f} samples/s by the driver's clock") if x)
    if steady["mfu"] is not None:
        outcome.mfu, outcome.mfu_source = steady["mfu"], "run's reports"
        return
    peak = peak_flops(check.device_name, table_precision(cfg.train, on_gpu=True))
    if peak is not None:
        outcome.mfu = mfu(outcome.samples_per_s, flops_per_sample(check, cfg), peak, t.num_workers)
        outcome.mfu_source = "gpu_check"


def flops_per_sample(check: Check, cfg) -> float:
    """Training FLOPs of one sample of the case's model (rayvl.train.flops), counted once per model setting."""
    key = json.dumps([cfg.to_dict()["model"], cfg.data.image_size, cfg.data.max_text_tokens, cfg.memory_bank.size > 0])
    if key not in check.flops:
        from transformers.utils import logging as hf_logging

        from rayvl.models.dual_encoder import build_model
        from rayvl.train.flops import model_flops_per_sample

        hf_logging.disable_progress_bar()  # the text tower's loading bar, between the progress lines
        model = build_model(cfg.model, cfg.train.seed)
        check.flops[key] = model_flops_per_sample(model, cfg.data.image_size, cfg.data.max_text_tokens,
                                                  key_encoders=cfg.memory_bank.size > 0)
    return check.flops[key]


def watch_syncs(check: Check) -> None:
    """RAYVL_SYNC_DEBUG in this process's environment before Ray starts: the local Ray a training case starts, and so
    its workers, inherit it (a value the caller set is kept; a Ray joined through RAY_ADDRESS does not get it)."""
    from rayvl.train.profiling import SYNC_ENV

    os.environ.setdefault(SYNC_ENV, str(check.storage / "syncs"))


def sync_files() -> dict[Path, tuple[int, int]]:
    """The sync watch's files now, with their (modification time, size): a case's are those new or changed after
    it (a worker's file is named by its process id, which the system may give again)."""
    from rayvl.train.profiling import SYNC_ENV, SyncWatch

    spec = os.environ.get(SYNC_ENV, "")
    paths = SyncWatch(spec, 0).out.glob("syncs-rank*.jsonl") if spec else []
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in paths}


def sync_files_since(before: dict[Path, tuple[int, int]]) -> list[Path]:
    """The sync watch's files new or changed since ``before`` (``sync_files()`` taken before a case ran)."""
    return [p for p, seen in sync_files().items() if before.get(p) != seen]


def note_syncs(outcome: Outcome, paths: list[Path]) -> None:
    """The synchronisations the case's watched steps made: per step in their column, where the first was made in
    the notes, everything in the report's JSON."""
    from rayvl.train.profiling import read_syncs

    summary = read_syncs(paths)
    if not summary["steps"]:
        outcome.notes = "; ".join(x for x in (outcome.notes, "no step watched for synchronisations (RAYVL_SYNC_DEBUG "
                                              "reaches the workers of a Ray this check starts)") if x)
        return
    outcome.sync_watch, outcome.syncs_per_step = summary, summary["syncs"] / summary["steps"]
    if summary["samples"]:
        first = summary["samples"][0]
        where = " < ".join(reversed(first["stack"][-3:]))  # innermost first
        outcome.notes = "; ".join(x for x in (outcome.notes, f"synchronisations at steps "
                                              f"{spans(summary['steps_with_syncs'])}, the first in {first['thread']}: "
                                              f"{where}") if x)


def spans(steps: list[int]) -> str:
    """``3-5, 9``: sorted step numbers as runs."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def train_case(check: Check, case: Case, outcome: Outcome) -> None:
    cfg, result = run_training(check, case, outcome)
    steps = [r["step"] for r in read_rows(result)]
    if not steps or steps[-1] != cfg.train.max_steps:
        raise CaseFailed(f"the run's last report is at step {steps[-1] if steps else None}, not "
                         f"{cfg.train.max_steps}")


# ----------------------------------------------------------------------------- the bare loop

def profile_dir(check: Check) -> Path:
    # absolute: Ray Train runs each worker in a directory of its own
    base = Path(check.args.out).expanduser().resolve() if check.args.out else check.storage / "gpu_check"
    return base.with_name(base.with_suffix("").name + "-profile")


class BareLoop:
    """A training case's model and loss (zero2's unless ``model_of`` names another) in a hand-written loop on GPU
    0: fp32 weights under bf16 autocast, fused AdamW, foreach gradient clipping, a uint8 batch already on the GPU
    (normalised by the model, as rayvl's is)."""

    def __init__(self, check: Check, batch: int, model_of: str = "zero2"):
        import torch

        from rayvl.models.dual_encoder import build_model, param_groups

        check.batch = batch
        self.cfg, self.batch = train_config(check, CASES_BY_NAME[model_of]), batch
        t = self.cfg.train
        self.device = torch.device("cuda", 0)
        self.model = build_model(self.cfg.model, t.seed).to(self.device).train()
        self.optimizer = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr, betas=t.betas,
                                           eps=t.eps, fused=True)
        tokens = self.cfg.data.max_text_tokens
        self.images = torch.randint(0, 256, (batch, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8,
                                    device=self.device)
        self.ids = torch.randint(1000, 2000, (batch, tokens), device=self.device)
        self.mask = torch.ones(batch, tokens, dtype=torch.long, device=self.device)

    def step(self) -> None:
        import torch

        from rayvl.losses import clip_loss

        with torch.autocast("cuda", dtype=torch.bfloat16):
            features = self.model(self.images, self.ids, self.mask)
        loss = clip_loss(*(f.float() for f in features))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        import torch

        del self.model, self.optimizer, self.images, self.ids, self.mask
        torch.cuda.empty_cache()


def bare_case(check: Check, case: Case, outcome: Outcome) -> None:
    import torch

    from rayvl.train.flops import mfu, peak_flops, table_precision
    from rayvl.train.profiling import SyncWatch

    torch.cuda.reset_peak_memory_stats(0)
    loop = BareLoop(check, check.micro_batch, case.model_of)
    folder = check.storage / "syncs" / f"{case.name}-b{check.micro_batch}"
    try:
        for _ in range(PROFILED_STEPS[0]):  # cuDNN / cuBLAS choices, the allocator's first blocks
            loop.step()
        if check.args.profile == case.name and check.micro_batch == check.args.batch:
            _profile_bare(check, loop)
        caught = sync_watch_catches(folder / "self-check")
        torch.cuda.synchronize()
        started, steps, watch = time.perf_counter(), check.steps, SyncWatch(f"{folder}:1", 0)
        for step in range(1, steps + 1):  # under the sync watch as rayvl's steps are: the same cost, a control
            watch.before(step)
            loop.step()
            watch.after(step)
        torch.cuda.synchronize()
        outcome.samples_per_s = steps * loop.batch / (time.perf_counter() - started)
        peak = peak_flops(check.device_name, table_precision(loop.cfg.train, on_gpu=True))
        if peak is not None:
            outcome.mfu = mfu(outcome.samples_per_s, flops_per_sample(check, loop.cfg), peak, 1)
            outcome.mfu_source = "gpu_check"
        outcome.notes = (f"{steps} steps after {PROFILED_STEPS[0]}; peak memory "
                         f"{torch.cuda.max_memory_allocated(0) / 2**30:.1f} GiB")
        if not caught:
            outcome.notes += "; the sync watch missed a deliberate .item(): no syncs/step of this check says much"
        note_syncs(outcome, sorted(folder.glob("syncs-rank*.jsonl")))
    finally:
        loop.close()


def sync_watch_catches(folder: Path) -> bool:
    """Whether the sync watch catches a synchronisation on this machine's torch: one ``.item()`` watched."""
    import torch

    from rayvl.train.profiling import SyncWatch, read_syncs

    watch = SyncWatch(f"{folder}:1", 0)
    watch.before(1)
    torch.ones(1, device="cuda").sum().item()
    watch.after(1)
    return read_syncs(sorted(folder.glob("syncs-rank*.jsonl")))["syncs"] > 0


def _profile_bare(check: Check, loop: BareLoop) -> None:
    import torch

    from rayvl.train.profiling import StepProfiler

    profiler = StepProfiler(f"{profile_dir(check)}:1:{PROFILED_STEPS[1]}", 0)
    for step in range(1, PROFILED_STEPS[1] + 1):
        profiler.before(step)
        loop.step()
        profiler.after(step)
    torch.cuda.synchronize()


def largest_batch(check: Check, start: int) -> int:
    """The largest power-of-two micro-batch ≥ ``start`` whose bare-loop step fits this GPU (two steps each) and
    whose training case's config is valid (a global batch the demo's 4,000 training samples fill)."""
    import torch

    from rayvl.errors import ConfigError

    fits, batch = 0, start
    while batch <= 1 << 16:
        loop = None
        try:
            check.batch = batch
            train_config(check, CASES_BY_NAME["zero2"])
            loop = BareLoop(check, batch)
            loop.step()
            loop.step()
            torch.cuda.synchronize()
            fits, batch = batch, batch * 2
        except (torch.cuda.OutOfMemoryError, ConfigError):
            break
        finally:
            if loop is not None:
                loop.close()
            torch.cuda.empty_cache()
    check.batch = 0
    if not fits:
        raise CaseFailed(f"not even a micro-batch of {start} fits the bare loop")
    return fits


def batches(check: Check) -> list[int]:
    """--batches resolved: 'max' becomes the largest power of two the bare loop fits."""
    listed = [b for b in check.args.batches.split(",") if b] if check.args.batches else [str(check.args.batch)]
    numbers = [int(b) for b in listed if b != "max"]
    if "max" in listed:
        numbers.append(largest_batch(check, max(numbers or [check.args.batch])))
    return list(dict.fromkeys(numbers))


# ----------------------------------------------------------------------------- kill and resume

def kill_settings(check: Check) -> list[str]:
    return ["train.zero_stage=2", NO_EVAL, f"train.checkpoint_every={kill_point(check)[1]}"]


def kill_point(check: Check) -> tuple[int, int, int]:
    """(the step a worker is killed after, the checkpoint step it must resume from, the rank killed)."""
    every = max(2, check.steps // 4)
    return every + every // 2, every, check.gpus - 1


def kill_resume_case(check: Check, case: Case, outcome: Outcome) -> None:
    from rayvl.checkpoints import read_meta, read_train_state

    killed, expected, rank = kill_point(check)
    cfg, result = run_training(check, case, outcome, env={"RAYVL_FAIL_AT": f"step:{killed}:{rank}"})
    final = read_meta(result.checkpoint_dir)["step"]
    resumed = read_train_state(result.checkpoint_dir)["progress"]["resumed_at"]
    rows = read_rows(result)
    steps = [r["step"] for r in rows]
    outcome.notes = (f"rank {rank} killed after step {killed}; resumed at {resumed or 'no step'}; "
                     f"last step {final}")
    if resumed != [expected]:
        raise CaseFailed(f"resumed at steps {resumed}, expected [{expected}] (the checkpoint before the kill)")
    if final != cfg.train.max_steps or steps != sorted(set(steps)) or steps[-1] != cfg.train.max_steps:
        raise CaseFailed(f"the resumed run ended at step {final} with reports at steps {steps}, "
                         f"not at {cfg.train.max_steps}")
    twice = rows[-1].get("data_duplicate_rows", 0)
    if twice:
        raise CaseFailed(f"{twice} rows trained twice across the resume")


# ----------------------------------------------------------------------------- the CLI cases

def connect(check: Check) -> str:
    """This check's Ray (the one the training cases started, or a new local one); its address for the CLI."""
    import ray

    from rayvl import session

    session.connect(verbose=check.args.verbose, include_dashboard=False)
    return ray.get_runtime_context().gcs_address


def run_cli(check: Check, args: list[str], timeout: float = 600, joined: bool = True) -> subprocess.CompletedProcess:
    """``rayvl ARGS`` in a new process joined to this check's Ray (whose GPUs the training cases have let go), or
    (``joined`` False) with no cluster named and the first GPU alone visible."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    first_gpu = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env = {**env, **({"RAY_ADDRESS": connect(check)} if joined else {"CUDA_VISIBLE_DEVICES": first_gpu}),
           **rayvl_importable()}
    # run from the check's own folder: `-m` puts the working directory first on sys.path, and a folder holding a
    # rayvl/ (a checkout) would shadow the rayvl this check runs
    return subprocess.run([sys.executable, "-m", "rayvl.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=check.storage)


def rayvl_importable() -> dict[str, str]:
    """PYTHONPATH for a child process to import the rayvl this one runs: the folder holding the package, ahead of
    the caller's PYTHONPATH — a checkout run through benchmarks/gpu_check.py has rayvl on no path of its own; an
    installed rayvl needs nothing (its site-packages put ahead of the standard library could shadow it)."""
    import site

    import rayvl

    root = str(Path(rayvl.__file__).resolve().parent.parent)
    installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root in installed:
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


def cli_failure(proc: subprocess.CompletedProcess, flag: str = "") -> str:
    """Why a CLI call failed, in a line: a missing option named, else its exit status and last error line."""
    if flag and re.search(rf"unrecognized arguments:.*{re.escape(flag)}\b", proc.stderr):
        return f"the CLI has no {flag} option (rayvl {proc.args[3]} ... {flag})"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return f"exit status {proc.returncode}: {lines[-1].strip() if lines else 'no output'}"


def base_run(check: Check) -> str:
    """The zero2 case's run, which the pseudo-label and eval cases use."""
    if "gpu-check-zero2" not in check.runs:
        raise CaseFailed("needs the zero2 case's run at --batch, which did not finish (or was not selected)")
    return str(check.runs["gpu-check-zero2"].uri)


def copied_shards(shards: list[str], images: int, out: Path, shard_size: int = 1000) -> str:
    """At least ``images`` samples written as new img2dataset shards under ``out``: the samples of ``shards`` again
    and again, each copy under new keys (a key's digits prefixed by the copy number), each copied image's bytes
    followed by a few of their own after its end (which decoders leave unread), so that retrieval, which takes
    samples of the same image bytes for one image (rayvl.eval.data), searches every copy. Throughput at scale
    without generating scenes; the comma-separated shard paths."""
    import io
    import tarfile

    samples = []  # (key, {extension: bytes}) of the sources, in order
    for shard in shards:
        members: dict = {}
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    key, _, ext = m.name.partition(".")
                    members.setdefault(key, {})[ext] = tar.extractfile(m).read()
        samples += list(members.items())
    out.mkdir(parents=True, exist_ok=True)
    paths, written = [], 0
    while written < images:
        path = out / f"{len(paths):05d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(min(shard_size, images - written)):
                key, files = samples[(written + i) % len(samples)]
                copy = (written + i) // len(samples)
                new = f"{copy:03d}{key}"
                for ext, data in files.items():
                    if ext in ("jpg", "jpeg", "png", "webp") and copy:
                        data += f"copy{copy}".encode()
                    if ext == "json":
                        meta = json.loads(data)
                        meta["key"] = new
                        data = json.dumps(meta).encode()
                    info = tarfile.TarInfo(f"{new}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        written += min(shard_size, images - written)
        paths.append(str(path))
    return ",".join(paths)


def demo_shards(split: str) -> list[str]:
    """The embedded demo's shards of ``split`` (train or eval)."""
    from rayvl.config import load_config
    from rayvl.data.specs import resolve_shards
    from rayvl.train.datasets import resolve_data

    train, evaluation = resolve_data(load_config(None, []))[:2]
    return resolve_shards(train if split == "train" else evaluation)


def demo_halves() -> tuple[str, str]:
    """(aligned, unaligned): the demo's training shards cut in two halves, as jobs/pseudo_label.py does."""
    from rayvl.config import load_config
    from rayvl.data.specs import resolve_shards
    from rayvl.train.datasets import resolve_data

    shards = resolve_shards(resolve_data(load_config(None, []))[0])
    half = len(shards) // 2
    return ",".join(shards[:half]), ",".join(shards[half:])


def pseudo_label_case(check: Check, case: Case, outcome: Outcome) -> None:
    import faiss

    aligned, unaligned = demo_halves()
    if check.args.eval_images:
        unaligned = copied_shards(demo_shards("train"), check.args.eval_images, check.storage / "unaligned")
    out = check.storage / "pseudo-label"
    # one actor a GPU, decoding on the node's CPUs but one a GPU (left to Ray Data's reads): docs/gpu.md
    cpus = max(1, (os.cpu_count() or 2) // max(1, check.gpus) - 1)
    watched = sync_files()  # the labellers' units, from the third, watched as the training steps (RAYVL_SYNC_DEBUG)
    proc = run_cli(check, ["pseudo-label", base_run(check), "--aligned", aligned, "--unaligned",
                           unaligned, "--out", str(out), "--set", "pseudo_label.gpus_per_actor=1",
                           "--set", f"pseudo_label.actors={check.gpus}", "--set", f"pseudo_label.cpus_per_actor={cpus}",
                           "--set", "pseudo_label.top_t=4"])
    if proc.returncode:
        raise CaseFailed(cli_failure(proc))
    summary = json.loads((out / "summary.json").read_text())
    counts = next(iter(summary["rules"].values()))
    images = sum(v for k, v in counts.items() if isinstance(v, int))
    outcome.samples_per_s = images / max(summary["seconds"], 1e-9)
    gpus = getattr(faiss, "get_num_gpus", lambda: 0)()
    outcome.notes = (f"{images} images labelled ({counts.get('success', 0)} written), index "
                     f"{summary['index']['kind']} over {summary['index']['captions']} captions, faiss GPUs {gpus}")
    outcome.run_dir = str(out)
    if summary["index"]["kind"] == "IndexFlatIP":  # exact: knn.DeviceIndex, whatever faiss build is installed
        outcome.notes += "; the exact pool searched on each labeller's GPU (matmul + top-k, read back once a unit)"
    elif not gpus:  # not a failure: make install GPU=1 takes faiss-cpu where faiss-gpu-cu12 has no kernels (H100)
        outcome.notes += ("; faiss-cpu: the index searched on the CPU (faiss-gpu-cu12 has no kernels for compute "
                          "capability 9.0+; docs/gpu.md)")
    note_syncs(outcome, sync_files_since(watched))  # a unit's, per "step"


GPU_ACTORS = re.compile(r"eval: (\d+) embedding actor\(s\) of ([\d.]+) GPU")
ON_GPU_HERE = re.compile(r"eval: one model in this process on cuda")


def eval_case(check: Check, case: Case, outcome: Outcome) -> None:
    """`rayvl eval --gpus 1` joined to the check's Ray, as on a cluster: a pool of GPU actors fed by Ray Data."""
    evaluate(check, outcome, joined=True, decode="device")


def eval_here_case(check: Check, case: Case, outcome: Outcome) -> None:
    """`rayvl eval --gpus 1` on this machine with no cluster named, shown one GPU (CUDA_VISIBLE_DEVICES, as a user of
    a machine with several runs one model): one model in the command's process, no Ray."""
    evaluate(check, outcome, joined=False)


def eval_cpu_decode_case(check: Check, case: Case, outcome: Outcome) -> None:
    """`rayvl eval --gpus 1 --decode cpu` joined to the check's Ray: Ray Data's read tasks decode the JPEGs; with the
    eval case's results beside it (its GPU decoded them), the same counts, each image's embedding close to its
    (median and lowest cosine) and the retrieval metrics within a point (the tolerance docs/concepts.md states)."""
    evaluate(check, outcome, joined=True, decode="cpu")
    gpu, cpu = check.storage / "eval", check.storage / "eval-decode-cpu"
    if not (gpu / "eval.json").exists():
        outcome.notes += "; not compared: no eval case's results (run --cases eval,eval_cpu_decode)"
        return
    agreed, failure = decode_agreement(gpu, cpu)
    outcome.notes += "; against the eval case's (its GPU decoded): " + agreed
    if failure:
        raise CaseFailed(failure)


def decode_agreement(gpu: Path, cpu: Path) -> tuple[str, str]:
    """(what agrees, '' or why it fails) between two `rayvl eval` outputs of the same images, decoded by the GPU and
    by the read tasks."""
    import numpy as np

    theirs, ours = (json.loads((d / "eval.json").read_text()) for d in (gpu, cpu))
    if theirs.get("data") != ours.get("data"):
        return "counts differ", f"counts differ: {theirs.get('data')} (GPU) against {ours.get('data')} (read tasks)"
    keys = [json.loads((d / "keys.json").read_text()) for d in (gpu, cpu)]
    if keys[0] != keys[1]:
        return "rows differ", "the two evaluations kept different rows"
    a, b = (np.load(d / "image_embeddings.npy") for d in (gpu, cpu))
    cosine = (a * b).sum(1)
    r1, r2 = theirs.get("retrieval", {}), ours.get("retrieval", {})
    apart = max((abs(r2[k] - v) for k, v in r1.items() if k in r2 and isinstance(v, float)), default=0.0)
    said = (f"same counts and rows, image embeddings' cosine median {np.median(cosine):.4f}, lowest "
            f"{cosine.min():.4f}, retrieval at most {apart:.2f} points apart")
    if apart > DECODE_TOLERANCE_POINTS or np.median(cosine) < DECODE_MEDIAN_COSINE:
        return said, (f"decoded by the GPU: {said} (tolerance {DECODE_TOLERANCE_POINTS:g} points, median cosine "
                      f"{DECODE_MEDIAN_COSINE})")
    return said, ""


DECODE_TOLERANCE_POINTS = 1.0  # retrieval R@k, in points, between JPEGs decoded by the GPU and by Pillow
DECODE_MEDIAN_COSINE = 0.99  # the images' embeddings, GPU-decoded against Pillow-decoded (the CPU test's bound)
DECODED_BY = re.compile(r"JPEGs were decoded by (.+)")


def evaluate(check: Check, outcome: Outcome, joined: bool, decode: str = "") -> None:
    out = check.storage / (("eval" if joined else "eval-here") + ("-decode-cpu" if decode == "cpu" else ""))
    scale = []
    if check.args.eval_images:  # retrieval over that many held-out images: the embedding's rate once running
        data = copied_shards(demo_shards("eval"), check.args.eval_images, check.storage / "eval-images")
        scale = ["--data", data, "--kind", "shards", "--tasks", "retrieval"]
    scale += ["--decode", decode] if decode else []
    proc = run_cli(check, ["eval", base_run(check), "--gpus", "1", "--out", str(out), *scale], joined=joined)
    if proc.returncode:
        raise CaseFailed(cli_failure(proc, "--gpus"))
    on_gpu = GPU_ACTORS.search(proc.stderr) if joined else ON_GPU_HERE.search(proc.stderr)
    results = json.loads((out / "eval.json").read_text())
    speed = results["embedding"]  # the rate once the model was ready (loaded and warmed up), start-up apart
    outcome.samples_per_s = speed["images_per_s_once_ready"]
    top1 = results.get("zeroshot", {}).get("zeroshot_top1")
    model = "the first actor" if joined else "the model"
    outcome.notes = (f"images/s once {model} was ready, of {speed['images']} images (start-up {speed['startup_s']:.1f} "
                     f"s); " +
                     (f"{on_gpu.group(1) if on_gpu else 0} GPU actor(s)" if joined else
                      f"{'on the GPU' if on_gpu else 'not on a GPU'}, no Ray") +
                     (f"; zero-shot top-1 {round(top1, 1)}% (zero2's {check.steps} steps from random init)"
                      if top1 is not None else ""))
    decoded_by = DECODED_BY.search(proc.stderr)
    outcome.notes += f"; JPEGs decoded by {decoded_by.group(1)}" if decoded_by else "; JPEGs decoded by the read tasks"
    outcome.run_dir = str(out)
    if not on_gpu:
        raise CaseFailed("evaluated, but no embedding actor reported a GPU" if joined else
                         "evaluated, but the model did not run on the GPU")


CASES = [
    Case("bare", "hand-written loop: zero2's model and loss, bf16 autocast, fused AdamW, batch on the GPU",
         bare_case, per_batch=True),
    Case("zero0", "stage 0: bf16 autocast over fp32 weights, no ZeRO hooks (zero_stage=auto's pick on one GPU)",
         train_case, "laion_adapt", lambda c: ["train.zero_stage=0", NO_EVAL], per_batch=True),
    Case("zero0_decode", "stage 0 with data.decode=device: each worker's GPU decodes its JPEGs (nvJPEG)", train_case,
         "laion_adapt", lambda c: ["train.zero_stage=0", NO_EVAL, "data.decode=device"]),
    Case("zero1", "ZeRO-1, bf16", train_case, "laion_adapt", lambda c: ["train.zero_stage=1", NO_EVAL],
         per_batch=True),
    Case("zero2", "ZeRO-2, bf16", train_case, "laion_adapt", lambda c: ["train.zero_stage=2", NO_EVAL],
         per_batch=True),
    Case("zero3", "ZeRO-3, bf16", train_case, "laion_adapt", lambda c: ["train.zero_stage=3", NO_EVAL],
         per_batch=True),
    # a buffer of the size a smaller one grows to (10-12 micro-batches with 8 objects: a micro-batch of each and the
    # rows in flight) in the object steps after the first refresh, reading past it while they wait
    # (benchmarks/tonics_batches.py --buffers): a one-off a run of this check's length would count in its steady rate
    Case("tonics", "TOnICS curriculum (configs/tonics.yaml), stage 0", train_case, "tonics", lambda c: [
        "train.zero_stage=0", f"tonics.refresh_every={max(1, c.steps // 2)}",
        f"tonics.buffer_rows={12 * c.args.batch}", f"tonics.max_wait_rows={8 * c.args.batch}"]),
    Case("memory_bank", "EMA memory bank (K 8192), stage 0", train_case, "laion_adapt",
         lambda c: ["train.zero_stage=0", "memory_bank.size=8192", NO_EVAL]),
    # the most common real use: a whole CLIP fine-tuned (configs/clip_finetune.yaml), against a bare loop of its own
    Case("bare_clip", "hand-written loop: clip's model (a whole ViT-B/32 CLIP, 77 tokens) and loss, as bare",
         bare_case, per_batch=True, model_of="clip"),
    Case("clip", "a whole ViT-B/32 CLIP fine-tuned (configs/clip_finetune.yaml: every weight trains), auto's layout",
         train_case, CLIP_RECIPE, lambda c: [NO_EVAL], per_batch=True, bare="bare_clip"),
    Case("pseudo_label", "rayvl pseudo-label, GPU actors searching the caption pool on their GPU", pseudo_label_case),
    Case("eval", "rayvl eval --gpus 1 --decode device of zero2's run, joined to a Ray: GPU actors decoding the JPEGs",
         eval_case),
    Case("eval_cpu_decode", "rayvl eval --gpus 1 --decode cpu, joined: the read tasks decode the JPEGs",
         eval_cpu_decode_case),
    Case("eval_here", "rayvl eval --gpus 1 of zero2's run on this machine: one model in its process, no Ray",
         eval_here_case),
    Case("compile", "zero2 through torch.compile (inductor)", train_case, "laion_adapt",
         lambda c: ["train.zero_stage=2", NO_EVAL, "train.compile=inductor"]),
    Case("kill_resume", "a worker killed mid-run; resume from its checkpoint", kill_resume_case, "laion_adapt",
         kill_settings),
]


CASES_BY_NAME = {c.name: c for c in CASES}


# ----------------------------------------------------------------------------- running and reporting

def run_case(check: Check, case: Case) -> Outcome:
    """One case, whatever happens: an exception fails it (its text in the table) and the check goes on."""
    from rayvl.train.progress import log

    outcome = Outcome(case.name, case.what, batch=check.micro_batch, cpus=os.cpu_count() or 0, gpus=check.gpus)
    log.info(f"gpu_check: case {case.name}: {case.what}")
    started = time.perf_counter()
    try:
        case.run(check, case, outcome)
        outcome.passed = True
    except Exception as e:  # noqa: BLE001 — a failed case is a row of the table, not the end of the check
        if not isinstance(e, CaseFailed):
            traceback.print_exc()
        text = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(e).__name__}: {e}")  # Ray colours its task names
        outcome.error = " ".join(text.split())[:400]
    outcome.seconds = time.perf_counter() - started
    log.info(f"gpu_check: case {case.name}: {'pass' if outcome.passed else 'FAIL: ' + outcome.error}")
    return outcome


# cases whose rate is images embedded or labelled; the bare loops
NOT_TRAINING = ("eval", "eval_cpu_decode", "eval_here", "pseudo_label")
BARE = ("bare", "bare_clip")


def compare_to_bare(outcomes: list[Outcome]) -> None:
    """Each training case's samples/s over the bare loop's, zero0's and zero2's at the same micro-batch, and its
    MFU over zero0's."""
    def rates(name: str) -> dict:
        return {o.batch: o.samples_per_s for o in outcomes if o.case == name and o.passed and o.samples_per_s}

    training = [o for o in outcomes if o.case not in (*BARE, *NOT_TRAINING)]
    for o in training:  # over the bare loop of its own model
        rate = rates(CASES_BY_NAME[o.case].bare)
        if o.samples_per_s and o.batch in rate:
            o.vs_bare = o.samples_per_s / rate[o.batch]
    for over in ("zero0", "zero2"):
        rate = rates(over)
        for o in training:
            if o.case != over and o.samples_per_s and o.batch in rate and CASES_BY_NAME[o.case].bare == "bare":
                setattr(o, f"vs_{over}", o.samples_per_s / rate[o.batch])
    mfu = {o.batch: o.mfu for o in outcomes if o.case == "zero0" and o.passed and o.mfu}
    for o in training:
        if o.case != "zero0" and o.mfu and o.batch in mfu and CASES_BY_NAME[o.case].bare == "bare":
            o.mfu_vs_zero0 = o.mfu / mfu[o.batch]


def machine(gpus: int) -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        driver = ""
    return {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "driver": driver or "unknown", "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0))}


def report(check: Check, outcomes: list[Outcome], argv: list[str], not_run: list[str] = ()) -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([PROG, *argv]),
            "machine": machine(check.gpus), "goals": GOALS,
            "settings": {"vision": VISION, "image_size": IMAGE_SIZE, "precision": PRECISION, "steps": check.steps,
                         "micro_batch_size": check.args.batch, "workers": check.gpus, "storage": str(check.storage),
                         "set": list(check.args.set)},
            "cases": [asdict(o) for o in outcomes], "not_run": list(not_run),
            "passed": all(o.passed for o in outcomes)}


def _pct(value: float | None, goal: float, better: str) -> str:
    """``34.1% (goal ≥ 30%: met)``: a measurement beside its goal."""
    if value is None:
        return "–"
    met = value >= goal if better == "≥" else value < goal
    return f"{100 * value:.1f}% (goal {better} {100 * goal:g}%: {'met' if met else 'missed'})"


def _seconds(value: float | None) -> str:
    """``23.4 (goal ≤ 20: missed)``: the time to the first step beside its goal."""
    if value is None:
        return "–"
    goal = GOALS["first_step_s"]
    return f"{value:.1f} (goal ≤ {goal:g}: {'met' if value <= goal else 'missed'})"


def _ratio(o: dict) -> str:
    """``0.12 (0.28× zero2; goal ≥ 0.7× zero2: missed)``: the ratio to the bare loop, to zero2, and the goals of
    the case at its batch."""
    notes = [f"{o['vs_zero2']:.2f}× zero2"] if o.get("vs_zero2") is not None else []
    for goal in GOALS["ratios"]:
        name, of_mfu = goal["over"], goal.get("of") == "mfu"
        value, rate = o.get(f"mfu_vs_{name}" if of_mfu else f"vs_{name}"), o.get(f"vs_{name}")
        if goal["case"] != o["case"] or (goal["batches"] and o.get("batch") not in goal["batches"]):
            continue
        if name not in ("bare", "zero2") and rate is not None:  # zero2's ratio is noted already
            notes.append(f"{rate:.2f}× {name}")  # beside an MFU goal too, and where no MFU was measured
        if value is not None:
            over = "" if name == "bare" else f"× {name}" + ("'s MFU" if of_mfu else "")
            if of_mfu:
                notes.append(f"MFU {value:.2f}× {name}'s")
            notes.append(f"goal ≥ {goal['goal']:g}{over}: {'met' if value >= goal['goal'] else 'missed'}")
    if o.get("vs_bare") is None and not notes:
        return "–"
    head = "–" if o.get("vs_bare") is None else f"{o['vs_bare']:.2f}"
    return head + (f" ({'; '.join(notes)})" if notes else "")


def _syncs(value: float | None) -> str:
    """``4.00 (goal 0: missed)``: the synchronisations caught a watched step."""
    if value is None:
        return "–"
    goal = GOALS["syncs_per_step"]
    return f"{'0' if value == 0 else f'{value:.2f}'} (goal {goal:g}: {'met' if value <= goal else 'missed'})"


HEADER = ("case", "batch", "result", "samples/s", "× bare", "MFU", "data wait", "first step s", "syncs/step", "CPUs",
          "GPUs", "time s", "notes")


def rows(outcomes: list[dict]) -> list[tuple[str, ...]]:
    """The table's cells, one tuple per case."""
    out = []
    for o in outcomes:
        sps = f"{o['samples_per_s']:.1f}" if o["samples_per_s"] is not None else "–"
        mfu = _pct(o["mfu"], GOALS["mfu"], "≥")
        if o["mfu"] is None and o["data_wait_share"] is not None:  # a training case on a GPU of unknown peak
            mfu = "– (no peak FLOP/s for this GPU: set RAYVL_PEAK_TFLOPS)"
        notes = "; ".join(x for x in (o["error"], o["notes"]) if x)
        out.append((o["case"], str(o.get("batch") or ""), "pass" if o["passed"] else "FAIL", sps, _ratio(o), mfu,
                    _pct(o["data_wait_share"], GOALS["data_wait_share"], "<"), _seconds(o.get("first_step_s")),
                    _syncs(o.get("syncs_per_step")), str(o["cpus"]), str(o["gpus"]), f"{o['seconds']:.0f}", notes))
    return out


def format_text(rep: dict) -> str:
    m = rep["machine"]
    table = [HEADER, *rows(rep["cases"])]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in table]
    head = (f"== gpu_check {rep['date']}: {m['gpus']} × {m['gpu']} ({m['gpu_memory_gib']} GiB), driver {m['driver']}, "
            f"torch {m['torch']}, CUDA {m['cuda']}, {m['cpus']} CPUs ==\n{rep['command']}")
    verdict = "all cases passed" if rep["passed"] else \
        f"FAILED: {', '.join(c['case'] for c in rep['cases'] if not c['passed'])}"
    if rep.get("not_run"):
        verdict += f"; not run (--deadline-s): {', '.join(rep['not_run'])}"
    return "\n".join([head, *lines, verdict])


def format_markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"# gpu_check, {rep['date']}", "",
             f"{m['gpus']} × {m['gpu']} ({m['gpu_memory_gib']} GiB), driver {m['driver']}, torch {m['torch']}, CUDA "
             f"{m['cuda']}, cuDNN {m['cudnn']}, Python {m['python']}, {m['cpus']} CPUs", "",
             f"`{rep['command']}` — {rep['settings']['steps']} steps of {rep['settings']['micro_batch_size']} "
             f"per GPU, {VISION} at {IMAGE_SIZE} px, {PRECISION}", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows(rep["cases"])]
    return "\n".join(lines) + "\n"


def write(rep: dict, out: str) -> list[Path]:
    """``--out PATH``: PATH.json and PATH.md (a .json or .md suffix on PATH is replaced)."""
    base = Path(out).expanduser()
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.with_name(base.name + ".json"), base.with_name(base.name + ".md")]
    paths[0].write_text(json.dumps(rep, indent=2) + "\n")
    paths[1].write_text(format_markdown(rep))
    return paths


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description="rayvl on this machine's GPUs: every case pass/fail, "
                                                       "samples/s, MFU, data wait (issue 35)")
    p.add_argument("--quick", action="store_true", help="fewer steps a case (30 instead of 80)")
    p.add_argument("--steps", type=int, default=0, help="steps a training case (overrides --quick)")
    p.add_argument("--batch", type=int, default=256, help="micro-batch per GPU")
    p.add_argument("--batches", default="", metavar="B,B,max",
                   help="run bare, zero0-zero3, bare_clip and clip at each micro-batch; max = the largest power of "
                        "two that fits (default: --batch only)")
    p.add_argument("--profile", default="", metavar="CASE",
                   help="write a torch.profiler trace of a few steady steps of this case (bare or a training case) "
                        "to <--out>-profile/")
    p.add_argument("--profile-startup", default="", metavar="CASE",
                   help="profile (cProfile) rank 0's start of this training case until its first step ends, by "
                        "function, to <--out>-profile/startup-rank0.txt")
    p.add_argument("--eval-images", type=int, default=20000,
                   help="images the eval and pseudo-label cases process, the demo's copied under new keys "
                        "(0: the demo's own)")
    p.add_argument("--cases", default=",".join(c.name for c in CASES if c.name != "compile"),
                   help="comma list of cases to run (compile only when named)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every training case")
    p.add_argument("--clip", default="", metavar="FILE",
                   help="the whole CLIP the clip cases fine-tune (model.init_from_clip; default: open_clip's "
                        "ViT-B-32 architecture with a random init, written into the check's storage)")
    p.add_argument("--storage", default="", help="where the runs go (default: a new temporary folder)")
    p.add_argument("--out", default="", help="also write the report to PATH.json and PATH.md (after every case)")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="start no case after this many seconds (a lease's time): the cases left are listed as not "
                        "run, the table is printed (0: no deadline)")
    p.add_argument("--verbose", action="store_true", help="show Ray's and the workers' own output")
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - {c.name for c in CASES}
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)} (known: {', '.join(c.name for c in CASES)})")
    if args.profile and args.profile not in {c.name for c in CASES if c.recipe or c.name in BARE}:
        p.error(f"--profile: {args.profile!r} is not a bare loop or a training case")
    if args.profile_startup and args.profile_startup not in {c.name for c in CASES if c.recipe} - {"kill_resume"}:
        p.error(f"--profile-startup: {args.profile_startup!r} is not a training case (kill_resume restarts)")
    if any(b != "max" and not b.isdigit() for b in args.batches.split(",") if b):
        p.error(f"--batches: {args.batches!r} is not a comma list of micro-batches and 'max'")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    problem = no_gpu_message()
    if problem:  # before Ray or anything else starts
        print(problem, file=sys.stderr)
        return 2
    import torch

    from rayvl.session import setup_logging

    setup_logging(args.verbose)
    root = Path(args.storage).expanduser() if args.storage else Path(tempfile.mkdtemp(prefix="rayvl-gpu-check-"))
    check = Check(args, root / time.strftime("%Y%m%d-%H%M%S"), torch.cuda.device_count(),
                  torch.cuda.get_device_name(0))
    check.storage.mkdir(parents=True, exist_ok=True)
    watch_syncs(check)  # before a training case starts Ray
    selected = args.cases.split(",")
    sizes = batches(check) if any(c.per_batch for c in CASES if c.name in selected) else [args.batch]
    outcomes, not_run, started = [], [], time.perf_counter()
    for case in (c for c in CASES if c.name in selected):
        for batch in sizes if case.per_batch else [args.batch]:
            if args.deadline_s and time.perf_counter() - started > args.deadline_s:
                not_run.append(f"{case.name}@{batch}")
                continue
            check.batch = batch
            outcomes.append(run_case(check, case))
            check.batch = 0
            compare_to_bare(outcomes)
            if args.out:  # a lease that ends mid-check keeps what ran
                write(report(check, outcomes, argv, not_run), args.out)
            print("gpu_check row: " + " | ".join(rows([asdict(outcomes[-1])])[0]), flush=True)
    check.batch = 0
    compare_to_bare(outcomes)
    rep = report(check, outcomes, argv, not_run)
    print("\n" + format_text(rep))
    if args.out:
        print("report: " + ", ".join(str(p) for p in write(rep, args.out)))
    print(f"runs: {check.storage}")
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
