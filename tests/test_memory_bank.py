"""EMA memory bank ([BoW] §2.1): EMA arithmetic, queue wrap-around, state round trip, config guard."""
import io
import time

import pytest
import torch
from torch import nn

from rayvl.config import ConfigError, load_config
from rayvl.methods.bow.memory_bank import MemoryBank


def test_ema_update_math():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    bank = MemoryBank(model, size=4, dim=2, momentum=0.9)
    start = {k: v.clone() for k, v in bank.ema.state_dict().items()}
    model[1].weight.requires_grad_(False)  # a frozen parameter: its EMA is itself as built
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[1].weight.add_(1.0)  # as DeepSpeed's bf16 copy of a frozen weight differs from its fp32 original
        model[1].running_mean.fill_(5.0)
    bank.update(model)
    ema = bank.ema.state_dict()
    # θ' ← 0.9·θ' + 0.1·θ with θ = θ'_0 + 1 → θ'_0 + 0.1; buffers are copied, not averaged
    assert torch.allclose(ema["0.weight"], start["0.weight"] + 0.1, atol=1e-7)
    assert torch.equal(ema["0.bias"], start["0.bias"]) and torch.equal(ema["1.weight"], start["1.weight"])
    assert torch.equal(ema["1.running_mean"], torch.full((2,), 5.0))
    assert not any(p.requires_grad for p in bank.ema.parameters())


def test_keys_are_encoded_in_the_trained_towers_precision_and_kept_fp32():
    from rayvl.models.dual_encoder import build_model

    cfg = load_config(None, ["model.embed_dim=8", "model.alignment_layers=1"])
    model = build_model(cfg.model).eval()
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    ids, mask = torch.randint(1000, 2000, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    plain = MemoryBank(model, size=4, dim=8, momentum=0.9).encode(images, ids, mask)
    bf16 = MemoryBank(model, size=4, dim=8, momentum=0.9, autocast=torch.bfloat16).encode(images, ids, mask)
    for a, b in zip(plain, bf16):
        assert b.dtype == torch.float32 and not torch.equal(a, b)  # computed in bf16: close, not equal
        assert torch.nn.functional.cosine_similarity(a, b).min() > 0.98


def test_queue_wraps_around_and_keeps_labels():
    bank = MemoryBank(nn.Linear(2, 2), size=5, dim=2, momentum=0.5)
    feats = lambda lo, n: torch.arange(lo, lo + n, dtype=torch.float32)[:, None].repeat(1, 2)  # noqa: E731
    bank.enqueue(feats(0, 3), -feats(0, 3), torch.tensor([10, 11, 12]))
    assert (bank.ptr, bank.filled) == (3, 3)
    bank.enqueue(feats(3, 3), -feats(3, 3), torch.tensor([13, 14, 15]))
    assert (bank.ptr, bank.filled) == (1, 5)
    assert bank.images[:, 0].tolist() == [5, 1, 2, 3, 4]  # the oldest entry (0) was overwritten by the newest
    assert bank.labels.tolist() == [15, 11, 12, 13, 14] and bank.texts[:, 0].tolist() == [-5, -1, -2, -3, -4]
    img, txt, lab = bank.keys(feats(100, 2), -feats(100, 2), torch.tensor([-1, -2]))
    assert img.shape == (7, 2) and lab.tolist() == [-1, -2, 15, 11, 12, 13, 14]  # batch keys first, then queue
    bank.enqueue(feats(20, 7), -feats(20, 7), torch.arange(7))  # larger than the queue: its newest 5 stay
    assert sorted(bank.images[:, 0].tolist()) == [22, 23, 24, 25, 26] and bank.filled == 5


def test_state_round_trips_through_torch_save():
    torch.manual_seed(1)
    bank = MemoryBank(nn.Linear(4, 3), size=6, dim=3, momentum=0.99)
    bank.enqueue(torch.randn(4, 3), torch.randn(4, 3), torch.arange(4))
    bank.update(nn.Linear(4, 3))
    buf = io.BytesIO()
    torch.save(bank.state_dict(), buf)
    buf.seek(0)
    other = MemoryBank(nn.Linear(4, 3), size=6, dim=3, momentum=0.99)
    other.load_state_dict(torch.load(buf, weights_only=True))  # the bank state is tensors + plain values
    assert (other.ptr, other.filled) == (4, 4)
    for a, b in zip(bank.state_dict().values(), other.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    assert all(torch.equal(bank.ema.state_dict()[k], v) for k, v in other.ema.state_dict().items())


def test_zero3_with_a_memory_bank_is_refused_at_config_load():
    with pytest.raises(ConfigError, match=r"memory_bank\.size: .*ZeRO-3"):
        load_config(None, ["memory_bank.size=64", "train.zero_stage=3"])
    load_config(None, ["memory_bank.size=64", "train.zero_stage=2"])


# the actors a run starts on its driver's Ray (besides its Train workers): its data reports, Ray Train's controller
# and its datasets' coordinators, by the process titles Ray gives them
RUN_ACTORS = ("ray::DataReport", "ray::TrainController", "ray::DatasetManager", "ray::SplitCoordinator")


def _run_actor_processes() -> set[int]:
    """The run actors' processes of this process's Ray (its raylet is a child of this process, its workers the
    raylet's): another Ray on the machine (a pytest run beside this one, a developer's) is not looked at."""
    import psutil

    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if p.pid in ours and (p.info["cmdline"] or [""])[0].startswith(RUN_ACTORS)}


def test_ema_steps_once_per_optimizer_step_under_grad_accumulation(ray_local, demo_dir, tmp_path):
    """Two micro-batches make one optimizer step, so the key encoders take one EMA step per step:
    θ'_2 = m·θ'_1 + (1 − m)·θ_2. One update per micro-batch would also average in θ_1 (the weights the first
    micro-batch of step 2 sees): m²·θ'_1 + m(1 − m)·θ_1 + (1 − m)·θ_2. The run, on a driver that goes on (as a
    notebook does), leaves none of its actors behind: its data reports and Ray Train's controller end with it."""
    from conftest import small_config
    from rayvl.checkpoints import read_train_state
    from rayvl.train.trainer import train

    cfg = small_config(demo_dir, tmp_path, "train.num_workers=1", "train.grad_accumulation=2", "train.max_steps=2",
                       "train.warmup_steps=0", "train.checkpoint_every=1", "memory_bank.size=64",
                       "memory_bank.momentum=0.5", "eval.tasks=[]")
    named = ray_local.util.list_named_actors
    before, reports = _run_actor_processes(), {a["name"] for a in named(all_namespaces=True)}
    result = train(cfg)
    deadline = time.monotonic() + 60  # a released actor's process exits shortly after
    while _run_actor_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _run_actor_processes() - before
    left = {a["name"] for a in named(all_namespaces=True)} - reports
    assert not [a for a in left if a.startswith("rayvl-data-report-")], left
    first, last = sorted(d for d in result.run_dir.glob("checkpoint_*") if d.is_dir())  # named by time
    bank_1 = read_train_state(first)["memory_bank"]
    bank_2 = read_train_state(last)["memory_bank"]
    theta_2 = torch.load(last / "model.pt")
    assert (bank_1["ptr"], bank_2["ptr"]) == (16, 32)  # both micro-batches' keys are queued every step
    for key in ("vision_proj.weight", "text_proj.0.weight"):
        assert not torch.equal(bank_1["ema"][key], theta_2[key])
        assert torch.allclose(bank_2["ema"][key], 0.5 * bank_1["ema"][key] + 0.5 * theta_2[key], atol=1e-6)


def test_the_memory_banks_negatives_reach_the_model_card_through_its_registration():
    """The core names no method: the bank's queue reaches the dry run's and the model card's lines through
    ``Method.negatives`` (rayvl.plugins.extra_negatives)."""
    from rayvl import plugins
    from rayvl.export import model_card

    cfg = load_config(None, ["memory_bank.size=64"])
    assert plugins.extra_negatives(cfg) == [(64, "the EMA memory bank")]
    assert plugins.extra_negatives(load_config(None, [])) == []
    card = model_card({"config": cfg.to_dict(), "metrics": {}, "source": "runs/x", "step": 3, "final": True})
    assert "loss `clip`, 64 negatives a query in the EMA memory bank." in card
