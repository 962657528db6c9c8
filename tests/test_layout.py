"""train.zero_stage=auto (rayvl.train.layout): the fastest engine layout whose state fits, decided before the
workers start, said in the dry run, kept by a resume."""
from __future__ import annotations

import json
import os

import pytest

from conftest import REPO
from rayvl.config import ConfigError, load_config
from rayvl.train import layout
from rayvl.train.layout import Params, choose, resolve, state_bytes

GIB = 2**30
VIT_B32 = ["model.vision=vit_base_patch32_224", "data.image_size=224", "model.alignment_layers=6"]


def gpu_config(*overrides):
    return load_config(REPO / "configs" / "laion_adapt.yaml", ["train.use_gpu=true", *overrides])


def test_the_state_a_rank_holds_in_each_layout_counted_by_hand():
    p = Params(total=100, trainable=60)
    # stage 0: fp32 weights and gradients, AdamW's two fp32 moments (autocast computes in bf16)
    assert state_bytes(0, "none", p, 4, "bf16") == 4 * 100 + 4 * 60 + 8 * 60
    # ZeRO-1: bf16 weights and gradients whole, fp32 master + moments partitioned over 4 ranks
    assert state_bytes(1, "none", p, 4, "bf16") == 2 * 100 + 2 * 60 + 12 * 60 / 4
    assert state_bytes(2, "none", p, 4, "bf16") == 2 * 100 + (2 * 60 + 12 * 60) / 4
    assert state_bytes(3, "none", p, 4, "bf16") == (2 * 100 + 2 * 60 + 12 * 60) / 4
    assert state_bytes(3, "optimizer", p, 4, "bf16") == (2 * 100 + 2 * 60) / 4
    assert state_bytes(3, "optimizer_and_params", p, 4, "bf16") == 2 * 60 / 4
    assert state_bytes(2, "none", p, 4, "fp32") == 4 * 100 + (4 * 60 + 12 * 60) / 4


def test_cpu_workers_train_at_stage_0_and_the_run_says_why():
    cfg, chosen = resolve(load_config(REPO / "configs" / "laion_adapt.yaml", []))
    assert cfg.train.zero_stage == 0 and chosen.stage == 0 and "CPU workers" in chosen.why
    assert chosen.line().startswith("DeepSpeed ZeRO-0 (train.zero_stage=auto: CPU workers")
    # a stage the user set is theirs
    assert resolve(load_config(None, ["train.zero_stage=2"])) [0].train.zero_stage == 2
    assert resolve(load_config(None, ["train.zero_stage=2"]))[1] is None


def test_a_vit_b32_clip_trains_at_stage_0_on_one_gpu_and_bigger_models_move_up_the_layouts():
    cfg = gpu_config(*VIT_B32, "train.num_workers=8")
    params = layout.count_params(cfg)  # on the meta device
    assert 100e6 < params.total < 200e6 and params.trainable < params.total  # the MiniLM tower is frozen
    assert choose(cfg, params, 80.0, "test").stage == 0
    assert choose(cfg, params, 4.0, "test").stage == 0  # ~2 GiB of state: fits half of even a small GPU
    # 4B parameters on 8 × 80 GiB: 64 GB at stage 0, 22 GB at ZeRO-1 — within 40 GiB
    big = Params(4_000_000_000, 4_000_000_000)
    chosen = choose(cfg, big, 80.0, "test")
    assert (chosen.stage, chosen.offload) == (1, "none") and "do not fit" in chosen.why
    assert choose(cfg, big, 24.0, "test").stage == 3  # within 12 GiB: 15 GB at ZeRO-2, 8 GB at ZeRO-3
    huge = Params(40_000_000_000, 40_000_000_000)
    assert (choose(cfg, huge, 80.0, "test").stage, choose(cfg, huge, 80.0, "test").offload) == (3, "optimizer")
    last = choose(cfg, Params(10**12, 10**12), 80.0, "test")
    assert (last.stage, last.offload) == (3, "optimizer_and_params") and "add GPUs" in last.why


def test_auto_skips_the_layouts_a_method_refuses_and_an_asked_offload_narrows_the_choice():
    cfg = gpu_config("memory_bank.size=64", "train.num_workers=8")  # a memory bank needs its weights whole
    chosen = choose(cfg, Params(40_000_000_000, 40_000_000_000), 80.0, "test")
    assert chosen.stage == 2 and "add GPUs" in chosen.why  # ZeRO-3 refused: the least a bank can hold
    offloaded = choose(gpu_config("train.zero_offload=optimizer"), Params(1000, 1000), 80.0, "test")
    assert (offloaded.stage, offloaded.offload) == (2, "optimizer")
    with pytest.raises(ConfigError, match="train.zero_stage: auto found no layout .*memory_bank"):
        choose(gpu_config("memory_bank.size=64", "train.zero_offload=optimizer_and_params"), Params(1, 1), 80.0, "t")


def test_gpu_memory_from_this_machine_or_from_rays_accelerator_type(tmp_path, monkeypatch):
    cfg = gpu_config(*VIT_B32)
    assert layout.on_cluster(gpu_config("ray_address=ray://head:10001"))  # a cluster's GPUs are not this machine's
    monkeypatch.setattr(layout, "on_cluster", lambda cfg: False)  # a run that starts its own Ray
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here: the cluster's GPUs are asked
    assert resolve(cfg, cluster=None) == (cfg, None)  # the trainer asks again once Ray reports them
    resolved, chosen = resolve(cfg, cluster={"GPU": 8.0, "accelerator_type:H100": 1.0})
    assert resolved.train.zero_stage == 0 and "80 GiB (Ray's accelerator type H100)" in chosen.why
    _, unknown = resolve(cfg, cluster={"GPU": 8.0})
    assert f"{layout.UNKNOWN_GPU_GIB:g} GiB (assumed" in unknown.why
    smi = tmp_path / "nvidia-smi"  # nvidia-smi's answer to --query-gpu=memory.total --format=csv,noheader,nounits
    smi.write_text("#!/bin/sh\nprintf '143771\\n81559\\n'\n")
    smi.chmod(0o755)
    assert layout.local_gpu_gib() == pytest.approx(81559 / 1024)
    _, local = resolve(cfg, cluster=None)
    assert "79.6 GiB (this machine's GPU)" in local.why


def test_a_resume_keeps_its_checkpoints_stage_and_the_dry_run_names_the_layout(demo_dir, tmp_path):
    from rayvl.dry_run import describe
    from rayvl.train.run_plan import plan_run

    base = [f"train.storage_path={tmp_path}", "train.run_name=run", "eval.tasks=[]"]
    cfg = load_config(REPO / "configs" / "laion_adapt.yaml", base + [f"data.train={demo_dir / 'train'}"])
    assert "  engine: DeepSpeed ZeRO-0 (train.zero_stage=auto: CPU workers" in describe(cfg)
    written = load_config(REPO / "configs" / "laion_adapt.yaml", base + ["train.zero_stage=3",
                                                                          "train.zero_offload=optimizer"])
    checkpoint = tmp_path / "run" / "checkpoint_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rayvl.json").write_text(json.dumps({"step": 2, "config": written.to_dict(), "final": False}))
    resumed = load_config(REPO / "configs" / "laion_adapt.yaml",
                          base + [f"data.train={demo_dir / 'train'}", "train.resume=true"])
    planned = plan_run(resumed)
    t = planned.cfg.train  # stage and offload as written: DeepSpeed's files hold that layout's partitions
    assert (t.zero_stage, t.zero_offload) == (3, "optimizer") and "the layout of the checkpoint" in planned.layout.why
    assert os.path.isdir(checkpoint)
