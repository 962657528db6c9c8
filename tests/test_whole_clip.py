"""A whole pretrained CLIP as the starting point (model.init_from_clip): OpenAI's TorchScript release, open_clip's
checkpoints and a Hugging Face CLIP folder give rayvl the embeddings their own libraries give (small models with
random weights, built by open_clip and transformers in the test: nothing downloaded); what the weights decide is read
from them, a contradicting --set is named; `rayvl eval` scores the CLIP as it is, as open_clip's own embeddings
score on the same images; a run fine-tunes it on the shards and exports it."""
import json
import math
import re
import warnings

import numpy as np
import pytest
import torch

from conftest import run_card_snippet, small_config, tonics_shapes
from rayvl.compat import ensure_torchvision_importable
from rayvl.config import ConfigError, load_config
from rayvl.models.dual_encoder import build_model

ensure_torchvision_importable()  # open_clip and transformers' CLIP import torchvision, as timm does

CAPTIONS = ["a photo of a cat", "A large BLUE ring, to the left of a small red star!", "two green squares", "x"]
EMBED = 64  # small_config's model.embed_dim: the CLIP's, so its --set agrees


def open_clip_model(quick_gelu: bool = False, seed: int = 0, mlp_ratios: tuple[float, float] = (4.0, 4.0)):
    """open_clip's CLIP at toy size (ViT: width 64, 2 layers, patch 8, 32 px; text: width 64, 2 layers, CLIP's
    vocabulary and 77 positions; MLPs ``mlp_ratios`` × width), its LayerNorms moved off their init so that every
    weight matters."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(seed)
    model = CLIP(embed_dim=EMBED, vision_cfg=CLIPVisionCfg(layers=2, width=64, head_width=64, patch_size=8,
                                                           image_size=32, mlp_ratio=mlp_ratios[0]),
                 text_cfg=CLIPTextCfg(context_length=77, vocab_size=49408, width=64, heads=1, layers=2,
                                      mlp_ratio=mlp_ratios[1]),
                 quick_gelu=quick_gelu).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.logit_scale.fill_(3.0)
    return model


def open_clip_embeddings(model, images: np.ndarray, texts: list[str]):
    """open_clip's own: images normalised with CLIP's mean and std, texts through its own tokenizer (77 tokens)."""
    import open_clip

    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        pixels = (torch.from_numpy(images).float() / 255 - mean) / std
        return (model.encode_image(pixels, normalize=True).numpy(),
                model.encode_text(open_clip.get_tokenizer("ViT-B-32")(texts), normalize=True).numpy())


def rayvl_embeddings(source: str, images: np.ndarray, texts: list[str], *sets: str):
    from rayvl import assets
    from rayvl.eval.embed import ModelEmbedder

    cfg = load_config("configs/laion_adapt.yaml", [f"model.init_from_clip={source}", *sets])
    model = build_model(cfg.model).eval()
    embedder = ModelEmbedder(model, str(assets.text_model_path(cfg.model.text)), cfg.data.max_text_tokens)
    return embedder.images(images), embedder.texts(texts), model, cfg


def test_a_whole_clip_saved_each_way_embeds_as_its_own_library(tmp_path, monkeypatch):
    """open_clip's training checkpoint ({"epoch", "state_dict": module.*}), a plain safetensors state dict, OpenAI's
    form (a TorchScript archive: QuickGELU told from it) and a Hugging Face CLIPModel folder: rayvl's image and text
    embeddings and temperature are the source library's (atol 1e-5); the recipe's frozen LM + alignment layers and
    bottleneck adapters start as the CLIP itself; shapes, embedding size and image size come from the weights."""
    from safetensors.torch import save_file

    images = np.random.default_rng(0).integers(0, 256, (5, 3, 32, 32), dtype=np.uint8)
    theirs = open_clip_model()
    want_images, want_texts = open_clip_embeddings(theirs, images, CAPTIONS)
    checkpoint = tmp_path / "epoch_3.pt"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in theirs.state_dict().items()}}, checkpoint)
    plain = tmp_path / "open_clip_model.safetensors"
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(plain))
    for source, sets in ((checkpoint, ["model.text_strategy=finetune"]), (plain, []),  # frozen + 2 alignment layers
                         (checkpoint, ["model.text_strategy=frozen_adapters"])):
        got_images, got_texts, model, cfg = rayvl_embeddings(str(source), images, CAPTIONS, *sets)
        np.testing.assert_allclose(got_images, want_images, atol=1e-5)
        np.testing.assert_allclose(got_texts, want_texts, atol=1e-5)
        assert float(model.scale().detach()) == pytest.approx(float(theirs.logit_scale.detach().exp()), rel=1e-7)
    assert (cfg.model.embed_dim, cfg.data.image_size, cfg.model.vision, cfg.model.text) == (EMBED, 32, "clip", "clip")
    assert (cfg.model.pooling, cfg.model.text_projection, cfg.model.vision_projection) == ("eot", "linear", "linear")
    c = cfg.model.clip
    assert (c.vision_width, c.vision_layers, c.patch_size, c.image_size, c.text_width, c.text_layers,
            c.context_length, c.vocab_size, c.quick_gelu) == (64, 2, 8, 32, 64, 2, 77, 49408, False)

    # OpenAI's release form: a TorchScript archive of a QuickGELU model
    quick = open_clip_model(quick_gelu=True, seed=1)
    openai = tmp_path / "ViT-toy.pt"
    pixels, tokens = torch.ones(2, 3, 32, 32), torch.zeros(2, 77, dtype=torch.long)  # as OpenAI's jit=True files
    # a ZeRO-3 engine built earlier in this process (test_step_census) leaves DeepSpeed's autograd wrapper on
    # F.linear, which a trace cannot record: torch's own linear while tracing
    monkeypatch.setattr(torch.nn.functional, "linear", torch._C._nn.linear)
    with warnings.catch_warnings():  # the tracer's notes on shape checks it records as constants
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.jit.trace_module(quick, {"forward": (pixels, tokens), "encode_text": (tokens,),
                                       "encode_image": (pixels,)}).save(str(openai))
    want_images, want_texts = open_clip_embeddings(quick, images, CAPTIONS)
    got_images, got_texts, model, cfg = rayvl_embeddings(str(openai), images, CAPTIONS)
    assert cfg.model.clip.quick_gelu
    np.testing.assert_allclose(got_images, want_images, atol=1e-5)
    np.testing.assert_allclose(got_texts, want_texts, atol=1e-5)
    # the same weights as a plain file say nothing of their activation: model.clip.quick_gelu, set by hand
    torch.save(quick.state_dict(), tmp_path / "quick.pt")
    got_images, _, _, _ = rayvl_embeddings(str(tmp_path / "quick.pt"), images, CAPTIONS, "model.clip.quick_gelu=true")
    np.testing.assert_allclose(got_images, want_images, atol=1e-5)

    # open_clip's hub folder: open_clip_config.json beside the weights names heads (here 32 wide: two a tower, where
    # the weights alone would give one 64-wide head) and QuickGELU
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(3)
    narrow = CLIP(embed_dim=EMBED, vision_cfg=CLIPVisionCfg(layers=2, width=64, head_width=32, patch_size=8,
                                                            image_size=32),
                  text_cfg=CLIPTextCfg(context_length=77, vocab_size=49408, width=64, heads=2, layers=2),
                  quick_gelu=True).eval()
    hub = tmp_path / "hub"
    hub.mkdir()
    torch.save(narrow.state_dict(), hub / "open_clip_pytorch_model.bin")
    (hub / "open_clip_config.json").write_text(json.dumps({"model_cfg": {
        "embed_dim": EMBED, "quick_gelu": True, "vision_cfg": {"layers": 2, "width": 64, "head_width": 32,
                                                                "patch_size": 8, "image_size": 32},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}}}))
    want_images, want_texts = open_clip_embeddings(narrow, images, CAPTIONS)
    got_images, got_texts, _, cfg = rayvl_embeddings(str(hub / "open_clip_pytorch_model.bin"), images, CAPTIONS)
    c = cfg.model.clip
    assert (c.vision_heads, c.text_heads, c.quick_gelu) == (2, 2, True)
    np.testing.assert_allclose(got_images, want_images, atol=1e-5)
    np.testing.assert_allclose(got_texts, want_texts, atol=1e-5)
    # without a config, the heads open_clip's releases use: 64-wide up to ViT-L, 16 for H, g and bigG
    from rayvl.models.whole_clip import architecture

    meta = {k: torch.empty(shape, device="meta") for k, shape in {
        "visual.conv1.weight": (1280, 3, 14, 14), "visual.positional_embedding": (257, 1280),
        "visual.transformer.resblocks.31.ln_1.weight": (1280,), "visual.proj": (1280, 1024),
        "transformer.resblocks.23.ln_1.weight": (1024,), "ln_final.weight": (1024,), "positional_embedding": (77, 1024),
        "token_embedding.weight": (49408, 1024), "text_projection": (1024, 1024),
        "visual.transformer.resblocks.0.mlp.c_fc.weight": (5120, 1280),
        "transformer.resblocks.0.mlp.c_fc.weight": (4096, 1024)}.items()}
    vit_h = architecture(meta, str(tmp_path / "ViT-H-14.pt"))
    assert (vit_h["vision_heads"], vit_h["text_heads"], vit_h["vision_layers"], vit_h["image_size"]) == (16, 16, 32, 224)
    assert (vit_h["vision_mlp"], vit_h["text_mlp"]) == (5120, 4096)

    # a Hugging Face CLIPModel folder (two 32-wide heads a tower, as its config says), tokenizer included
    from transformers import CLIPConfig, CLIPModel

    from rayvl import assets

    size = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(2)
    hf = CLIPModel(CLIPConfig(text_config=size, vision_config={**size, "image_size": 32, "patch_size": 8},
                              projection_dim=48)).eval()
    folder = tmp_path / "hf-clip"
    hf.save_pretrained(folder)
    for f in assets.clip_tokenizer_dir().iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(folder)(CAPTIONS, padding=True, return_tensors="pt")
    mean, std = torch.tensor(assets_clip_mean()).view(1, 3, 1, 1), torch.tensor(assets_clip_std()).view(1, 3, 1, 1)
    with torch.no_grad():
        want_images = hf.visual_projection(hf.vision_model(
            pixel_values=(torch.from_numpy(images).float() / 255 - mean) / std).pooler_output)
        want_texts = hf.text_projection(hf.text_model(**tokens).pooler_output)
    got_images, got_texts, model, cfg = rayvl_embeddings(str(folder), images, CAPTIONS, "data.max_text_tokens=16")
    assert cfg.model.text == str(folder) and cfg.model.embed_dim == 48 and cfg.model.clip.vision_heads == 2
    np.testing.assert_allclose(got_images, torch.nn.functional.normalize(want_images, dim=-1).numpy(), atol=1e-5)
    np.testing.assert_allclose(got_texts, torch.nn.functional.normalize(want_texts, dim=-1).numpy(), atol=1e-5)


def assets_clip_mean():
    from timm.data import OPENAI_CLIP_MEAN

    return OPENAI_CLIP_MEAN


def assets_clip_std():
    from timm.data import OPENAI_CLIP_STD

    return OPENAI_CLIP_STD


def test_mlps_wider_or_narrower_than_four_widths_are_read_from_the_weights(tmp_path):
    """ViT-g's and bigG's MLPs are not 4 × width (6,144 for 1,408; 8,192 for 1,664): the hidden widths come from the
    weights, for both towers, and the model embeds as open_clip's (atol 1e-5); the open_clip-form config says so."""
    from rayvl.models.whole_clip import open_clip_config

    theirs = open_clip_model(mlp_ratios=(4.5, 2.0))
    path = tmp_path / "wide.pt"
    torch.save(theirs.state_dict(), path)
    images = np.random.default_rng(1).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
    mine_images, mine_texts, _, cfg = rayvl_embeddings(str(path), images, CAPTIONS, "data.max_text_tokens=77")
    assert (cfg.model.clip.vision_mlp, cfg.model.clip.text_mlp) == (288, 128)
    want_images, want_texts = open_clip_embeddings(theirs, images, CAPTIONS)
    np.testing.assert_allclose(mine_images, want_images, atol=1e-5)
    np.testing.assert_allclose(mine_texts, want_texts, atol=1e-5)
    model_cfg = open_clip_config(cfg.model.clip, (0.5,) * 3, (0.5,) * 3)["model_cfg"]
    assert (model_cfg["vision_cfg"]["mlp_ratio"], model_cfg["text_cfg"]["mlp_ratio"]) == (4.5, 2.0)


def test_what_the_weights_decide_is_read_and_a_contradiction_is_named(tmp_path, capsys):
    """A --set that contradicts the CLIP names its key before anything runs; data.image_size may differ (the
    position embeddings are resampled, the model embeds at the new size); heads and QuickGELU may be set by hand;
    a file that is no ViT CLIP, or no file, is named; the dry run says what loads."""
    from conftest import cli

    path = tmp_path / "clip.pt"
    torch.save(open_clip_model().state_dict(), path)
    source = f"model.init_from_clip={path}"
    for wrong, key in (("model.embed_dim=32", "model.embed_dim"), ("model.pooling=avg", "model.pooling"),
                       ("model.text_projection=mlp2", "model.text_projection"),
                       ("model.clip.vision_width=128", "model.clip.vision_width"),
                       (f"model.vision_checkpoint={path}", "model.vision_checkpoint")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
            load_config("configs/laion_adapt.yaml", [source, wrong])
    cfg = load_config("configs/laion_adapt.yaml", [source, "data.image_size=48", "model.clip.text_heads=2"])
    assert cfg.data.image_size == cfg.model.clip.image_size == 48 and cfg.model.clip.text_heads == 2
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        assert model.encode_image(torch.zeros(1, 3, 48, 48, dtype=torch.uint8)).shape == (1, EMBED)
    torch.save({"visual.layer1.0.conv1.weight": torch.zeros(1)}, tmp_path / "rn50.pt")
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pt")
    for bad, says in ((tmp_path / "rn50.pt", "a ResNet image tower"), (tmp_path / "other.pt", "not a CLIP state dict"),
                      (tmp_path / "missing.pt", "does not exist")):
        with pytest.raises(ConfigError, match=f"^model.init_from_clip: .*{says}"):
            load_config("configs/laion_adapt.yaml", [f"model.init_from_clip={bad}"])
    # a released CLIP's temperature is log(100), whose exp lands a hair above CLIP's clamp of 100: loads at 100
    released = open_clip_model()
    with torch.no_grad():
        released.logit_scale.fill_(torch.tensor(100.0).log().item())
    torch.save(released.state_dict(), tmp_path / "released.pt")
    assert load_config(None, [f"model.init_from_clip={tmp_path / 'released.pt'}"]).model.init_logit_scale == 100.0
    # a recipe's own image size and QuickGELU are kept (only the weights' shapes are read), and so is what a config
    # built that way holds when more is set on it, or when its dict is read again
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"model:\n  init_from_clip: {path}\n  clip:\n    quick_gelu: true\ndata:\n  image_size: 48\n")
    mine = load_config(recipe)
    assert (mine.data.image_size, mine.model.clip.image_size, mine.model.clip.quick_gelu) == (48, 48, True)
    from rayvl.config import from_dict, with_overrides

    again = with_overrides(mine, ["train.lr=0.01"])
    assert (again.data.image_size, again.model.clip.quick_gelu, again.train.lr) == (48, True, 0.01)
    assert from_dict(mine.to_dict()) == mine
    unread = from_dict({"model": {"init_from_clip": str(path)}})  # a dict load_config never saw: the CLIP is read
    assert unread.model.vision == "clip" and unread.model.clip.vision_width == 64
    with pytest.raises(ConfigError, match="^data.max_text_tokens: 80, but the CLIP's text transformer has 77"):
        load_config(None, [source, "data.max_text_tokens=80"])
    code, out, err = cli(capsys, "train", "--dry-run", "--set", source)
    assert code == 0, err
    assert f"a whole CLIP, {path}: both towers, both projections (embedding {EMBED})" in out
    assert "image tower clip (CLIP's ViT, width 64, 2 layers, patch 8, 32 px)" in out


def test_a_run_fine_tunes_a_whole_clip_from_the_zero_shot_it_starts_at(ray_local, demo_dir, tmp_path,
                                                                       tonics_counts_path):
    """`rayvl eval` on the open_clip checkpoint as it is scores what open_clip's own embeddings score on the same
    held-out images (zero-shot and retrieval, exactly); a run starts from it — one worker, TOnICS batches, UniCL
    against a memory bank, the recipe's frozen LM + alignment layers — trains and exports it, the export's "use
    without rayvl" code embedding as rayvl.load does."""
    from dataclasses import replace

    from rayvl import assets
    from rayvl.cli import main
    from rayvl.eval import data as datasets
    from rayvl.eval import tasks as eval_tasks

    theirs = open_clip_model()
    path = tmp_path / "epoch_3.pt"
    torch.save({"epoch": 3, "state_dict": theirs.state_dict()}, path)
    out = tmp_path / "eval"
    assert main(["eval", str(path), "--tasks", "zeroshot,retrieval", "--data", str(demo_dir / "eval"),
                 "--classes", str(demo_dir / "classes.json"), "--out", str(out)]) == 0
    scored = json.loads((out / "eval.json").read_text())
    assert scored["step"] == 0 and scored["checkpoint"] == str(path)

    data = datasets.load_shards(str(demo_dir / "eval"), 32, str(assets.text_model_path("clip")), 16, 0.5)
    rows = sorted(data.images.take_all(), key=lambda r: r["key"])
    data = replace(data, images=np.stack([r["image"] for r in rows])).with_rows(
        {c: [r[c] for r in rows] for c in ("key", "caption", "cls")}).with_text_sets(
        str(demo_dir / "classes.json"), "", "")

    class OpenClip:  # open_clip's own embeddings of the same rows
        def images(self, images):
            return open_clip_embeddings(theirs, images, ["x"])[0]

        def texts(self, texts):
            return open_clip_embeddings(theirs, np.zeros((1, 3, 32, 32), np.uint8), list(texts))[1]

    theirs_scored, _ = eval_tasks.evaluate(["zeroshot", "retrieval"], data, OpenClip())
    for task in ("zeroshot", "retrieval"):
        assert scored[task] == pytest.approx(theirs_scored[task], abs=1e-6), task

    # open_clip's budget in epochs and its const-cooldown schedule: 0.0625 of the demo's 384 samples a pass is 3
    # steps of one worker × 8 (two ranks drawing TOnICS batches: test_tonics); constant, then a linear cooldown over
    # the last 2 steps
    cfg = small_config(demo_dir, tmp_path, f"model.init_from_clip={path}", "memory_bank.size=32", "loss.kind=unicl",
                       *tonics_shapes(f"tonics.counts_path={tonics_counts_path}"), "eval.tasks=[zeroshot]",
                       "train.max_steps=1000", "train.max_passes=0.0625", "train.num_workers=1",
                       "train.lr_schedule=constant_cooldown",
                       "train.cooldown_steps=2")
    import rayvl

    result = rayvl.train(cfg)  # the Python API: the package called as a function
    history = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3] and all(np.isfinite(h["loss"]) for h in history)
    assert [h["lr"] for h in history] == pytest.approx([1e-3, 5e-4, 0.0])  # the LR each step's update used next
    assert history[0]["logit_scale"] == pytest.approx(float(theirs.logit_scale.detach().exp()), rel=1e-2)  # CLIP's own
    state = torch.load(result.checkpoint_dir + "/model.pt")
    assert "text.lm.encoder.layers.1.self_attn.q_proj.weight" in state and "text.alignment.0.mlp.fc2.weight" in state
    assert torch.equal(state["text.lm.encoder.layers.1.mlp.fc1.weight"],  # the frozen LM is CLIP's, bit for bit
                       theirs.state_dict()["transformer.resblocks.1.mlp.c_fc.weight"])
    assert "zeroshot_top1" in result.metrics and "tonics_p_root" in history[-1]

    export = tmp_path / "export"
    assert main(["export", str(result.run_dir), "--out", str(export)]) == 0
    exported = rayvl.load(export)
    card = (export / "README.md").read_text()
    (snippet,) = re.findall(r"## Use without rayvl\n\n```python\n(.*?)```", card, re.S)
    namespace = run_card_snippet(snippet, export)
    np.testing.assert_allclose(namespace["model"].encode_text(CAPTIONS).numpy(),
                               exported.encode_text(CAPTIONS).numpy(), atol=1e-5)
    photos = [str(export / "cat.jpg"), str(export / "dog.jpg")]
    np.testing.assert_allclose(namespace["images"].numpy(), exported.encode_image(photos).numpy(), atol=1e-5)


def test_every_row_of_the_readmes_coming_from_open_clip_table_loads(tmp_path):
    """Each rayvl setting of the README's open_clip table, its placeholders filled (FILE: an open_clip checkpoint),
    is a config that loads — the settings of a row together."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("## Coming from open_clip", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[-1] for line in table.splitlines() if line.startswith("| `")]
    path = tmp_path / "clip.pt"
    torch.save(open_clip_model().state_dict(), path)
    fill = {"model.vision": "vit_base_patch32_clip_224", "model.embed_dim": "512"}
    loaded = 0
    for row in rows:
        sets = [s for s in re.findall(r"`([a-z_]+\.[a-z_.]+=[^`]*)`", row)]
        sets = [re.sub(r"<[^>]*>", lambda _, k=s.split("=")[0]: fill[k], s).replace("FILE", str(path)) for s in sets]
        if sets:
            load_config("configs/laion_adapt.yaml", sets)
            loaded += 1
    assert loaded >= 9 and any("model.init_from_clip" in r for r in rows)


def test_an_export_of_a_whole_clip_loads_in_open_clip(tmp_path):
    """A whole CLIP trained without adapters or alignment layers (here: weights moved off the source, SigLIP's bias,
    QuickGELU) exports in open_clip's form too: `open_clip.create_model_and_transforms("local-dir:<export>")` and
    its tokenizer embed as rayvl.load does (atol 1e-5), with the same temperature and bias; the card shows how."""
    import open_clip

    import rayvl
    from rayvl.checkpoints import META_FILE, MODEL_FILE
    from rayvl.export import export

    source = tmp_path / "quick.pt"
    torch.save(open_clip_model(quick_gelu=True).state_dict(), source)
    cfg = load_config("configs/laion_adapt.yaml", [f"model.init_from_clip={source}", "model.clip.quick_gelu=true",
                                                   "model.text_strategy=finetune", "loss.kind=siglip"])
    checkpoint = tmp_path / "run" / "checkpoint_000"
    checkpoint.mkdir(parents=True)
    model = build_model(cfg.model)
    with torch.no_grad():  # as training moves them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    torch.save(model.state_dict(), checkpoint / MODEL_FILE)
    (checkpoint / META_FILE).write_text(json.dumps({"step": 7, "config": cfg.to_dict(), "final": True}))
    out = export(str(checkpoint), tmp_path / "export")
    theirs, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    assert open_clip.get_tokenizer(f"local-dir:{out}")(["a cat"]).shape == (1, 77)
    mine = rayvl.load(out)
    images = np.random.default_rng(0).integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
    want_images, want_texts = open_clip_embeddings(theirs.eval(), images, CAPTIONS)
    np.testing.assert_allclose(mine.encode_image(images).numpy(), want_images, atol=1e-5)
    np.testing.assert_allclose(mine.encode_text(CAPTIONS).numpy(), want_texts, atol=1e-5)
    assert mine.logit_scale() == pytest.approx(float(theirs.logit_scale.detach().exp()), rel=1e-6)
    assert mine.logit_bias() == pytest.approx(float(theirs.logit_bias.detach()), rel=1e-6)
    card = (out / "README.md").read_text()
    assert f'create_model_and_transforms("local-dir:{out}")' in card
    # SigLIP's card: probabilities, the bias added — in rayvl's lines and in the code without rayvl
    assert card.count("match = (model.logit_scale() * images @ texts.T + model.logit_bias()).sigmoid()") == 2
    (snippet,) = re.findall(r"## Use without rayvl\n\n```python\n(.*?)```", card, re.S)
    standalone = run_card_snippet(snippet, out)["model"]
    assert standalone.logit_bias() == pytest.approx(mine.logit_bias(), rel=1e-6)


def test_a_whole_clip_trains_as_open_clip_trains_it(tmp_path):
    """What fine-tuning a released CLIP changes, against open_clip's own code on the same weights: its temperature
    at the clamp gets exp(s)'s gradient (open_clip clamps the parameter after each step, so its gradient always
    acts); captions go to the whole context (77 tokens), cleaned as open_clip's tokenizer cleans them; the
    locked towers' trainable parameters are open_clip's for each unlocked count (a whole CLIP's projection is its
    last group); weight decay falls on open_clip's parameters (not on the class token)."""
    import open_clip

    from rayvl import assets
    from rayvl.data.text import clip_cleaned, tokenize
    from rayvl.models.dual_encoder import capped_exp, param_groups

    released = open_clip_model()
    with torch.no_grad():  # OpenAI's files hold log(100) in fp16: 4.60546875, a hair above the clamp
        released.logit_scale.fill_(torch.tensor(100.0).log().half().float().item())
    path = tmp_path / "released.pt"
    torch.save(released.state_dict(), path)
    source = f"model.init_from_clip={path}"
    cfg = load_config("configs/clip_finetune.yaml", [source])  # the recipe of open_clip's fine-tune
    model = build_model(cfg.model)
    # every parameter trains, as in open_clip's (nothing locked), and only the CLIP's: nothing appended
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == sum(
        p.numel() for p in released.parameters())
    with pytest.raises(ConfigError, match=r"^model\.init_from_clip: the clip_finetune recipe needs it: the whole "
                                          r"CLIP to fine-tune \(--set model\.init_from_clip=FILE"):
        load_config("configs/clip_finetune.yaml", ["model.text_strategy=finetune"])
    assert float(model.scale().detach()) == 100.0
    model.scale().backward()  # a descent step lowers s: the gradient acts, as open_clip's does
    theirs_grad = float(released.logit_scale.detach().exp())  # d exp(s)/ds, open_clip's forward without a clamp
    assert float(model.logit_scale.grad) == pytest.approx(theirs_grad, rel=1e-3)
    s = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)  # below the clamp: exp's own gradient
    (capped_exp(s, 100.0) * 2.0).sum().backward()
    assert float(s.grad) == pytest.approx(2.0 * math.exp(3.0), rel=1e-15)
    # (the clamp after each step, which undoes a rise: tests/test_step_census.py, under DeepSpeed)

    # the whole context, unless a --set or the recipe says fewer
    assert cfg.data.max_text_tokens == 77
    assert load_config("configs/laion_adapt.yaml", [source, "data.max_text_tokens=32"]).data.max_text_tokens == 32
    recipe = tmp_path / "short.yaml"
    recipe.write_text(f"model:\n  init_from_clip: {path}\ndata:\n  max_text_tokens: 40\n")
    assert load_config(recipe).data.max_text_tokens == 40
    # open_clip's tokenizer's ids for captions its clean-up changes (up to the end of text: it pads with 0)
    messy = ["cats &amp; dogs &quot;inside&quot;", "don’t stop", "ﬁsh on a plate", "a cafÃ© in Paris",
             "tabs\tand  spaces", "&lt;b&gt;bold&lt;/b&gt;", "a photo of a cat"]
    ids, mask = tokenize(messy, str(assets.text_model_path("clip")), 77)
    want = open_clip.get_tokenizer("ViT-B-32")(messy).numpy()
    np.testing.assert_array_equal(np.where(mask == 1, ids, 0), want)
    assert clip_cleaned("a photo of a cat") == "a photo of a cat" and clip_cleaned("&amp;") == "&"

    # trainable parameters of the locked towers: open_clip's lock_image_tower / lock_text_tower, for each count
    def trainable(module) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    for n in (0, 1, 2):
        theirs = open_clip_model()
        theirs.lock_image_tower(unlocked_groups=n)
        theirs.lock_text_tower(unlocked_layers=n)
        mine = build_model(load_config("configs/laion_adapt.yaml", [
            source, "model.vision_strategy=frozen", f"model.vision_unlocked_groups={n}",
            "model.text_strategy=frozen", f"model.text_unlocked_layers={n}"]).model)
        assert trainable(mine.vision) + trainable(mine.vision_proj) == trainable(theirs.visual), n
        text_theirs = sum(p.numel() for name, p in theirs.named_parameters()
                          if p.requires_grad and not name.startswith(("visual.", "logit_")))
        assert trainable(mine.text) + trainable(mine.text_proj) == text_theirs, n
    with pytest.raises(ConfigError, match=r"^model\.vision_unlocked_groups: the image tower has 4 layer groups "
                                          r"\(its projection the last\); unlocking 4"):
        build_model(load_config("configs/laion_adapt.yaml", [source, "model.vision_strategy=frozen",
                                                             "model.vision_unlocked_groups=4"]).model)

    # a run with a locked tower written before the projection was locked with it: refused, naming the key
    from rayvl.checkpoints import DECAY_RULE
    from rayvl.train.run_dir import check_resumable

    locked = load_config("configs/laion_adapt.yaml", [source, "model.vision_strategy=frozen"])
    before = {"step": 3, "config": locked.to_dict()}
    with pytest.raises(ConfigError, match=r"^model\.vision_strategy: frozen: a whole CLIP's projection is now locked"):
        check_resumable(locked, before, "RUN")
    check_resumable(locked, {**before, DECAY_RULE: 2}, "RUN")  # a checkpoint of this rayvl
    check_resumable(cfg, {"step": 3, "config": cfg.to_dict()}, "RUN")  # nothing locked: the same parameters train
    with pytest.raises(ConfigError, match=r"^model\.patch_dropout: .*a whole CLIP's projection alone unlocked"):
        load_config("configs/laion_adapt.yaml", [source, "model.vision_strategy=frozen",
                                                 "model.vision_unlocked_groups=1", "model.patch_dropout=0.5"])
    with pytest.raises(ConfigError, match=r"^model\.learn_logit_scale: a whole CLIP locked in both towers"):
        load_config("configs/laion_adapt.yaml", [source, "model.vision_strategy=frozen", "model.text_strategy=frozen",
                                                 "model.learn_logit_scale=false"])

    # weight decay: open_clip's rule (open_clip_train/main.py: no decay where ndim < 2, "bn", "ln", "bias" or
    # "logit_scale" in the name) over its CLIP, against rayvl's groups over the same CLIP, by elements
    def decayed_theirs(name, p) -> bool:
        return not (p.ndim < 2 or any(k in name for k in ("bn", "ln", "bias", "logit_scale")))

    decay, no_decay = param_groups(model, 0.2)
    assert sum(p.numel() for p in decay["params"]) == sum(
        p.numel() for name, p in released.named_parameters() if decayed_theirs(name, p))
    assert any(p is model.vision.backbone.cls_token for p in no_decay["params"])


def test_a_whole_clip_on_object_storage_is_copied_once_a_node_and_a_local_one_is_refused_on_a_cluster(
        s3, tmp_path, monkeypatch):
    """On a cluster every worker reads model.init_from_clip: a weights file on object storage is copied into each
    node's download cache once and read from there; a path on the driver's disk is refused before Ray starts on a
    cluster of several nodes (or one whose autoscaler may add some), unless it is on a shared mount. An image
    tower's model.vision_checkpoint goes the same way."""
    from rayvl import storage
    from rayvl.models import whole_clip
    from rayvl.session import check_storage

    monkeypatch.setenv("RAYVL_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "clip.pt"
    torch.save(open_clip_model().state_dict(), local)
    url = "s3://rayvl-test/models/clip.pt"
    storage.write_bytes(url, local.read_bytes())
    cfg = load_config("configs/clip_finetune.yaml", [f"model.init_from_clip={url}",
                                                     "train.storage_path=s3://rayvl-test/runs"])
    assert cfg.model.clip.vision_width == 64 and cfg.data.max_text_tokens == 77
    copy = whole_clip.local(url)
    assert copy.read_bytes() == local.read_bytes() and str(copy).startswith(str(tmp_path / "cache"))
    assert whole_clip.local(url) == copy  # the node's copy, not fetched again
    mine = build_model(cfg.model).state_dict()
    theirs = build_model(load_config("configs/clip_finetune.yaml",
                                     [f"model.init_from_clip={local}"]).model).state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    # open_clip's hub folder: its open_clip_config.json beside the weights says QuickGELU, and comes with them
    storage.write_bytes("s3://rayvl-test/models/open_clip_config.json",
                        json.dumps({"model_cfg": {"quick_gelu": True}}).encode())
    assert load_config("configs/clip_finetune.yaml", [f"model.init_from_clip={url}"]).model.clip.quick_gelu
    storage.write_bytes(url, b"replaced")  # an object replaced at its URL is copied again: every node reads one file
    assert whole_clip.local(url).read_bytes() == b"replaced"
    check_storage(cfg, nodes=3)  # every node reaches it
    on_driver = load_config("configs/clip_finetune.yaml", [f"model.init_from_clip={local}",
                                                           "train.storage_path=s3://rayvl-test/runs"])
    check_storage(on_driver, nodes=1)
    with pytest.raises(ConfigError, match=r"^model\.init_from_clip: 'file://"):  # a URL of this machine's disk
        check_storage(load_config("configs/clip_finetune.yaml", [f"model.init_from_clip=file://{local}",
                                                                 "train.storage_path=s3://rayvl-test/runs"]), nodes=3)
    for nodes, grows in ((3, False), (1, True)):
        with pytest.raises(ConfigError, match=r"^model\.init_from_clip: .* on this machine's disk, but the cluster"):
            check_storage(on_driver, nodes=nodes, grows=grows)
    check_storage(load_config("configs/clip_finetune.yaml", [f"model.init_from_clip={local}",
                                                             "train.shared_storage=true"]), nodes=3)
    with pytest.raises(ConfigError, match=r"^model\.init_from_clip: .*a Hugging Face CLIP folder must be a local"):
        whole_clip.local("s3://rayvl-test/models/hf-clip/")

    from rayvl.assets import MissingAssetError, vision_state_dict

    tower = {"blocks.0.weight": torch.arange(6.0)}
    torch.save(tower, tmp_path / "tower.pt")
    storage.write_bytes("s3://rayvl-test/models/tower.pt", (tmp_path / "tower.pt").read_bytes())
    read = vision_state_dict("vit_tiny_patch16_224", "s3://rayvl-test/models/tower.pt")
    assert list(read) == list(tower) and torch.equal(read["blocks.0.weight"], tower["blocks.0.weight"])
    with pytest.raises(MissingAssetError, match=r"^model\.vision_checkpoint: 's3://rayvl-test/models/no.pt' does"):
        vision_state_dict("vit_tiny_patch16_224", "s3://rayvl-test/models/no.pt")
    with pytest.raises(ConfigError, match=r"^model\.vision_checkpoint: .* on this machine's disk, but the cluster"):
        check_storage(load_config("configs/laion_adapt.yaml", [f"model.vision_checkpoint={tmp_path / 'tower.pt'}",
                                                               "train.storage_path=s3://rayvl-test/runs"]), nodes=3)
