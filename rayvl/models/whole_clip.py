"""A whole pretrained CLIP as the starting point (``model.init_from_clip``): both towers, both projections and the
temperature of CLIP (Radford et al. 2021, "Learning Transferable Visual Models From Natural Language Supervision",
arXiv:2103.00020) as OpenAI released it, as open_clip (Ilharco et al. 2021; Cherti et al. 2023, arXiv:2212.07143)
saves it, or as a Hugging Face ``CLIPModel`` folder.

Every source is read into one layout, OpenAI's (``visual.*`` for the image transformer and its projection
``visual.proj``; ``token_embedding``, ``positional_embedding``, ``transformer.resblocks.*``, ``ln_final`` and
``text_projection`` for the text transformer; ``logit_scale``). From there the image transformer is timm's CLIP ViT
(timm's own converter renames it: ``rayvl.models.clip_checkpoint``) and the text transformer Hugging Face's
``CLIPTextModel`` (renamed here): causal attention, pooled at the end-of-text token as CLIP pools it. The shapes come
from the weights (widths, depths, patch, grid, context length, vocabulary, embedding size); what the weights cannot
say — the attention heads (CLIP's are 64 wide) and QuickGELU (OpenAI's releases use it, open_clip's own models
mostly do not) — from the source where it says so (a TorchScript release is OpenAI's; an HF config names both), else
from ``model.clip`` as set by hand.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from rayvl.errors import ConfigError
from rayvl.models import clip_checkpoint

KEY = "model.init_from_clip"
HEAD_WIDTH = 64  # CLIP's attention heads: width // 64 in both towers (OpenAI's and open_clip's configs)
# OpenAI's tokenizer: <|startoftext|> and <|endoftext|> are the vocabulary's last two ids
EOT_ID = 49407
# the timm CLIP ViT whose arguments (pre-norm, LayerNorm eps 1e-5, class token, CLIP's mean and std) every size
# shares; its sizes are replaced by the checkpoint's
TIMM_BASE = "vit_base_patch16_clip_224"
# one residual block's parameters: OpenAI's names ↔ Hugging Face's (the attention's in_proj is split into q, k, v)
_BLOCK = (("attn.out_proj.", "self_attn.out_proj."), ("ln_1.", "layer_norm1."), ("ln_2.", "layer_norm2."),
          ("mlp.c_fc.", "mlp.fc1."), ("mlp.c_proj.", "mlp.fc2."))
_BLOCKS = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)")


# ----------------------------------------------------------------------------- reading

WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
OPEN_CLIP_CONFIG = "open_clip_config.json"  # beside the weights in open_clip's hub folders


def local(source: str) -> Path:
    """The CLIP's path on this machine: a local path as it is; a weights file on object storage (``s3://``,
    ``gs://``: what every node of a cluster reads) copied once a node into rayvl's download cache. A Hugging Face
    folder is read where it is: a local path, or a mount every node shares."""
    from rayvl import storage

    if not storage.is_url(source):
        return Path(source).expanduser()
    if not source.split("?", 1)[0].endswith(WEIGHT_SUFFIXES):  # an https URL's query (?download=true) aside
        raise ConfigError(f"{KEY}: {source!r}: on object storage rayvl reads a CLIP's weights file "
                          f"({', '.join(WEIGHT_SUFFIXES)}); a Hugging Face CLIP folder must be a local path or on a "
                          f"mount every node shares")
    try:
        path = storage.download_file(source)
        # open_clip's hub folders say the heads and QuickGELU in open_clip_config.json beside the weights
        # (architecture reads it there): copied with them where the storage has one
        beside = storage.join(storage.parent(source), OPEN_CLIP_CONFIG)
        if storage.is_file(beside):
            copy = storage.download_file(beside)
            if not (path.parent / OPEN_CLIP_CONFIG).is_file() or (path.parent / OPEN_CLIP_CONFIG).read_bytes() != \
                    copy.read_bytes():
                (path.parent / OPEN_CLIP_CONFIG).write_bytes(copy.read_bytes())
        return path
    except (OSError, ValueError) as e:
        raise ConfigError(f"{KEY}: cannot read {source!r}: {' '.join(str(e).split())}") from None


def read(source: str) -> dict:
    """The whole CLIP at ``source`` (a path, or a weights file's URL: ``local``) as an OpenAI-layout state dict
    (tensors memory-mapped where the format allows)."""
    return _read(local(source), source)


def _read(path: Path, source: str) -> dict:
    """``read`` of the CLIP's copy on this machine (``local``'s)."""
    if path.is_dir():
        return from_hugging_face(path)
    if not path.is_file():
        raise ConfigError(f"{KEY}: {source!r} does not exist (an OpenAI .pt, an open_clip checkpoint or a Hugging "
                          f"Face CLIP folder)")
    return _checked(_unwrapped(_load(path)), source)


def is_source(path: str | Path) -> bool:
    """A whole CLIP on this machine (what ``rayvl eval`` takes beside rayvl checkpoints: the starting point's own
    scores): a Hugging Face CLIP folder, or a weights file (a rayvl checkpoint is a folder)."""
    if "://" in str(path):
        return False
    path = Path(path).expanduser()
    if path.is_dir():
        try:
            return json.loads((path / "config.json").read_text()).get("model_type") == "clip"
        except (OSError, ValueError):
            return False
    return path.is_file() and path.suffix in (".pt", ".pth", ".bin", ".safetensors")


def is_torchscript(path: Path) -> bool:
    """OpenAI's released files are TorchScript archives (their zip holds ``code/``)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return any("/code/" in n or n.startswith("code/") for n in z.namelist()[:200])
    except (zipfile.BadZipFile, OSError):
        return False


def _load(path: Path) -> dict:
    """A weights file: safetensors, else as the image tower's checkpoints load (rayvl.assets: torch.save's, memory-
    mapped where it can be, or a TorchScript archive's state)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    from rayvl.assets import _load_weights

    return _load_weights(path)


def _unwrapped(state: dict) -> dict:
    """open_clip's training checkpoint (``{"epoch", "state_dict": {"module.…"}}``) or a plain state dict."""
    return clip_checkpoint.unwrapped(state.get("state_dict", state))


def _checked(state: dict, source: str) -> dict:
    needed = ("visual.class_embedding", "visual.conv1.weight", "visual.proj", "token_embedding.weight",
              "positional_embedding", "ln_final.weight", "text_projection", "logit_scale")
    missing = [k for k in needed if k not in state]
    if missing:
        kind = ("a ResNet image tower (rayvl's CLIP image tower is a ViT)" if "visual.layer1.0.conv1.weight" in state
                else "a text tower other than CLIP's transformer" if "text.transformer.embeddings.word_embeddings.weight"
                in state or any(k.startswith("text.") for k in state) else "not a CLIP state dict")
        raise ConfigError(f"{KEY}: {source!r} is {kind}: it lacks {', '.join(missing[:4])} (rayvl starts from an "
                          f"OpenAI or open_clip ViT CLIP, or a Hugging Face CLIPModel folder)")
    return state


def from_hugging_face(folder: Path) -> dict:
    """A Hugging Face ``CLIPModel`` folder (``config.json`` of model_type clip, safetensors or bin weights) in
    OpenAI's layout."""
    config = hugging_face_config(folder)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ConfigError(f"{KEY}: {str(folder)!r} has a CLIP config.json but no model.safetensors or "
                          f"pytorch_model.bin")
    hf: dict = {}
    for f in files:
        hf.update(_load(f))
    del config
    return _checked(hugging_face_to_openai(hf), str(folder))


def hugging_face_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{KEY}: {str(folder)!r} is a folder without a readable config.json ({e})") from None
    if config.get("model_type") != "clip":
        raise ConfigError(f"{KEY}: {str(folder)!r} holds a {config.get('model_type')!r} model, not a Hugging Face "
                          f"CLIPModel (model_type clip)")
    return config


_HF_TEXT = {"embeddings.token_embedding.weight": "token_embedding.weight",
            "embeddings.position_embedding.weight": "positional_embedding",
            "final_layer_norm.weight": "ln_final.weight", "final_layer_norm.bias": "ln_final.bias"}
_HF_VISION = {"embeddings.class_embedding": "class_embedding", "embeddings.patch_embedding.weight": "conv1.weight",
              "embeddings.position_embedding.weight": "positional_embedding",
              "pre_layrnorm.weight": "ln_pre.weight", "pre_layrnorm.bias": "ln_pre.bias",
              "post_layernorm.weight": "ln_post.weight", "post_layernorm.bias": "ln_post.bias"}


def hugging_face_to_openai(hf: dict) -> dict:
    """Hugging Face's ``CLIPModel`` keys → OpenAI's (q, k, v joined into in_proj; projections transposed)."""
    return {"logit_scale": hf["logit_scale"], "visual.proj": hf["visual_projection.weight"].t(),
            "text_projection": hf["text_projection.weight"].t(), **_openai_tower(hf, "text_model.", "", _HF_TEXT),
            **_openai_tower(hf, "vision_model.", "visual.", _HF_VISION)}


def _openai_tower(hf: dict, tower: str, prefix: str, names: dict) -> dict:
    """One tower of Hugging Face's CLIP (keys under ``tower``) in OpenAI's names (under ``prefix``)."""
    out = {prefix + name: hf[tower + key] for key, name in names.items()}
    layers = {int(k.split(".")[3]) for k in hf if k.startswith(tower + "encoder.layers.")}
    for i in sorted(layers):
        theirs, ours = f"{tower}encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{ours}attn.in_proj_{kind}"] = torch.cat([hf[f"{theirs}self_attn.{q}_proj.{kind}"] for q in "qkv"])
            for openai, hugging_face in _BLOCK:
                out[f"{ours}{openai}{kind}"] = hf[f"{theirs}{hugging_face}{kind}"]
    return out


# timm's CLIP ViT names → OpenAI's (the inverse of timm's converter, _convert_openai_clip)
_TIMM = (("patch_embed.proj.", "conv1."), ("norm_pre.", "ln_pre."), ("blocks.", "transformer.resblocks."),
         (".norm1.", ".ln_1."), (".norm2.", ".ln_2."), (".attn.qkv.", ".attn.in_proj_"), (".attn.proj.", ".attn.out_proj."),
         (".mlp.fc1.", ".mlp.c_fc."), (".mlp.fc2.", ".mlp.c_proj."))


def to_open_clip(model: dict) -> dict:
    """A rayvl whole-CLIP model's state dict (its towers without adapters or alignment layers) in open_clip's
    ``CLIP`` layout — OpenAI's — for ``open_clip.create_model_and_transforms``."""
    text = {"text_model." + k.removeprefix("text.lm.").removeprefix("text_model."): v for k, v in model.items()
            if k.startswith("text.lm.")}
    out = _openai_tower(text, "text_model.", "", _HF_TEXT)
    for key, value in model.items():
        if not key.startswith("vision.backbone."):
            continue
        name = key.removeprefix("vision.backbone.")
        if name == "cls_token":
            name, value = "class_embedding", value.reshape(-1)
        elif name == "pos_embed":
            name, value = "positional_embedding", value[0]
        elif name.startswith("norm."):
            name = "ln_post." + name.removeprefix("norm.")
        for timm_name, openai in _TIMM:
            name = name.replace(timm_name, openai)
        out["visual." + name.replace("in_proj_.", "in_proj_")] = value
    out.update({"visual.proj": model["vision_proj.weight"].t(), "text_projection": model["text_proj.weight"].t(),
                "logit_scale": model["logit_scale"].reshape(())})
    if "logit_bias" in model:
        out["logit_bias"] = model["logit_bias"].reshape(())
    return {k: v.contiguous() for k, v in out.items()}


def open_clip_config(arch, mean, std, logit_bias: float | None = None) -> dict:
    """open_clip's ``open_clip_config.json`` (model and preprocessing) for the CLIP of shapes ``arch``."""
    model = {"embed_dim": arch.embed_dim, "quick_gelu": arch.quick_gelu,
             "vision_cfg": {"image_size": arch.image_size, "layers": arch.vision_layers, "width": arch.vision_width,
                            "head_width": arch.vision_width // arch.vision_heads, "patch_size": arch.patch_size,
                            "mlp_ratio": _ratio(arch.vision_mlp, arch.vision_width)},
             "text_cfg": {"context_length": arch.context_length, "vocab_size": arch.vocab_size,
                          "width": arch.text_width, "heads": arch.text_heads, "layers": arch.text_layers,
                          "mlp_ratio": _ratio(arch.text_mlp, arch.text_width)}}
    if logit_bias is not None:
        model["init_logit_bias"] = logit_bias
    return {"model_cfg": model, "preprocess_cfg": {"size": arch.image_size, "mean": list(mean), "std": list(std),
                                                   "interpolation": "bicubic", "resize_mode": "shortest"}}


# ----------------------------------------------------------------------------- shapes

def architecture(state: dict, source: str) -> dict:
    """The CLIP's shapes (``model.clip``'s fields: rayvl.config.ClipArchitecture), read from its weights; heads and
    activation from the source where it says — a Hugging Face config, OpenAI's TorchScript, open_clip's
    ``open_clip_config.json`` beside the file — else the sizes CLIP's releases use and GELU, which ``model.clip`` set
    by hand replaces."""
    vision_width, _, patch, _ = state["visual.conv1.weight"].shape
    positions = state["visual.positional_embedding"].shape[0] - 1  # the class token's own
    grid = round(positions ** 0.5)
    if grid * grid != positions:
        raise ConfigError(f"{KEY}: {source!r}: {positions} image positions are no square grid of patches")
    text_width = state["ln_final.weight"].shape[0]
    arch = SimpleNamespace(
        # OpenAI's and open_clip's ViTs up to L have 64-wide heads; open_clip's H, g and bigG have 16 wider ones
        vision_width=vision_width, vision_layers=_depth(state, "visual."),
        vision_heads=16 if vision_width > 1024 else vision_width // HEAD_WIDTH,
        vision_mlp=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        patch_size=patch, image_size=grid * patch, text_width=text_width, text_layers=_depth(state, ""),
        text_heads=text_width // HEAD_WIDTH, text_mlp=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        context_length=state["positional_embedding"].shape[0],
        vocab_size=state["token_embedding.weight"].shape[0], embed_dim=state["text_projection"].shape[1],
        quick_gelu=False)
    path = Path(source).expanduser()
    if path.is_dir():  # Hugging Face's config names the heads and the activation
        config = hugging_face_config(path)
        text, vision = config.get("text_config", {}), config.get("vision_config", {})
        arch.text_heads = text.get("num_attention_heads", arch.text_heads)
        arch.vision_heads = vision.get("num_attention_heads", arch.vision_heads)
        arch.quick_gelu = text.get("hidden_act", "quick_gelu") == "quick_gelu"  # CLIPTextConfig's default
    elif is_torchscript(path):
        arch.quick_gelu = True  # every OpenAI release
    elif (path.parent / OPEN_CLIP_CONFIG).is_file():  # open_clip's hub folders: its model config beside
        model = json.loads((path.parent / OPEN_CLIP_CONFIG).read_text()).get("model_cfg", {})
        vision, text = model.get("vision_cfg", {}), model.get("text_cfg", {})
        arch.vision_heads = vision_width // vision.get("head_width", HEAD_WIDTH)
        arch.text_heads = text.get("heads", arch.text_heads)
        arch.quick_gelu = bool(model.get("quick_gelu", False))
    if state["visual.proj"].shape[1] != arch.embed_dim:
        raise ConfigError(f"{KEY}: {source!r} projects images to {state['visual.proj'].shape[1]} and texts to "
                          f"{arch.embed_dim} dimensions: not one embedding space")
    return dict(vars(arch))


def _depth(state: dict, prefix: str) -> int:
    return 1 + max(int(m.group(2)) for k in state if (m := _BLOCKS.fullmatch(k)) and bool(m.group(1)) == bool(prefix))


def settings(source: str) -> dict:
    """What ``model.init_from_clip`` decides of the config, as {section: {key: value}}: the towers (``clip``, its
    tokenizer as ``model.text``), CLIP's linear projections, its embedding size, end-of-text pooling, its
    temperature, and the image size and text context it was trained at (open_clip tokenizes to the whole context:
    77 tokens for every released CLIP; rayvl's default for other text towers is fewer)."""
    path = local(source)  # a URL's copy: fetched (or checked) once
    state = _read(path, source)
    arch = architecture(state, str(path))
    return {
        "model": {"vision": "clip", "text": str(path) if path.is_dir() else "clip", "clip": arch,
                  "embed_dim": arch["embed_dim"], "vision_projection": "linear", "text_projection": "linear",
                  # released CLIPs hold log(100) in fp16 or fp32, whose exp lands a hair above CLIP's clamp at 100
                  "pooling": "eot", "init_logit_scale": min(100.0, float(state["logit_scale"].float().exp()))},
        "data": {"image_size": arch["image_size"], "max_text_tokens": arch["context_length"]},
    }


# ----------------------------------------------------------------------------- the towers' parts

def timm_args(arch) -> tuple[str, dict]:
    """(timm name, its arguments) of the CLIP's image transformer at ``arch.image_size`` (timm's converter resamples
    the position embeddings of a checkpoint trained at another size)."""
    return TIMM_BASE, {"img_size": arch.image_size, "patch_size": arch.patch_size, "embed_dim": arch.vision_width,
                       "depth": arch.vision_layers, "num_heads": arch.vision_heads,
                       "mlp_ratio": _ratio(arch.vision_mlp, arch.vision_width),
                       "act_layer": "quick_gelu" if arch.quick_gelu else "gelu"}


def _mlp(hidden: int, width: int) -> int:
    return hidden or 4 * width  # a model.clip written before the MLP widths were read: CLIP's 4 × width


def _ratio(hidden: int, width: int) -> float:
    """The mlp_ratio timm and open_clip build ``hidden`` from (both take int(width × ratio)): hidden ÷ width, a
    float's step up where its rounding falls short (704 wide, 960 hidden)."""
    hidden = _mlp(hidden, width)
    ratio = hidden / width
    return ratio if int(width * ratio) == hidden else math.nextafter(ratio, math.inf)


def text_config(arch):
    """Hugging Face's ``CLIPTextConfig`` of the CLIP's text transformer (``arch``: model.clip)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=arch.vocab_size, hidden_size=arch.text_width,
                          intermediate_size=_mlp(arch.text_mlp, arch.text_width), num_hidden_layers=arch.text_layers,
                          num_attention_heads=arch.text_heads, max_position_embeddings=arch.context_length,
                          hidden_act="quick_gelu" if arch.quick_gelu else "gelu", layer_norm_eps=1e-5,
                          bos_token_id=EOT_ID - 1, eos_token_id=EOT_ID, pad_token_id=EOT_ID,
                          projection_dim=arch.embed_dim)


def text_state(state: dict, prefix: str = "") -> dict:
    """OpenAI's text-transformer keys → ``CLIPTextModel``'s (``prefix``: ``text_model.`` where transformers nests
    them, before version 5)."""
    out = {f"{prefix}embeddings.token_embedding.weight": state["token_embedding.weight"],
           f"{prefix}embeddings.position_embedding.weight": state["positional_embedding"],
           f"{prefix}final_layer_norm.weight": state["ln_final.weight"],
           f"{prefix}final_layer_norm.bias": state["ln_final.bias"]}
    for key, value in state.items():
        m = _BLOCKS.fullmatch(key)
        if not m or m.group(1):
            continue
        ours, rest = f"{prefix}encoder.layers.{m.group(2)}.", m.group(3)
        if rest.startswith("attn.in_proj_"):
            for q, part in zip("qkv", value.chunk(3)):
                out[f"{ours}self_attn.{q}_proj.{rest.removeprefix('attn.in_proj_')}"] = part
            continue
        for openai, hugging_face in _BLOCK:
            if rest.startswith(openai):
                out[ours + hugging_face + rest.removeprefix(openai)] = value
    return out


def describe(arch, source: str) -> str:
    """One line: what the CLIP is."""
    return (f"{KEY} {source}: image ViT width {arch.vision_width}, {arch.vision_layers} layers, {arch.vision_heads} "
            f"heads, patch {arch.patch_size}, {arch.image_size} px; text width {arch.text_width}, {arch.text_layers} "
            f"layers, {arch.text_heads} heads, {arch.context_length} tokens, vocabulary {arch.vocab_size}; embedding "
            f"{arch.embed_dim}; {'QuickGELU' if arch.quick_gelu else 'GELU'}")
