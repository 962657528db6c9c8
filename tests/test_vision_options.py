"""The image tower's options open_clip users reach for: patch dropout (FLIP, Li et al. 2023, arXiv:2212.00794) on a
ViT — fewer tokens in training, all of them at evaluation, the saving in the FLOPs the MFU is made of — and a locked
image tower (LiT, Zhai et al. 2022, arXiv:2111.07991): no gradient, no graph, statistics as they were. The locked
tower over a whole run: test_training's ZeRO-1 run, whose backbone ends bit for bit as it started."""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rayvl.config import ConfigError, load_config
from rayvl.models.dual_encoder import build_model, param_groups
from rayvl.train.datasets import check_inputs
from rayvl.train.flops import model_flops_per_sample

VIT = ["model.vision=vit_tiny_patch16_224", "data.image_size=224"]  # 14 × 14 patches + the class token


def _vision_flops(model, images) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.vision(images)
    return counter.get_total_flops()


@pytest.mark.slow
def test_patch_dropout_drops_tokens_in_training_only_and_the_flops_count_what_is_computed():
    cfg = load_config(None, [*VIT, "model.patch_dropout=0.5"]).model
    model, plain = build_model(cfg), build_model(dataclasses.replace(cfg, patch_dropout=0.0))
    plain.load_state_dict(model.state_dict())  # the same weights, with and without the dropout
    tokens = []
    model.vision.backbone.blocks[0].register_forward_hook(lambda m, args, out: tokens.append(args[0].shape[1]))
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    model.train()
    first = model.encode_image(images)
    second = model.encode_image(images)
    model.eval()
    plain.eval()
    with torch.no_grad():
        evaluated = model.encode_image(images)
        np_ = plain.encode_image(images)
    assert tokens == [1 + 98, 1 + 98, 197]  # half the patches (the class token kept) while training; all at eval
    assert not torch.allclose(first, second)  # other patches each forward
    torch.testing.assert_close(evaluated, np_)  # evaluation is the plain tower
    model.train()
    dropped, full = _vision_flops(model, images[:1]), _vision_flops(plain, images[:1])
    assert 0.4 < dropped / full < 0.55  # the blocks see 99 of 197 tokens (attention's quadratic part saves more)
    # the MFU's FLOPs per sample count the tokens the training forward keeps, forward and backward
    trained = model_flops_per_sample(model, 224, 16)
    saved = model_flops_per_sample(plain, 224, 16) - trained
    assert saved > 2 * (full - dropped)
    # a memory bank's EMA key encoders run as at evaluation: one more forward, of every token
    keys = model_flops_per_sample(model, 224, 16, key_encoders=True) - trained
    assert keys == model_flops_per_sample(plain, 224, 16, key_encoders=True) - model_flops_per_sample(plain, 224, 16)
    assert model.training and all(m.training for m in model.modules() if type(m).__name__ == "PatchDropout")


def test_a_locked_image_tower_takes_no_gradient_and_keeps_its_statistics():
    model = build_model(load_config(None, ["model.vision_strategy=frozen"]).model)  # EfficientNet-Lite0: BatchNorm
    assert not any(m.training for m in model.vision.backbone.modules())  # as built: a run never calls train() first
    model.train()
    backbone = set(model.vision.backbone.parameters())
    assert not any(p.requires_grad for p in backbone)
    assert not backbone & {p for g in param_groups(model, 0.1) for p in g["params"]}  # nothing of it reaches AdamW
    before = {k: v.clone() for k, v in model.vision.state_dict().items()}
    images = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8)
    assert model.vision(images).grad_fn is None  # no graph through the locked tower
    model.encode_image(images).sum().backward()
    assert model.vision_proj.weight.grad is not None  # its projection into the shared space trains
    assert all(torch.equal(v, model.vision.state_dict()[k]) for k, v in before.items())  # running statistics too


@pytest.mark.parametrize("overrides, message", [
    (["model.patch_dropout=0.5"], "model.patch_dropout: drops a ViT's patch tokens; model.vision='efficientnet"),
    ([*VIT, "model.vision_strategy=frozen"], "model.vision_strategy: frozen locks the image tower, but"),
    ([*VIT, "model.patch_dropout=1.0"], "model.patch_dropout: a share of the patch tokens, in [0, 1)"),
    ([*VIT, "model.patch_dropout=0.5", "model.vision_strategy=frozen", "model.vision_checkpoint=x.pt"],
     "model.patch_dropout: a locked image tower runs as at evaluation"),
])
def test_what_the_image_tower_cannot_do_is_refused_before_ray_starts(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_inputs(load_config(None, overrides), "", "")
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.slow
def test_a_fresh_process_refuses_patch_dropout_on_a_cnn_in_one_line():
    """As a new user meets it (issue 56): in a process that has not imported timm, the check imports it as the rest
    of rayvl does (rayvl.compat) — before, torchvision's CUDA build over a CPU torch raised a traceback there."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rayvl.cli", "train", "--dry-run", "--set", "model.patch_dropout=0.5"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("rayvl: error: model.patch_dropout: drops a ViT's patch")


def test_an_open_clip_checkpoint_gives_rayvl_open_clips_image_embedding(tmp_path, caplog):
    """A checkpoint saved by open_clip itself (ViT-B-32, random init: nothing downloaded) starts rayvl's image tower
    and projection: rayvl's image embedding of uint8 images is open_clip's of the same images, normalised as open_clip
    normalises them. A projection width other than model.embed_dim is refused before Ray starts, naming the key."""
    from rayvl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()  # open_clip imports torchvision, as timm does
    import open_clip

    torch.manual_seed(0)
    theirs = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    path = tmp_path / "vit_b32_open_clip.pt"
    torch.save(theirs.state_dict(), path)
    clip = ["model.vision=vit_base_patch32_clip_224", "data.image_size=224", f"model.vision_checkpoint={path}",
            "model.vision_projection=linear"]
    with pytest.raises(ConfigError, match="^model.embed_dim: the CLIP checkpoint .* projects images to 512"):
        check_inputs(load_config(None, clip), "", "")
    cfg = load_config(None, [*clip, "model.embed_dim=512"])
    with caplog.at_level("INFO", logger="rayvl"):
        check_inputs(cfg, "", "")  # the driver, before any worker: what loads, on the console
    assert (f"model.vision_checkpoint {path}: a CLIP checkpoint — 152 image-transformer keys mapped to 151 timm keys "
            f"(missing 0; unexpected 0), visual.proj → vision_proj") in caplog.text
    ours = build_model(cfg.model).eval()
    images = torch.randint(0, 256, (3, 3, 224, 224), dtype=torch.uint8)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = theirs.encode_image((images.float() / 255 - mean) / std, normalize=True)
        got = ours.encode_image(images)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_a_clip_checkpoint_for_another_architecture_is_refused_before_ray_starts(tmp_path):
    """open_clip's ViT-B-32 (saved as its distributed training saves it, keys under module.) named for timm's plain
    ViT-B/32 (no pre-norm, as CLIP's has) or a wider one: refused naming model.vision, before any worker would fail on
    a strict load. (A patch-size change is timm's to make: its converter resamples the patch embedding.)"""
    from rayvl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    import open_clip

    state = {f"module.{k}": v for k, v in open_clip.create_model("ViT-B-32", pretrained=None).state_dict().items()}
    path = tmp_path / "ddp.pt"
    torch.save(state, path)
    common = [f"model.vision_checkpoint={path}", "data.image_size=224", "model.embed_dim=512",
              "model.vision_projection=linear"]
    check_inputs(load_config(None, ["model.vision=vit_base_patch32_clip_224", *common]), "", "")  # module. read
    for other in ("vit_base_patch32_224", "vit_large_patch14_clip_224"):
        with pytest.raises(ConfigError, match=f"^model.vision: '{other}' is not the architecture") as refused:
            check_inputs(load_config(None, [f"model.vision={other}", *common]), "", "")
        # the way out reads the architecture from the weights, not a name the user may already have given
        assert str(refused.value).endswith(f"set model.init_from_clip={path} instead, which reads the architecture "
                                           f"from the weights (both towers)")


def test_open_clips_partial_unlocking_trains_the_last_groups_and_layers_only(tmp_path, capsys):
    """open_clip's --lock-image-unlocked-groups / --lock-image-freeze-bn-stats / --lock-text-unlocked-layers as
    model.vision_unlocked_groups, model.vision_freeze_bn_stats, model.text_unlocked_layers: exactly the last timm
    groups and LM layers (a CLIP's final LayerNorm with them) get gradients; after an optimizer step in training mode
    every locked weight is as it was; the locked groups' BatchNorm statistics move unless frozen (open_clip's
    semantics); settings that cannot apply are refused naming the key."""
    from conftest import cli
    from rayvl.compat import import_timm

    group_parameters = import_timm().models.group_parameters

    def step(model):
        model.train()
        trained = [p for p in model.parameters() if p.requires_grad]
        before = {k: v.clone() for k, v in model.state_dict().items()}
        images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
        ids, mask = torch.randint(1000, 2000, (4, 8)), torch.ones(4, 8, dtype=torch.long)
        image, text, _ = model(images, ids, mask)[:3]
        (image @ text.T).sum().backward()
        torch.optim.SGD(trained, lr=0.1).step()
        return {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}

    for freeze in (True, False):
        cfg = load_config(None, ["model.vision_strategy=frozen", "model.vision_unlocked_groups=2",
                                 f"model.vision_freeze_bn_stats={str(freeze).lower()}", "model.text_strategy=frozen",
                                 "model.text_unlocked_layers=1", "data.image_size=32"]).model
        model = build_model(cfg)
        backbone = model.vision.backbone
        groups = group_parameters(backbone, backbone.group_matcher())
        unlocked = {n for g in sorted(groups)[-2:] for n in groups[g]}
        assert {n for n, p in backbone.named_parameters() if p.requires_grad} == unlocked
        assert {n for n, p in model.text.lm.named_parameters() if p.requires_grad} == {
            n for n, _ in model.text.lm.named_parameters() if n.startswith("encoder.layer.5.")}
        changed = step(model)
        weights = {f"vision.backbone.{n}" for n, _ in backbone.named_parameters()}
        assert {k for k in changed if k in weights} == {f"vision.backbone.{n}" for n in unlocked}
        stats = {k for k in changed if k.startswith("vision.backbone.bn1.running_")}  # the stem: locked
        assert stats == (set() if freeze else {"vision.backbone.bn1.running_mean", "vision.backbone.bn1.running_var"})
        assert not any(k.startswith("text.lm.") and ".layer.5." not in k for k in changed)

    from test_whole_clip import open_clip_model

    path = tmp_path / "clip.pt"
    torch.save(open_clip_model().state_dict(), path)
    # a whole CLIP counts as open_clip counts its own towers: the projection is the last group, so 2 is the
    # projection and, before it, the last block with the final norm (timm's last group of a ViT)
    cfg = load_config(None, [f"model.init_from_clip={path}", "model.text_strategy=frozen",
                             "model.text_unlocked_layers=2", "model.vision_strategy=frozen",
                             "model.vision_unlocked_groups=2"]).model
    model = build_model(cfg)
    assert {n for n, p in model.text.lm.named_parameters() if p.requires_grad} == {
        n for n, _ in model.text.lm.named_parameters() if n.startswith(("encoder.layers.1.", "final_layer_norm."))}
    assert {n for n, p in model.vision.backbone.named_parameters() if p.requires_grad} == {
        n for n, _ in model.vision.backbone.named_parameters() if n.startswith(("blocks.1.", "norm."))}
    assert model.vision_proj.weight.requires_grad and model.text_proj.weight.requires_grad

    for sets, key in ((["model.vision_unlocked_groups=1"], "model.vision_unlocked_groups"),
                      (["model.text_strategy=finetune", "model.text_unlocked_layers=1"], "model.text_unlocked_layers"),
                      (["model.vision_strategy=frozen", "model.vision_freeze_bn_stats=true"],
                       "model.vision_freeze_bn_stats")):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            load_config(None, sets)
    code, out, err = cli(capsys, "train", "--dry-run", "--set", "model.vision_strategy=frozen", "--set",
                         "model.vision_unlocked_groups=40")
    assert code == 2 and "model.vision_unlocked_groups: the image tower has 17 layer groups" in err
