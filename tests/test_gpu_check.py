"""MFU's parts (rayvl.train.flops: FLOPs counted against hand counts, the peak table), the progress line's MFU, the
sync watch (rayvl.train.profiling.SyncWatch, with torch's CUDA calls played by fakes), and what of the GPU check
(rayvl.checks.gpu, `rayvl check gpu`) runs without a GPU: its configs, its measurements, its report, its refusal on a
CPU machine — as the command, as a module and through benchmarks/gpu_check.py, the path the GPU workflow runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rayvl.train import flops
from rayvl.train.flops import PEAK_ENV, mfu, model_flops_per_sample, peak_flops

REPO = Path(__file__).resolve().parent.parent


class Toy(nn.Module):
    """A dual encoder small enough to count by hand: image (uint8, 3×8×8) → conv 3→6 → BatchNorm → depthwise conv
    6→6 → mean → linear 6→8; text (T tokens) → embedding 10×6 → qkv linear 6→18 → one-head attention → mean →
    linear 6→8; and a logit scale."""

    def __init__(self, text: str = "trained", checkpointed: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6)
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.image_out = nn.Linear(6, 8)
        self.embed, self.qkv, self.text_out = nn.Embedding(10, 6), nn.Linear(6, 18), nn.Linear(6, 8)
        self.scale = nn.Parameter(torch.ones(1))
        if text != "trained":  # "frozen_layers": the embedding trains, the layers above it do not; "frozen": none
            self.qkv.requires_grad_(False)
            self.text_out.requires_grad_(False)
            self.embed.requires_grad_(text == "frozen_layers")
        self.grad_checkpointing = checkpointed  # timm's flag: activations recomputed in the backward

    def image(self, x):
        return self.depthwise(self.norm(self.conv(x)))

    def forward(self, image, input_ids, attention_mask):
        x = image.float()
        x = checkpoint(self.image, x) if self.grad_checkpointing else self.image(x)
        q, k, v = self.qkv(self.embed(input_ids)).unsqueeze(1).chunk(3, dim=-1)
        text = F.scaled_dot_product_attention(q, k, v).squeeze(1).mean(1)
        return self.image_out(x.mean((2, 3))), self.text_out(text), self.scale


def checkpoint(fn, x):
    from torch.utils.checkpoint import checkpoint as ckpt

    return ckpt(fn, x, use_reentrant=False)


# by hand, per sample (2 FLOPs per multiply-add; 8×8 image, T = 5 tokens, d = 6)
CONV = 2 * 64 * 9 * 6 * 3  # 3→6, 3×3, 64 output positions
DEPTHWISE = 2 * 64 * 9 * 6 * 1  # one input channel per output channel
IMAGE_OUT = 2 * 6 * 8
QKV, ATTENTION, TEXT_OUT = 2 * 5 * 6 * 18, 2 * (2 * 5 * 5 * 6), 2 * 6 * 8  # attention: q·kᵀ and weights·v
FORWARD = CONV + DEPTHWISE + IMAGE_OUT + QKV + ATTENTION + TEXT_OUT
# backward: the first conv's weight gradient only (uint8 images need none); input + weight gradients elsewhere
IMAGE_BACKWARD = CONV + 2 * DEPTHWISE + 2 * IMAGE_OUT
TEXT_BACKWARD = {"trained": 2 * QKV + 2 * ATTENTION + 2 * TEXT_OUT,
                 "frozen_layers": QKV + 2 * ATTENTION + TEXT_OUT,  # input gradients only, down to the embedding
                 "frozen": 0}


@pytest.mark.parametrize("text", ["trained", "frozen_layers", "frozen"])
def test_flops_of_a_small_model_match_a_hand_count(text):
    """3× the forward for trained layers, 2× for frozen layers that gradients pass through, 1× for a frozen tower
    nothing before it trains; a depthwise convolution's weight gradient costs its forward (torch's own formula
    counts it × the channels)."""
    count = model_flops_per_sample(Toy(text), image_size=8, text_tokens=5)
    assert count == FORWARD + IMAGE_BACKWARD + TEXT_BACKWARD[text]
    # the memory bank's EMA key encoders: one more forward of both towers
    assert model_flops_per_sample(Toy(text), 8, 5, key_encoders=True) == count + FORWARD


def test_counting_leaves_the_model_as_it_was_and_ignores_rematerialisation():
    torch.manual_seed(0)
    model = Toy(checkpointed=True).train()
    model.norm.running_mean.fill_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    # activation checkpointing recomputes the forward in the backward: hardware FLOPs, not model FLOPs (PaLM App. B)
    assert model_flops_per_sample(model, 8, 5) == FORWARD + IMAGE_BACKWARD + TEXT_BACKWARD["trained"]
    assert model.training and model.norm.training and model.grad_checkpointing
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_the_demo_model_counts_a_frozen_text_tower_less():
    """rayvl's dual encoder at the demo's 64 px and 24 tokens: the frozen LM is one forward (no graph), appended
    alignment layers train (3×), a finetuned LM costs 3× its forward."""
    from rayvl.config import load_config
    from rayvl.models.dual_encoder import build_model

    counts = {}
    for strategy in ("frozen", "frozen_alignment", "finetune"):
        cfg = load_config(None, [f"model.text_strategy={strategy}"])
        counts[strategy] = model_flops_per_sample(build_model(cfg.model, 0), 64, 24)
    assert 0 < counts["frozen"] < counts["frozen_alignment"] < counts["finetune"]
    # the frozen MiniLM-L6 (6 layers, d 384, FFN 1536, 24 tokens): ≥ 2 × its linear layers' products, run once
    lm = 2 * 24 * 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    assert counts["finetune"] - counts["frozen"] == pytest.approx(2 * lm, rel=0.05)


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7), ("NVIDIA H200", "bf16", 989.4), ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100 80GB PCIe", "fp32", 19.5), ("NVIDIA A10G", "bf16", 125.0),
    ("NVIDIA L4", "bf16", 121.0), ("NVIDIA L40S", "bf16", 362.0), ("NVIDIA L40", "bf16", 181.0),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0), ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla V100S-PCIE-32GB", "fp16", 130.0), ("Tesla T4", "fp32", 8.1),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # Volta has no bf16
    ("NVIDIA GeForce RTX 4090", "bf16", None), ("NVIDIA RTX A1000", "bf16", None),  # not an A10
])
def test_peak_flops_from_the_device_name(monkeypatch, name, precision, tflops):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    peak = peak_flops(name, precision)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_peak_flops_override_and_errors(monkeypatch):
    monkeypatch.setenv(PEAK_ENV, "400")
    assert peak_flops("NVIDIA GeForce RTX 4090", "bf16") == pytest.approx(400e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(400e12)
    for bad in ("fast", "0", "-3"):
        monkeypatch.setenv(PEAK_ENV, bad)
        with pytest.raises(ValueError, match=PEAK_ENV):
            peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    monkeypatch.delenv(PEAK_ENV)
    with pytest.raises(ValueError, match="precision"):
        peak_flops("NVIDIA H100 80GB HBM3", "int8")


def test_mfu_is_model_flops_over_the_peak_of_every_device():
    # 8 GPUs at 1e15 FLOP/s, 4e4 samples/s of 6e10 FLOPs: 2.4e15 of 8e15
    assert mfu(4e4, 6e10, 1e15, 8) == pytest.approx(0.3)


def test_the_progress_line_shows_mfu_after_samples_per_second():
    from rayvl.train.progress import progress_line

    row = {"step": 150, "time": 252.0, "loss": 2.314, "lr": 6.2e-4, "logit_scale": 15.3, "samples_per_s": 3810.4,
           "data_wait_share": 0.003, "grad_norm": 1.82, "samples_seen": 10, "samples_kept": 10}
    line = progress_line({**row, "mfu": 0.3412}, 200, 0.0, 1.68, 2)
    assert "3810.4 samples/s (1905.2/worker) | MFU 34.1% | data wait 0.3% |" in line
    plain = progress_line(row, 200, 0.0, 1.68, 2)
    assert "MFU" not in plain and "3810.4 samples/s (1905.2/worker) | data wait 0.3% |" in plain
    assert "MFU" not in progress_line({**row, "mfu": None}, 200, 0.0, 1.68, 2)


# ----------------------------------------------------------------------------- rayvl check gpu

def _gpu_check():
    from rayvl.checks import gpu

    return gpu


def _no_gpu_env(tmp_path) -> dict:
    # no GPU on any machine; a Ray started by mistake would make its session folders under RAY_TMPDIR
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RAY_TMPDIR": str(tmp_path / "ray"),
            "PYTHONPATH": str(REPO)}


def _no_gpu_said(run: subprocess.CompletedProcess, tmp_path) -> None:
    """Exit status 2, the one line saying why, no traceback, no Ray started."""
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"gpu_check: no CUDA GPU visible to torch (torch {torch.__version__}, built for CUDA " \
           f"{torch.version.cuda or 'none'}) — run it on a GPU machine; see docs/gpu.md" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "ray").exists()


@pytest.mark.slow
def test_gpu_check_on_a_machine_without_gpu_says_so_and_starts_nothing(tmp_path):
    """Through benchmarks/gpu_check.py, the path the GPU workflow runs from a checkout (from another folder: the
    check needs no checkout of its own); then the module run as a script, watched from inside: Ray was never
    imported."""
    started = time.time()
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--quick"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=_no_gpu_env(tmp_path))
    _no_gpu_said(run, tmp_path)
    assert time.time() - started < 60
    code = ("import runpy, sys\nsys.argv = ['gpu']\ntry:\n"
            "    runpy.run_module('rayvl.checks.gpu', run_name='__main__', alter_sys=True)\n"
            "finally:\n    print('ray imported:', 'ray' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=_no_gpu_env(tmp_path))
    assert run.returncode == 2 and "ray imported: False" in run.stdout, run.stdout + run.stderr[-2000:]


@pytest.mark.slow
def test_rayvl_check_gpu_on_a_machine_without_gpu_says_so_and_check_census_shows_its_options(tmp_path):
    """The commands: `rayvl check gpu` exits 2 with the check's own line before anything starts (the CLI imports Ray
    for its other commands, but starts none); `rayvl check census --help` is the census's own help."""
    run = subprocess.run([sys.executable, "-m", "rayvl.cli", "check", "gpu", "--quick"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=_no_gpu_env(tmp_path))
    _no_gpu_said(run, tmp_path)
    run = subprocess.run([sys.executable, "-m", "rayvl.cli", "check", "census", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=_no_gpu_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: rayvl check census") and "--batch-path" in run.stdout


def _check(gc, tmp_path, **args):
    options = Namespace(**{**dict(quick=False, steps=0, batch=256, batches="", profile="", profile_startup="",
                                  eval_images=0, out="", set=[], verbose=False, deadline_s=0, clip=""), **args})
    return gc.Check(options, tmp_path, gpus=1, device_name="NVIDIA H100 80GB HBM3")


def test_every_training_case_of_the_gpu_check_has_a_valid_config(tmp_path):
    """The configs are checked here, on CPU, where the check itself never runs."""
    from test_whole_clip import open_clip_model

    gc = _gpu_check()
    small = tmp_path / "small-clip.pt"  # --clip FILE: the clip cases' whole CLIP
    torch.save(open_clip_model().state_dict(), small)
    check = _check(gc, tmp_path, quick=True, clip=str(small))
    trained = [c for c in gc.CASES if c.recipe]
    assert [c.name for c in trained] == ["zero0", "zero0_decode", "zero1", "zero2", "zero3", "tonics", "memory_bank",
                                         "clip", "compile", "kill_resume"]
    for case in trained:
        cfg = gc.train_config(check, case)
        t = cfg.train
        vision = "clip" if case.name == "clip" else "vit_base_patch32_224"  # a whole CLIP's own image tower
        assert (t.use_gpu, t.num_workers, t.precision, cfg.data.image_size, cfg.model.vision) == \
            (True, 1, "bf16", 224, vision)
        assert t.max_steps == 30 and t.run_name == f"gpu-check-{case.name}"
    zero = {c.name: gc.train_config(check, c).train.zero_stage for c in trained}
    assert zero == {"zero0": 0, "zero0_decode": 0, "zero1": 1, "zero2": 2, "zero3": 3, "tonics": 0, "memory_bank": 0,
                    "clip": "auto", "compile": 2, "kill_resume": 2}
    clip = gc.train_config(check, gc.CASES_BY_NAME["clip"])
    assert (clip.model.init_from_clip, clip.model.text_strategy, clip.data.max_text_tokens) == (
        str(small), "finetune", 77)
    # bare_clip's loop builds clip's config: its samples/s is what clip's are divided by
    assert (gc.CASES_BY_NAME["bare_clip"].model_of, gc.CASES_BY_NAME["clip"].bare) == ("clip", "bare_clip")
    assert gc.train_config(check, gc.CASES_BY_NAME["zero0_decode"]).data.decode == "device"
    # each layout at every --batches entry, beside the bare loop; by default every case but compile
    assert [c.name for c in gc.CASES if c.per_batch] == ["bare", "zero0", "zero1", "zero2", "zero3", "bare_clip",
                                                        "clip"]
    assert gc.parse_args([]).cases.split(",") == [c.name for c in gc.CASES if c.name != "compile"]
    assert gc.train_config(check, gc.CASES_BY_NAME["compile"]).train.compile == "inductor"
    assert gc.train_config(check, gc.CASES_BY_NAME["tonics"]).tonics.enabled
    assert gc.train_config(check, gc.CASES_BY_NAME["memory_bank"]).memory_bank.size == 8192
    # the kill falls between two checkpoints, after the first: the run must resume from that one
    killed, resumed, rank = gc.kill_point(check)
    assert gc.train_config(check, trained[-1]).train.checkpoint_every == resumed < killed < 2 * resumed
    assert rank == 0
    assert gc.train_config(_check(gc, tmp_path, set=["train.micro_batch_size=64"]), trained[0]).train \
        .micro_batch_size == 64
    assert flops.table_precision(gc.train_config(check, trained[0]).train, on_gpu=True) == "bf16"


def test_steady_state_leaves_out_the_first_window_and_a_restarts_first(tmp_path):
    gc = _gpu_check()
    rows = [{"step": 10, "first_step": 1, "samples_per_s": 100.0, "data_wait_share": 0.5},  # start-up
            {"step": 20, "first_step": 11, "samples_per_s": 1000.0, "data_wait_share": 0.0, "mfu": 0.3},
            {"step": 30, "first_step": 21, "samples_per_s": 500.0, "data_wait_share": 0.1, "mfu": 0.15},
            {"step": 40, "first_step": 21, "samples_per_s": 50.0, "data_wait_share": 0.9, "resumed_from": 20}]
    steady = gc.steady_state(rows[:3], per_step=100)
    # 1000 samples in 1 s, 1000 in 2 s (0.2 s of them waiting)
    assert steady == pytest.approx({"samples_per_s": 2000 / 3, "data_wait_share": 0.2 / 3, "windows": 2,
                                    "mfu": (0.3 * 1 + 0.15 * 2) / 3})
    assert gc.steady_state(rows, 100)["windows"] == 2
    # a window holding a profiled step is left out (the profiler slows it)
    assert gc.steady_state(rows[:3], 100, skip=range(25, 27))["samples_per_s"] == pytest.approx(1000.0)
    without = gc.steady_state([{k: v for k, v in r.items() if k != "mfu"} for r in rows[:3]], 100)
    assert without["mfu"] is None
    # the driver's clock from the first report to the last before the final one: 2,000 samples in 4 s
    clocked = [{**r, "elapsed_s": e} for r, e in zip(rows[:3], (20.0, 22.0, 24.0))] + [{"step": 40, "elapsed_s": 30.0}]
    assert gc.driver_clock(clocked, 100) == pytest.approx(500.0)
    assert gc.driver_clock(clocked[:2], 100) is None  # too few reports
    assert gc.driver_clock(clocked[:3] + [{**rows[3], "elapsed_s": 30.0}], 100) is None  # a restart
    evaluated = [clocked[0], {**clocked[1], "evaluation_s": 1.0}, *clocked[2:]]  # left out, as the windows do
    assert gc.driver_clock(evaluated, 100) == pytest.approx(2000 / 3)
    # the first report's start-up phases: the time to the first step beside its goal, the phases in the notes
    check = _check(gc, tmp_path)
    outcome = gc.Outcome("zero2", "")
    started = {"startup_ray_s": 3.0, "startup_workers_s": 9.0, "startup_first_step_s": 12.0,
               "startup_first_batch_wait_s": 1.5, "startup_total_s": 24.0}
    gc.measure(check, gc.train_config(check, gc.CASES_BY_NAME["zero2"]), [{**rows[0], **started}, *rows[1:3]], outcome)
    assert outcome.first_step_s == 24.0 and outcome.mfu == pytest.approx((0.3 * 1 + 0.15 * 2) / 3)
    assert outcome.notes == ("first step after 24.0 s: ray 3.0, workers 9.0, first step 12.0 (of which waiting for "
                             "the first batch 1.5)")


def test_a_missing_cli_option_is_a_failed_case_named_not_a_crash():
    gc = _gpu_check()
    proc = subprocess.CompletedProcess(
        [sys.executable, "-m", "rayvl.cli", "eval", "x", "--gpus", "1"], 2, "",
        "usage: rayvl [-h] ...\nrayvl: error: unrecognized arguments: --gpus 1\n")
    assert gc.cli_failure(proc, "--gpus") == "the CLI has no --gpus option (rayvl eval ... --gpus)"
    other = subprocess.CompletedProcess(proc.args, 1, "", "loading\nrayvl: error: CUDA out of memory\n")
    assert gc.cli_failure(other, "--gpus") == "exit status 1: rayvl: error: CUDA out of memory"


def test_the_report_puts_each_goal_beside_its_measurement(tmp_path):
    gc = _gpu_check()
    rep = {"date": "2026-11-26 10:00:00 UTC", "command": "rayvl check gpu --quick",
           "machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 1, "gpu_memory_gib": 79.2, "driver": "570.1",
                       "torch": "2.13.0", "cuda": "12.8", "cudnn": 91000, "python": "3.11", "cpus": 16},
           "settings": {"steps": 30, "micro_batch_size": 256}, "passed": False,
           "cases": [asdict_outcome(gc, "zero2", passed=True, samples_per_s=3000.0, mfu=0.361, data_wait_share=0.031),
                     asdict_outcome(gc, "eval", error="CaseFailed: the CLI has no --gpus option")]}
    text = gc.format_text(rep)
    assert "36.1% (goal ≥ 35%: met)" in text and "3.1% (goal < 2%: missed)" in text
    assert "FAIL" in text and "the CLI has no --gpus option" in text and "FAILED: eval" in text
    json_path, md_path = gc.write(rep, str(tmp_path / "report.md"))
    assert json_path.name == "report.json" and md_path.read_text().count("\n| ") == 3  # header + 2 cases


def test_without_clip_the_clip_cases_fine_tune_open_clips_vit_b_32_architecture(tmp_path):
    """No --clip: open_clip's ViT-B-32 with a random init, written once, read by rayvl as a whole CLIP of ViT-B/32's
    sizes (what the next GPU measures: the real architecture, not its weights)."""
    from rayvl.models import whole_clip

    gc = _gpu_check()
    check = _check(gc, tmp_path)
    path = gc.clip_file(check)
    assert path == gc.clip_file(check) and path.startswith(str(tmp_path))
    arch = whole_clip.settings(path)["model"]["clip"]
    sizes = ("vision_width", "vision_layers", "patch_size", "image_size", "text_width", "text_layers",
             "context_length", "embed_dim")
    assert {k: arch[k] for k in sizes} == dict(zip(sizes, (768, 12, 32, 224, 512, 12, 77, 512)))


def test_each_training_case_is_compared_with_the_bare_loop_at_its_own_batch(tmp_path):
    gc = _gpu_check()
    outcomes = [gc.Outcome("bare", "", batch=256, passed=True, samples_per_s=5000.0),
                gc.Outcome("bare", "", batch=1024, passed=True, samples_per_s=8000.0),
                gc.Outcome("zero2", "", batch=256, passed=True, samples_per_s=5500.0),
                gc.Outcome("zero2", "", batch=1024, passed=True, samples_per_s=6000.0),
                gc.Outcome("zero3", "", batch=256, passed=True, samples_per_s=4000.0),
                gc.Outcome("eval", "", batch=256, passed=True, samples_per_s=3000.0),
                gc.Outcome("zero0", "", batch=256, passed=True, samples_per_s=5100.0),
                gc.Outcome("zero0", "", batch=2048, passed=True, samples_per_s=9000.0),
                gc.Outcome("tonics", "", batch=256, passed=True, samples_per_s=4400.0)]
    gc.compare_to_bare(outcomes)
    assert [o.vs_bare for o in outcomes] == [None, None, 1.1, 0.75, 0.8, None, 1.02, None, 0.88]
    assert [o.vs_zero2 for o in outcomes] == pytest.approx([None, None, None, None, 4 / 5.5, None, 5.1 / 5.5, None,
                                                            0.8])
    from dataclasses import asdict

    cells = gc.rows([asdict(o) for o in outcomes])
    # issue 54's goals, each at its batches: zero2 ≥ 0.85× bare at 1024 only, zero0 ≥ 1× at 256 and 1024 (2048 has
    # neither a bare loop here nor a goal), zero3 ≥ 0.7× zero2 and tonics ≥ 0.9× zero0
    assert cells[2][:5] == ("zero2", "256", "pass", "5500.0", "1.10")
    assert cells[3][4] == "0.75 (goal ≥ 0.85: missed)" and cells[5][4] == "–"
    assert cells[4][4] == "0.80 (0.73× zero2; goal ≥ 0.7× zero2: met)"
    assert cells[6][4] == "1.02 (0.93× zero2; goal ≥ 1: met)" and cells[7][4] == "–"
    assert [o.vs_zero0 for o in outcomes][8] == pytest.approx(4400 / 5100)  # the methods against the plain step
    assert cells[8][4] == "0.88 (0.80× zero2; 0.86× zero0; goal ≥ 0.9× zero0: missed)"
    assert cells[2][7] == "–" and cells[2][8] == "–"  # no report of the start-up, no sync watch
    # the memory bank's goal is zero0's MFU: its EMA key encoders add a forward a sample that MFU counts
    bank = [gc.Outcome("bare", "", batch=256, passed=True, samples_per_s=5000.0),
            gc.Outcome("zero0", "", batch=256, passed=True, samples_per_s=5100.0, mfu=0.10),
            gc.Outcome("memory_bank", "", batch=256, passed=True, samples_per_s=3800.0, mfu=0.095)]
    gc.compare_to_bare(bank)
    assert bank[2].mfu_vs_zero0 == pytest.approx(0.95) and bank[1].mfu_vs_zero0 is None
    assert gc.rows([asdict(o) for o in bank])[2][4] == (
        "0.76 (0.75× zero0; MFU 0.95× zero0's; goal ≥ 0.9× zero0's MFU: met)")
    bank[2].mfu_vs_zero0 = None  # a GPU whose peak the table lacks: no MFU, the samples/s ratio still shown
    assert gc.rows([asdict(o) for o in bank])[2][4] == "0.76 (0.75× zero0)"
    # a whole CLIP's case over the bare loop of its own model, never over the ViT-B/32 + MiniLM one's
    clip = [gc.Outcome("bare", "", batch=256, passed=True, samples_per_s=5000.0),
            gc.Outcome("zero2", "", batch=256, passed=True, samples_per_s=4000.0),
            gc.Outcome("bare_clip", "", batch=256, passed=True, samples_per_s=2000.0),
            gc.Outcome("clip", "", batch=256, passed=True, samples_per_s=1900.0)]
    gc.compare_to_bare(clip)
    assert [o.vs_bare for o in clip] == [None, 0.8, None, 0.95] and clip[3].vs_zero2 is None
    assert gc.rows([asdict(o) for o in clip])[3][4] == "0.95 (goal ≥ 1: missed)"
    assert gc._seconds(18.2) == "18.2 (goal ≤ 20: met)" and gc._seconds(35.0) == "35.0 (goal ≤ 20: missed)"
    args = gc.parse_args(["--batches", "256,1024,max", "--profile", "zero2"])
    assert (args.batches, args.profile, args.eval_images) == ("256,1024,max", "zero2", 20000)
    check = _check(gc, tmp_path, batches="256,1024")
    assert gc.batches(check) == [256, 1024]
    check.batch = 1024
    assert gc.train_config(check, gc.CASES_BY_NAME["zero2"]).train.run_name == "gpu-check-zero2-b1024"
    assert gc.train_config(check, gc.CASES_BY_NAME["zero2"]).train.micro_batch_size == 1024


def startup_section(text: str) -> str:
    """The first listing of a start-up profile: rayvl's own functions (the package's files), by cumulative time."""
    return text.split("Ordered by:")[1]


def test_the_start_up_profile_names_what_rank_0_spent_its_start_on(monkeypatch, tmp_path):
    """RAYVL_PROFILE_STARTUP (``rayvl check gpu --profile-startup CASE``): rank 0's functions until its first step,
    by cumulative and by own time, in one file; other ranks and a run without the variable record nothing. (A run's
    rank 0 writing it from Ray Train: test_training's ZeRO-3 kill-and-resume.)"""
    import time

    from rayvl.train.profiling import STARTUP_ENV, StartupProfile

    def built_slowly():
        time.sleep(0.05)

    monkeypatch.setenv(STARTUP_ENV, str(tmp_path / "p"))
    others = StartupProfile.from_env(rank=1)
    profile = StartupProfile.from_env(rank=0)
    built_slowly()
    profile.stop()
    others.stop()
    profile.stop()  # a second stop writes nothing more
    text = (tmp_path / "p" / "startup-rank0.txt").read_text()
    assert "built_slowly" in text and text.count("time.sleep}") == 2  # in both orders of all functions
    assert "Ordered by: cumulative time" in text and "Ordered by: internal time" in text
    assert "time.sleep" not in startup_section(text) and "site-packages" not in startup_section(text)
    assert [f.name for f in (tmp_path / "p").iterdir()] == ["startup-rank0.txt"]
    monkeypatch.delenv(STARTUP_ENV)
    assert StartupProfile.from_env(rank=0).profile is None
    from rayvl.checks import gpu as gc

    assert gc.parse_args(["--profile-startup", "zero0"]).profile_startup == "zero0"
    for case in ("bare", "kill_resume"):  # no run to start; a start that restarts
        with pytest.raises(SystemExit):
            gc.parse_args(["--profile-startup", case])


def test_eval_at_scale_copies_the_demo_under_new_keys(tmp_path, demo_dir):
    import tarfile

    gc = _gpu_check()
    source = sorted(str(p) for p in (Path(demo_dir) / "eval").glob("*.tar"))
    spec = gc.copied_shards(source, 1200, tmp_path / "copied", shard_size=500)
    paths = spec.split(",")
    assert len(paths) == 3
    keys = [m.name.split(".")[0] for p in paths for m in tarfile.open(p).getmembers() if m.name.endswith(".jpg")]
    assert len(keys) == 1200 == len(set(keys))  # every copy under keys of its own
    meta = [json.loads(tarfile.open(paths[-1]).extractfile(m).read())
            for m in tarfile.open(paths[-1]).getmembers() if m.name.endswith(".json")]
    assert [m["key"] for m in meta] == keys[-200:]


def asdict_outcome(gc, case: str, **values) -> dict:
    from dataclasses import asdict

    return asdict(gc.Outcome(case, case, cpus=16, gpus=1, **values))


# ----------------------------------------------------------------------------- the sync watch

SYNC_TEXT = "called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp:150.)"


def test_the_sync_watch_reads_its_folder_and_first_step_from_the_environment(monkeypatch, tmp_path):
    from rayvl.train.profiling import SYNC_ENV, StepProfiler, SyncWatch

    assert (SyncWatch(f"{tmp_path}:7", 0).out, SyncWatch(f"{tmp_path}:7", 0).first) == (tmp_path, 7)
    assert SyncWatch(str(tmp_path), 1).first == 3  # after the first steps' one-off work
    assert SyncWatch("/runs/a:b", 0).out == Path("/runs/a:b")  # a colon in the folder is the folder's
    assert SyncWatch("", 0).cuda is False
    monkeypatch.setenv(SYNC_ENV, f"{tmp_path}:5")
    watch = StepProfiler.from_env(rank=1).syncs
    assert (watch.out, watch.first, watch.rank, watch.cuda) == (tmp_path, 5, 1, None)
    monkeypatch.delenv(SYNC_ENV)
    assert StepProfiler.from_env(rank=0).syncs.cuda is False


def test_the_sync_watch_does_nothing_where_the_step_is_not_on_cuda(monkeypatch, tmp_path):
    """On a CPU (or a CPU run on a machine with GPUs: CUDA not initialised by the first steps) it neither sets the
    CUDA-only mode nor writes a file nor touches the warnings machinery."""
    import warnings

    from rayvl.train.profiling import StepProfiler

    def refused(mode):
        raise AssertionError("set_sync_debug_mode on a CPU step")

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", refused)
    shown = warnings.showwarning
    for available in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        profiler = StepProfiler("", 0, str(tmp_path / "syncs"))
        for step in range(1, 6):
            profiler.before(step)
            torch.ones(2).sum().item()
            profiler.after(step)
        assert profiler.syncs.cuda is False and warnings.showwarning is shown
    assert not (tmp_path / "syncs").exists()


def _warn_sync():
    import warnings

    warnings.warn(SYNC_TEXT, UserWarning)  # what torch's C++ TORCH_WARN becomes in the thread that synchronised


def test_the_sync_watch_counts_each_synchronisation_of_a_watched_step_in_any_thread(monkeypatch, tmp_path):
    """CUDA played by fakes: torch's sync debug mode warns (UserWarning, every time) on the thread that
    synchronised; the watch counts them per step from its first step on, keeps the first few stacks, lets any other
    warning through, and leaves the mode and the warnings machinery as it found them."""
    import threading
    import warnings

    from rayvl.train.profiling import SyncWatch, read_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    others = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: others.append(str(message)))
    warnings.simplefilter("always")  # every other warning shown (pytest restores the filters after the test)
    shown, filters = warnings.showwarning, list(warnings.filters)
    watch = SyncWatch(f"{tmp_path}:3", 0)
    syncs = {1: 2, 2: 1, 3: 2, 4: 0, 5: 1, 6: 3}  # steps 1-2 before the first watched step
    for step, n in syncs.items():
        watch.before(step)
        for _ in range(n):
            _warn_sync()
        if step == 5:  # a synchronisation in another thread (a batch thread) while the step runs
            thread = threading.Thread(target=_warn_sync, name="batches")
            thread.start()
            thread.join()
        warnings.warn("an unrelated warning", UserWarning)
        watch.after(step)
    assert modes == ["warn", 0] * 4
    assert warnings.showwarning is shown and warnings.filters == filters
    _warn_sync()  # after the last watched step: shown as usual, not counted
    assert others.count("an unrelated warning") == 6 and others[-1] == SYNC_TEXT
    paths = sorted(tmp_path.glob("syncs-rank0-*.jsonl"))
    assert len(paths) == 1
    summary = read_syncs(paths)
    assert (summary["steps"], summary["syncs"], summary["steps_with_syncs"]) == (4, 2 + 2 + 3, [3, 5, 6])
    samples = summary["samples"]
    assert len(samples) == SyncWatch.SAMPLES and [s["step"] for s in samples] == [3, 3, 5, 5, 6]
    assert [s["thread"] for s in samples][:4] == ["MainThread", "MainThread", "MainThread", "batches"]
    assert samples[0]["message"] == SYNC_TEXT
    # the stack ends in the frame that synchronised, without the warnings machinery or the watch itself
    assert samples[0]["stack"][-1].endswith("_warn_sync")
    assert any("test_the_sync_watch_counts" in frame for frame in samples[0]["stack"])
    assert not any("warnings.py" in f or "profiling.py" in f for s in samples for f in s["stack"])


def test_the_report_shows_each_cases_synchronisations_a_step(monkeypatch, tmp_path):
    from dataclasses import asdict

    from rayvl.train.profiling import SYNC_ENV

    gc = _gpu_check()
    check = _check(gc, tmp_path)
    monkeypatch.delenv(SYNC_ENV, raising=False)
    gc.watch_syncs(check)
    assert os.environ[SYNC_ENV] == str(tmp_path / "syncs")
    assert gc.sync_files() == {}
    before = gc.sync_files()
    folder = tmp_path / "syncs"
    folder.mkdir()
    stack = ["rayvl/train/step.py:83 __call__", "rayvl/train/syncfree.py:40 clip", "torch/_tensor.py:12 item"]
    lines = [{"rank": 0, "pid": 12, "first_step": 3}, {"step": 3, "syncs": 0}, {"step": 4, "syncs": 0},
             {"step": 5, "thread": "MainThread", "message": SYNC_TEXT, "stack": stack}, {"step": 5, "syncs": 2},
             {"step": 6, "syncs": 2}, {"step": 7, "syncs": 0}, {"step": 9, "syncs": 2}]
    (folder / "syncs-rank0-12.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    changed = [p for p, seen in gc.sync_files().items() if before.get(p) != seen]
    assert changed == [folder / "syncs-rank0-12.jsonl"]
    outcome = gc.Outcome("zero2", "", passed=True, notes="first step after 40.0 s")
    gc.note_syncs(outcome, changed)
    assert outcome.syncs_per_step == pytest.approx(6 / 6)
    assert outcome.sync_watch["steps_with_syncs"] == [5, 6, 9]
    assert outcome.notes == ("first step after 40.0 s; synchronisations at steps 5-6, 9, the first in MainThread: "
                             "torch/_tensor.py:12 item < rayvl/train/syncfree.py:40 clip < "
                             "rayvl/train/step.py:83 __call__")
    clean, unwatched = gc.Outcome("zero0", "", passed=True), gc.Outcome("zero3", "", passed=True)
    (folder / "syncs-rank0-13.jsonl").write_text('{"rank": 0}\n{"step": 3, "syncs": 0}\n')
    gc.note_syncs(clean, [folder / "syncs-rank0-13.jsonl"])
    gc.note_syncs(unwatched, [])
    assert clean.notes == "" and clean.syncs_per_step == 0
    assert unwatched.syncs_per_step is None and unwatched.notes.startswith("no step watched for synchronisations")
    cells = gc.rows([asdict(o) for o in (outcome, clean, unwatched)])
    assert gc.HEADER[8] == "syncs/step"
    assert [c[8] for c in cells] == ["1.00 (goal 0: missed)", "0 (goal 0: met)", "–"]
    assert gc.spans([3, 4, 5, 9, 11, 12]) == "3-5, 9, 11-12" and gc.spans([]) == ""
