"""Text-tower strategies of [Paraphrase] §4: parameter counts for MiniLM, and every strategy training under real
DeepSpeed ZeRO 0 and 2 with 2 Ray Train workers — frozen LM weights bit-identical and absent from the optimizer."""
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import two_rank_files
from rayvl.config import load_config
from rayvl.models.dual_encoder import build_model

STRATEGIES = ["finetune", "frozen", "frozen_adapters", "frozen_alignment"]


def test_parameter_counts_for_minilm():
    counts = {}
    for strategy in STRATEGIES:
        text = build_model(load_config(None, [f"model.text_strategy={strategy}"]).model).text
        counts[strategy] = sum(p.numel() for p in text.parameters() if p.requires_grad)
    lm = 22_565_376  # all-MiniLM-L6-v2: 6 layers, d = 384, FFN 1536
    # an adapter per layer, 384 → 192 → 384 with biases: 384·192 + 192 + 192·384 + 384 = 148,032
    adapters = 6 * (384 * 192 + 192 + 192 * 384 + 384)
    # an alignment layer is a BERT layer: QKV + attention output + LN, FFN in/out + LN
    layer = 3 * (384 * 384 + 384) + (384 * 384 + 384 + 768) + (384 * 1536 + 1536) + (1536 * 384 + 384 + 768)
    assert counts == {"finetune": lm, "frozen": 0, "frozen_adapters": adapters, "frozen_alignment": 2 * layer}
    assert adapters == 888_192 and 2 * layer == 3_548_928


def test_adapters_start_as_the_pretrained_lm():
    from rayvl import assets
    from rayvl.data.text import tokenize

    ids, mask = (torch.from_numpy(a) for a in tokenize(["a red circle", "two dogs on a beach"],
                                                       str(assets.text_model_path("minilm-l6")), 16))
    frozen = build_model(load_config(None, ["model.text_strategy=frozen"]).model).text.eval()
    adapted = build_model(load_config(None, ["model.text_strategy=frozen_adapters"]).model).text.eval()
    with torch.no_grad():
        assert torch.equal(frozen(ids, mask), adapted(ids, mask))  # up-projections start at zero


def _optimized(engine) -> list:
    """The model parameters DeepSpeed's optimizer updates (ZeRO 1/2 keep them per group in bit16_groups)."""
    groups = getattr(engine.optimizer, "bit16_groups", None)
    if groups is None:
        groups = [g["params"] for g in engine.optimizer.param_groups]
    return [p for g in groups for p in g]


def two_ranks(out: str) -> None:
    """Inside Ray Train (2 workers, conftest.two_rank_checks): every strategy × ZeRO stage builds an engine and takes
    a step."""
    import ray.train

    from rayvl import assets
    from rayvl.config import from_dict
    from rayvl.data.text import tokenize
    from rayvl.losses import clip_loss
    from rayvl.train.engine import build_engine

    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    base = load_config(None, ["model.embed_dim=32", "model.alignment_layers=1", "data.image_size=32"]).to_dict()
    gen = torch.Generator().manual_seed(rank)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=gen)
    ids, mask = (torch.from_numpy(a) for a in tokenize([f"caption {rank} {i}" for i in range(4)],
                                                       str(assets.text_model_path("minilm-l6")), 12))
    results = {}
    for strategy in (*STRATEGIES, "unlocked"):
        # bf16 under ZeRO-2 for every strategy and under ZeRO-3 for the main recipe's (bf16 matmuls are ~50× slower
        # than fp32 on these CPUs without AVX512-BF16, so the suite keeps its bf16 work small)
        layouts = [(0, "fp32"), (2, "bf16")] + ([(3, "bf16")] if strategy == "frozen_alignment" else [])
        # unlocked: open_clip's partial unlocking, both towers locked but their last layers (groups)
        model_cfg = {"text_strategy": strategy} if strategy != "unlocked" else {
            "text_strategy": "frozen", "text_unlocked_layers": 1, "vision_strategy": "frozen",
            "vision_unlocked_groups": 2, "vision_freeze_bn_stats": True}
        for stage, precision in layouts:
            cfg = from_dict({**base, "model": {**base["model"], **model_cfg},
                             "train": {**base["train"], "zero_stage": stage, "precision": precision}})
            model = build_model(cfg.model, seed=0)
            frozen = {n: p.detach().clone() for n, p in model.text.lm.named_parameters() if not p.requires_grad}
            trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            engine = build_engine(model, cfg, world)
            loss = clip_loss(*engine(images, ids, mask))
            engine.backward(loss)
            engine.step()
            finite = math.isfinite(loss.item())
            if stage == 3:  # partitioned parameters: the entry says that the bf16 ZeRO-3 engine trains
                results[f"{strategy}/{stage}/{precision}"] = {"losses_finite": finite}
                del engine
                continue
            params = dict(engine.module.named_parameters())
            optimized = {id(p) for p in _optimized(engine)}
            results[f"{strategy}/{stage}/{precision}"] = {
                "losses_finite": finite,
                # under bf16 DeepSpeed holds the frozen weights rounded to bf16, and never changes them
                "frozen_identical": all(torch.equal(params[f"text.lm.{n}"], v.to(params[f"text.lm.{n}"].dtype))
                                        for n, v in frozen.items()),
                "frozen_count": sum(v.numel() for v in frozen.values()),
                "frozen_in_optimizer": any(id(params[f"text.lm.{n}"]) in optimized for n in frozen),
                "optimized_numel": sum(p.numel() for p in _optimized(engine)),
                "trainable_numel": sum(v.numel() for v in trainable.values()),
                "text_changed": any(not torch.equal(params[n], v.to(params[n].dtype)) for n, v in trainable.items()
                                    if n.startswith("text.")),
            }
            del engine
    if rank == 0:
        (Path(out) / "strategies.json").write_text(json.dumps(results))


def test_every_strategy_trains_under_zero_0_and_2(two_rank_checks):
    results = json.loads((two_rank_files(two_rank_checks, __name__) / "strategies.json").read_text())
    assert len(results) == 11 and "frozen_alignment/3/bf16" in results
    for key, r in results.items():
        strategy = key.split("/")[0]
        if key.endswith("/3/bf16"):
            assert r == {"losses_finite": True}, key
            continue
        assert r["losses_finite"] and r["frozen_identical"] and not r["frozen_in_optimizer"], key
        assert r["optimized_numel"] == r["trainable_numel"], key  # DeepSpeed's state holds trainables only
        # the LM's last of 6 layers trains when unlocked (1,774,464 weights)
        assert r["frozen_count"] == {"finetune": 0, "unlocked": 22_565_376 - 1_774_464}.get(strategy, 22_565_376), key
        assert r["text_changed"] == (strategy != "frozen"), key  # frozen: only text_proj (outside text.) trains


@pytest.mark.parametrize("strategy", ["frozen_adapters"])
def test_adapters_are_what_trains(strategy):
    model = build_model(load_config(None, [f"model.text_strategy={strategy}"]).model)
    names = [n for n, p in model.text.named_parameters() if p.requires_grad]
    assert len(names) == 6 * 4 and all(".adapter." in n for n in names)
