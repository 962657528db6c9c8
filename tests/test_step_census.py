"""What one training step asks of the host (rayvl.checks.census, `rayvl check census`), pinned: rayvl's ZeRO-2 step
reads nothing back from the device, synchronises nothing and launches no more kernels than a hand-written loop; and
the device-side clip (rayvl.train.syncfree) steps exactly as DeepSpeed's own."""
from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from conftest import REPO


def _load(name: str):
    """A benchmark module by its file (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sc(one_process_group):
    from rayvl.checks import census

    return census


@pytest.mark.slow
def test_no_layout_waits_for_the_device_and_zero_0_to_2_launch_what_a_bare_loop_does(sc, capsys):
    """Every ZeRO stage, rayvl's own step at bf16: no scalar read, no fresh host tensor, no tensor-valued fill —
    each a wait for the GPU on CUDA (rayvl.checks.census.SYNC_OPS) — and no device synchronisation; the host-time
    benchmark (benchmarks/host_time.py) runs over the same steps, one round (its timings are printed, never
    asserted)."""
    bare = sc.census(sc.bare_step(sc.config(0, "bf16")))
    assert bare.scalar_reads == 0  # the model itself reads nothing (transformers' mask shortcut did, twice)
    steps, counts = {"bare loop": sc.bare_step(sc.config(0, "bf16"))}, {"bare loop": bare}
    for stage in (0, 1, 2, 3):  # ZeRO-0: torch autocast; ZeRO-1/2/3: DeepSpeed's bf16 optimizers
        step, engine = sc.rayvl_step(sc.config(stage, "bf16"))
        assert sc.trainable_tensors(engine.module) == 188  # laion_adapt's layout at ViT-B/32
        rayvl = sc.census(step)
        steps[f"rayvl ZeRO-{stage}"], counts[f"rayvl ZeRO-{stage}"] = step, rayvl
        assert rayvl.scalar_reads == 0 and rayvl.sync_ops == 0, (stage, rayvl.by_op)
        assert rayvl.synchronizes == 0, stage  # DeepSpeed's throughput timer synchronised twice a step
        if stage == 3:
            continue  # ZeRO-3 gathers each layer's weights and partitions its gradients: more kernels, by design
        # every trainable tensor starts 16-byte aligned in ZeRO's flat buffer (the logit scale, one element, sat
        # ahead of the biases and put them off by 2 bytes: cuBLAS's alignment-1 kernels on an H100)
        off = [n for n, p in engine.module.named_parameters() if p.requires_grad and p.data_ptr() % 16]
        assert off == [], (stage, off[:3])
        assert rayvl.kernels <= 1.1 * bare.kernels, (stage, rayvl.kernels, bare.kernels)
        # DeepSpeed's own norm took one per tensor (191) and its overflow check an amax per tensor; left: the
        # model's two F.normalize and the norm of the per-tensor norms
        assert rayvl.by_op["aten.linalg_vector_norm"] <= 3 and rayvl.by_op["aten.amax"] == 0, stage
        if stage == 1:  # ZeRO-1 reduces after the backward: no Python hook per gradient (ZeRO-2 has one each)
            assert len(engine.optimizer._grad_acc_hooks) == 0
    assert rayvl.ops > 2 * bare.ops  # ZeRO's views of its gradient buckets: dispatched, no kernel launched

    # the methods' parts at the auto layout: a memory bank launches its EMA forward and update as a hand-written loop
    # with the same bank does, and what rayvl's step adds to that is what it adds to the bare loop (its fixed
    # temperature's fill besides); UniCL's label-aware targets and loss a few kernels more than the CLIP loss
    ht = _load("host_time")
    for name, step in sc.method_steps("bf16").items():
        steps[name], counts[name] = step, sc.census(step)
        assert counts[name].scalar_reads == counts[name].sync_ops == counts[name].synchronizes == 0, name
    bank, own, zero0 = counts["rayvl ZeRO-0 + memory bank"], counts["bare loop + memory bank"], counts["rayvl ZeRO-0"]
    assert own.kernels > 1.3 * bare.kernels  # the EMA towers' forward: the method's arithmetic, in both loops
    assert abs((bank.kernels - own.kernels) - (zero0.kernels - bare.kernels)) <= 3, (bank.kernels, own.kernels)
    for op in ("aten._foreach_mul_", "aten._foreach_add_", "aten._foreach_copy_"):
        assert bank.by_op[op] == own.by_op[op] > zero0.by_op[op], op  # the EMA update, once a step
    assert zero0.kernels < counts["rayvl ZeRO-0 + label-aware loss"].kernels <= zero0.kernels + 20
    assert sc.baseline("rayvl ZeRO-0 + memory bank") == "bare loop + memory bank"
    # the most common real use, a whole CLIP fine-tuned at ViT-B/32's tensor layout (every tensor trained): rayvl's
    # stage-0 step waits for nothing and launches what the bare loop of the same CLIP does
    assert sc.trainable_tensors(sc.small_model(sc.clip_config(0, "bf16"))) == 350
    for name, step in sc.clip_steps("bf16").items():
        steps[name], counts[name] = step, sc.census(step)
        assert counts[name].scalar_reads == counts[name].sync_ops == counts[name].synchronizes == 0, name
    bare_clip, zero0_clip = (counts[name] for name in sc.CLIP_ROWS)
    assert bare_clip.kernels > bare.kernels and zero0_clip.kernels <= 1.1 * bare_clip.kernels
    assert sc.baseline(sc.CLIP_ROWS[1]) == sc.CLIP_ROWS[0]
    print(ht.table(ht.measure(steps, rounds=1, per_round=1), counts, "bf16"))
    table = capsys.readouterr().out
    assert table.count("\nrayvl ZeRO-") == 7 and table.count("≤1.10") == 4


def _engine(sc, cfg, syncfree: bool):
    step, engine = sc.rayvl_step(cfg)
    if not syncfree:  # DeepSpeed's own methods again (syncfree sets instance attributes)
        for name in ("get_grad_norm_direct", "unscale_and_clip_grads"):
            delattr(engine.optimizer, name)
    return step, engine


def _weights(engine) -> dict:
    """This rank's weights as the model holds them (ZeRO-3: its partition of each)."""
    return {n: getattr(p, "ds_tensor", p).detach().float().clone() for n, p in engine.module.named_parameters()}


def _masters(engine) -> list:
    """This rank's fp32 master weights: what the optimizer trains (the model's bf16 weights are their rounding)."""
    o = engine.optimizer
    return [t.detach().clone() for t in getattr(o, "fp32_partitioned_groups_flat", None)
            or o.single_partition_of_fp32_groups]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.slow
def test_device_side_norm_and_clip_step_as_deepspeeds_own_and_a_non_finite_step_keeps_the_weights_finite(sc, stage):
    cfg = sc.config(stage, "bf16", ["train.grad_clip=0.05"])  # small enough that every step clips
    runs = []
    for syncfree in (True, False):
        step, engine = _engine(sc, cfg, syncfree)
        norms = []
        for _ in range(3):
            step()
            norms.append(float(engine.get_global_grad_norm()))
        runs.append((norms, _masters(engine), engine))
    (ours, ours_masters, engine), (theirs, theirs_masters, _) = runs
    assert all(n > 0.05 for n in ours)  # clipped
    assert ours == pytest.approx(theirs, rel=1e-6)
    # within an fp32 ulp: ZeRO-3's own norm is summed in fp64, rayvl's foreach norm in fp32, so the clip coefficients
    # may differ in their last bit, and so a weight by one ulp
    assert all(torch.allclose(a, b, rtol=2 ** -22, atol=1e-7) for a, b in zip(ours_masters, theirs_masters))

    # a step whose gradients are not finite: reported as such, its gradients zeroed, the weights stay finite
    engine.module.logit_scale.register_hook(lambda g: g * math.nan)
    from rayvl.train.resume import TrainedRows
    from rayvl.train.step import Step

    batch = sc.batch()
    Step(engine, [], cfg, TrainedRows())(lambda s, m: (batch, 0.0), 4)
    assert not math.isfinite(float(engine.get_global_grad_norm()))
    assert all(torch.isfinite(p).all() for p in _weights(engine).values())


@pytest.mark.parametrize("stage, clip", [(0, 1.0), (2, 0.0)])
def test_a_step_of_non_finite_gradients_leaves_the_weights_finite_with_and_without_clipping(sc, stage, clip):
    """Stage 0 (rayvl clips): the fused AdamW takes a non-finite norm as GradScaler's found_inf — weights, moments and
    step count unchanged, nothing read back. ZeRO-2 without clipping (DeepSpeed's bf16 step neither checks nor
    clips then): the step takes zero gradients, so AdamW moves the weights by momentum and decay only."""
    from rayvl.train.resume import TrainedRows
    from rayvl.train.step import Step

    cfg = sc.config(stage, "bf16", [f"train.grad_clip={clip}"])
    step, engine = sc.rayvl_step(cfg)
    step()
    before = _masters(engine) if stage else [p.detach().clone() for p in engine.module.parameters()]
    moments = {k: v.clone() for k, v in engine.optimizer.state_dict()["state"][0].items()} if stage == 0 else {}
    hook = engine.module.logit_scale.register_hook(lambda g: g * math.nan)
    batch = sc.batch()
    Step(engine, [], cfg, TrainedRows())(lambda s, m: (batch, 0.0), 2)
    after = _masters(engine) if stage else [p.detach().clone() for p in engine.module.parameters()]
    assert all(torch.isfinite(t).all() for t in after)
    if stage:  # zero gradients: the same move as a step whose gradients are all 0
        return
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # skipped, not moved by momentum or decay
    if stage == 0:  # the moments and the step count too (fused AdamW undoes its step count)
        assert moments and all(torch.equal(v, engine.optimizer.state_dict()["state"][0][k])
                               for k, v in moments.items())
    hook.remove()
    step()  # the next step trains again
    trained = _masters(engine) if stage else [p.detach() for p in engine.module.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(after, trained))
    assert all(torch.isfinite(t).all() for t in trained)


def test_a_checkpoint_resumes_in_the_buffer_padding_it_was_written_with(sc, tmp_path):
    """ZeRO-1/2's flat buffers are padded for alignment now; a checkpoint written before (no record of it in
    rayvl.json) holds the unpadded layout, which DeepSpeed loads only into unpadded buffers: a resume builds them as
    its checkpoint says, and restores weights and optimizer state exactly. The same for the weight-decay rule (a
    ViT's class token decayed before it was recorded): the resume groups the parameters as its checkpoint did."""
    import json

    import ray.train

    from rayvl.train.engine import build_engine
    from rayvl.train.resume import ALIGNED, DECAY_RULE, TrainedRows, aligned_buffers, decay_rule
    from rayvl.train.step import Step

    cfg = sc.config(2, "bf16")
    batch = sc.batch()

    def step(engine):
        Step(engine, [], cfg, TrainedRows())(lambda s, m: (batch, 0.0), 4)

    old = build_engine(sc.small_model(cfg), cfg, 1, aligned=False, decay_rule=1)  # as rayvl built it before
    step(old)
    assert any(p.data_ptr() % 16 for p in old.module.parameters() if p.requires_grad)  # unpadded: views off
    old.save_checkpoint(str(tmp_path), tag="t")
    (tmp_path / "rayvl.json").write_text(json.dumps({"step": 1}))  # an old checkpoint's record: no padding named
    written = ray.train.Checkpoint.from_directory(str(tmp_path))
    assert aligned_buffers(written) is False and decay_rule(written) == 1  # and its class token decayed
    with pytest.raises(RuntimeError, match="parameter-alignment layout does not match"):
        build_engine(sc.small_model(cfg), cfg, 1).load_checkpoint(str(tmp_path), tag="t")
    resumed = build_engine(sc.small_model(cfg), cfg, 1, aligned=False, decay_rule=decay_rule(written))
    resumed.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=True)
    for engine in (old, resumed):  # one more step each: the optimizer's moments came along too
        step(engine)
    trained = dict(old.module.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in resumed.module.named_parameters())
    # new engines pad, and their checkpoints say so
    new = build_engine(sc.small_model(cfg), cfg, 1)
    assert new.rayvl_aligned is True and aligned_buffers(None) is True
    assert new.rayvl_decay_rule == decay_rule(None) == 2
    # the class token left the decayed group: groups of other sizes, which a rule-1 checkpoint's state does not fit
    sizes = [sum(p.numel() for p in g["params"]) for g in new.optimizer.param_groups]
    assert sizes != [sum(p.numel() for p in g["params"]) for g in old.optimizer.param_groups]
    (tmp_path / "rayvl.json").write_text(json.dumps({"step": 1, ALIGNED: True, DECAY_RULE: 2}))
    written = ray.train.Checkpoint.from_directory(str(tmp_path))
    assert aligned_buffers(written) is True and decay_rule(written) == 2


@pytest.mark.slow
def test_a_worker_imports_timm_and_deepspeed_without_the_loggers_they_import_and_those_import_as_usual_after():
    """timm imports wandb and DeepSpeed's autotuner mlflow when they are installed; a worker, which never logs to
    either, imports them without (rayvl.compat.import_without), and both still import later in that process."""
    import os
    import subprocess

    code = ("import sys\nfrom rayvl.compat import import_timm, import_without\nimport_timm()\n"
            "import_without('deepspeed', 'mlflow')\nfrom deepspeed.autotuning import autotuner\n"
            "assert not {'mlflow', 'wandb'} & set(sys.modules) and not autotuner.has_mlflow, 'a logger imported'\n"
            "import mlflow, wandb\nprint(mlflow.MlflowClient.__name__, wandb.init.__name__)")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split()[-2:] == ["MlflowClient", "init"], r.stderr[-2000:]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_temperature_is_clamped_after_each_step_on_the_optimizers_own_copy(sc, stage):
    """open_clip's clamp of log(1/τ) after each optimizer step, at every layout (rayvl.train.step.clamp_temperature):
    at the clamp a gradient that raises s is undone on the fp32 copy the optimizer steps (the parameter at ZeRO-0,
    DeepSpeed's master at ZeRO-2 and 3) and one that lowers it acts — as a released CLIP fine-tunes in open_clip."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    cfg = sc.config(stage, "bf16")
    step, engine = sc.rayvl_step(cfg)
    p = engine.module.logit_scale
    cap = math.log(100.0)
    above = torch.full((1,), cap + 0.01)  # as OpenAI's fp16 ln(100) lies a hair above the clamp, further
    with torch.no_grad():
        p.copy_(above) if stage == 0 else safe_set_full_fp32_param(p, above)

    def master() -> float:
        return float(p.detach() if stage == 0 else safe_get_full_fp32_param(p))

    hook = p.register_hook(lambda g: torch.full_like(g, -1.0))  # the loss wants a larger scale: s would rise
    step()
    assert master() == pytest.approx(cap, abs=1e-6)  # risen, then clamped to the cap
    step()
    assert master() == pytest.approx(cap, abs=1e-6)
    assert float(engine.module.scale().detach()) == pytest.approx(100.0, rel=1e-2)
    hook.remove()
    p.register_hook(lambda g: torch.full_like(g, 1.0))  # a smaller one: s falls from the clamp (once AdamW's
    for _ in range(4):  # first moment, which the rises left negative, has turned)
        step()
    assert master() < cap - 1e-6
