"""A model whose weights are loaded is built without a random init first (rayvl.models.meta_init): the same model,
none of the init's work."""
from __future__ import annotations

import pytest
import torch

from conftest import REPO, untrained_checkpoint


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=g),
            torch.randint(0, 1000, (2, 8), generator=g), torch.ones(2, 8, dtype=torch.long))


def test_a_model_built_from_a_state_is_the_model_that_state_came_from_and_draws_no_random_init():
    from rayvl.config import load_config
    from rayvl.models.dual_encoder import DualEncoder, build_model

    # a frozen LM with alignment layers: frozen and trained parameters, BERT's non-persistent position ids
    cfg = load_config(REPO / "configs" / "laion_adapt.yaml", ["model.alignment_layers=1", "model.embed_dim=64"])
    source = build_model(cfg.model, seed=3).eval()
    state = {k: v.clone() for k, v in source.state_dict().items()}

    torch.manual_seed(11)
    before = torch.get_rng_state()
    built = build_model(cfg.model, seed=0, state=state).eval()
    assert torch.equal(torch.get_rng_state(), before), "a random init ran before the load"

    assert not [n for n, t in [*built.named_parameters(), *built.named_buffers()] if t.is_meta]
    assert built.state_dict().keys() == state.keys()
    assert all(torch.equal(built.state_dict()[k], state[k]) for k in state)
    reference = DualEncoder(cfg.model, pretrained=False)  # the architecture, as it is built without a state
    assert ([(n, p.requires_grad) for n, p in built.named_parameters()]
            == [(n, p.requires_grad) for n, p in reference.named_parameters()])
    theirs = dict(reference.named_buffers())
    unsaved = [name for name, _ in built.named_buffers() if name not in state]
    assert unsaved  # BERT's position ids: computed at the build, in no state
    for name in unsaved:
        assert torch.equal(built.get_buffer(name), theirs[name]), name
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(built(*_inputs()), source(*_inputs())))


def test_a_vision_checkpoint_is_loaded_into_a_backbone_built_without_init(tmp_path):
    from rayvl.compat import import_timm
    from rayvl.models.towers import VisionTower

    torch.manual_seed(5)
    backbone = import_timm().create_model("vit_tiny_patch16_224", pretrained=False)
    half = {k: v.half() for k, v in backbone.state_dict().items()}  # CLIP's release is fp16: loaded as fp32
    torch.save(half, tmp_path / "vit.pt")

    before = torch.get_rng_state()
    tower = VisionTower("vit_tiny_patch16_224", str(tmp_path / "vit.pt"))
    assert torch.equal(torch.get_rng_state(), before)
    for name, tensor in tower.backbone.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, half[name].float()), name


@pytest.mark.slow
def test_an_evaluation_loads_a_final_checkpoint_without_importing_deepspeed(demo_dir, tmp_path):
    """An embedding actor loads a checkpoint's consolidated weights; DeepSpeed's records are only needed for
    DeepSpeed's own files, so it is never imported there."""
    import subprocess
    import sys

    run = untrained_checkpoint(demo_dir, tmp_path)
    code = ("import sys; from rayvl.checkpoints import load_model; from rayvl.eval import embed; "
            f"load_model({str(run)!r}); print(sorted(m for m in ('deepspeed', 'timm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['timm']"
