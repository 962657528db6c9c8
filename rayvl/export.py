"""A trained model outside rayvl's training and evaluation code: ``rayvl.load`` and ``rayvl export``.

``load(path)`` takes a run directory (its newest checkpoint), any checkpoint (final or intermediate, any ZeRO
stage: rayvl.checkpoints.load_weights) or an export, and needs neither Ray nor DeepSpeed running. An export is a
folder anyone can copy:

    model.safetensors   every weight of the dual encoder, fp32 (what ``rayvl.load`` reads)
    rayvl_model.json    {"config": the run's rayvl config, "source", "step", "metrics"}
    text/               the text tower's language model as a Hugging Face folder — config, weights, tokenizer:
                        ``AutoModel.from_pretrained(text/, add_pooling_layer=False)`` (not with adapters inside it)
    vision/             the image tower's timm backbone, classifier removed: ``model.safetensors`` (a timm state dict)
                        and ``config.json`` (timm's architecture name, the pixel mean/std, the image size)
    heads.safetensors   what neither library holds: ``vision_proj.*``, ``text_proj.*`` (``0.``, ``2.``: the MLP's
                        two linear layers around a GELU), ``alignment.<i>.*`` (layers shaped like the LM's last),
                        ``logit_scale`` (log of the temperature's inverse), ``logit_bias`` (SigLIP's b, with
                        loss.kind=siglip)
    README.md           a model card (Hugging Face metadata): recipe, data, steps, evaluation, how to load it, with
                        rayvl and without
    without_rayvl.py    the towers, heads and pooling in transformers + timm + torch: ``encode_image``,
                        ``encode_text``, ``logit_scale`` (not for class embeddings or adapters inside the LM)

Not a ``transformers`` ``VisionTextDualEncoderModel``: that class embeds text as ``text_projection(pooler_output)``
— the LM's tanh pooler over the CLS token, one bias-free linear map — while rayvl's text tower pools (mean or raw
CLS) the output of alignment layers or adapters and projects with a 2-layer MLP ([Paraphrase] §5), and its image
tower is a timm backbone that normalises uint8 pixels itself. No weight mapping reproduces rayvl's embeddings, so
rayvl does not write one that would silently embed differently.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rayvl import assets, plugins, storage
from rayvl.checkpoints import METRICS_FILE, checkpoint_uri, load_weights, read_meta, resolve_checkpoint
from rayvl.config import RayvlConfig, from_dict, precision
from rayvl.data.images import crop
from rayvl.data.text import load_tokenizer, tokenize
from rayvl.models.dual_encoder import DualEncoder, build_model

WEIGHTS_FILE = "model.safetensors"
EXPORT_META = "rayvl_model.json"
TEXT_DIR = "text"
VISION_DIR = "vision"
HEADS_FILE = "heads.safetensors"


class Model:
    """A dual encoder ready to embed: ``encode_image`` / ``encode_text`` return L2-normalised float32 embeddings;
    ``preprocess`` is the evaluation's image transform (open_clip's: the shorter side resized to ``image_size``, the
    centre cut; uint8 CHW) and
    ``tokenizer`` the text tower's HF tokenizer (captions padded/truncated to ``max_tokens``)."""

    def __init__(self, model: DualEncoder, config: RayvlConfig, tokenizer_path: str, device: str):
        self.module = model.to(device).eval()
        self.config, self.device = config, torch.device(device)
        self.tokenizer_path, self.tokenizer = tokenizer_path, load_tokenizer(tokenizer_path)
        self.image_size, self.max_tokens = config.data.image_size, config.data.max_text_tokens

    def preprocess(self, image) -> torch.Tensor:
        """A PIL image or an image file → uint8 tensor (3, image_size, image_size)."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            with Image.open(image) as f:
                image = f.convert("RGB")
        return torch.from_numpy(crop(image.convert("RGB"), self.image_size, None))

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask), fixed length — the tokenisation training used."""
        ids, mask = tokenize(list(texts), self.tokenizer_path, self.max_tokens)
        return torch.from_numpy(ids), torch.from_numpy(mask)

    @torch.no_grad()
    def encode_image(self, images) -> torch.Tensor:
        """Images: a uint8 tensor/array (N, 3, H, W) as ``preprocess`` makes them, or a list of PIL images/files."""
        if isinstance(images, (list, tuple)):
            images = torch.stack([self.preprocess(i) for i in images])
        images = torch.as_tensor(np.asarray(images) if not torch.is_tensor(images) else images)
        return self.module.encode_image(images.to(self.device)).float()

    @torch.no_grad()
    def encode_text(self, texts: list[str]) -> torch.Tensor:
        ids, mask = self.tokenize(texts)
        return self.module.encode_text(ids.to(self.device), mask.to(self.device)).float()

    @torch.no_grad()
    def logit_scale(self) -> float:
        return float(self.module.scale())

    @torch.no_grad()
    def logit_bias(self) -> float | None:
        """SigLIP's learned bias (loss.kind=siglip; None otherwise): σ(scale · image·text + bias) is the
        probability that an image and a text match."""
        bias = self.module.bias()
        return None if bias is None else float(bias)


def is_export(path: str | Path) -> bool:
    return (Path(path) / EXPORT_META).is_file()


def weights(path: str | Path) -> tuple[dict, RayvlConfig, str]:
    """(fp32 state dict, the run's config, the text tower's folder) of an export, a checkpoint or a run directory
    (its newest checkpoint)."""
    if is_export(path):
        meta = json.loads((Path(path) / EXPORT_META).read_text())
        text_dir = str(Path(path).resolve() / TEXT_DIR)
        cfg = from_dict(meta["config"])
        cfg = replace(cfg, model=replace(cfg.model, text=text_dir, vision_checkpoint=""))
        from safetensors.torch import load_file

        return load_file(str(Path(path) / WEIGHTS_FILE)), cfg, text_dir
    ckpt = resolve_checkpoint(path)
    cfg = from_dict(read_meta(ckpt)["config"])
    return load_weights(ckpt, cfg.train.zero_stage), cfg, str(assets.text_model_path(cfg.model.text))


def load(path: str | Path, device: str = "cpu") -> Model:
    """The model of an export, a checkpoint or a run directory (its newest checkpoint)."""
    state, cfg, text_dir = weights(path)
    return Model(build_model(cfg.model, state=state), cfg, text_dir, device)


def export(source: str, out: str | Path) -> Path:
    """Write the export of ``source`` (a run directory, a checkpoint; local or a URL) into ``out``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    ckpt = checkpoint_uri(source)
    meta = read_meta(ckpt)
    model = load(ckpt)
    out = Path(out).expanduser()
    (out / TEXT_DIR).mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().clone() if v.is_floating_point() else v.contiguous().clone()
             for k, v in model.module.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "rayvl_step": str(meta["step"])})
    if model.config.model.clip.vision_width:  # a whole CLIP's text transformer: its config is the tower's own
        model.module.text.lm.config.save_pretrained(out / TEXT_DIR)
    else:
        text_path = str(assets.text_model_path(model.config.model.text))
        AutoConfig.from_pretrained(text_path, local_files_only=True).save_pretrained(out / TEXT_DIR)
    model.tokenizer.save_pretrained(out / TEXT_DIR)
    metrics = _last_evaluation(ckpt)
    record = {"config": meta["config"], "source": ckpt, "step": meta["step"], "final": meta.get("final", False),
              "metrics": metrics}
    (out / EXPORT_META).write_text(json.dumps(record, indent=2))
    write_towers(model, out)
    write_open_clip(model, out)
    (out / "README.md").write_text(model_card({**record, "export_dir": str(out)}))
    code = standalone_code(record)
    if code is not None:
        (out / STANDALONE_FILE).write_text(code)
    for f in out.rglob("*"):  # safetensors writes 0600: a shared filesystem's readers could not open it
        f.chmod(0o755 if f.is_dir() else 0o644)
    return out


def _tensors(module: torch.nn.Module, prefix: str = "") -> dict:
    return {prefix + k: v.detach().float().contiguous().clone() if v.is_floating_point() else v.contiguous().clone()
            for k, v in module.state_dict().items()}


def write_towers(model: Model, out: Path) -> None:
    """The towers in their own libraries' formats (text/, vision/) and the layers between them (heads.safetensors),
    beside model.safetensors."""
    from safetensors.torch import save_file

    m, cfg = model.module, model.config.model
    vision = out / VISION_DIR
    vision.mkdir(exist_ok=True)
    save_file(_tensors(m.vision.backbone), str(vision / WEIGHTS_FILE))
    scale = 255.0  # the tower's buffers normalise 0–255 pixels
    if cfg.clip.vision_width:  # a whole CLIP's ViT: timm's CLIP ViT with the checkpoint's sizes
        from rayvl.models.whole_clip import timm_args

        architecture, args = timm_args(cfg.clip)
    else:
        architecture, args = assets.vision_timm_name(cfg.vision), {}
    (vision / "config.json").write_text(json.dumps({
        "architecture": architecture, "model_args": args, "num_classes": 0, "image_size": model.image_size,
        "mean": (m.vision.mean.flatten() / scale).tolist(), "std": (m.vision.std.flatten() / scale).tolist()}, indent=2))
    heads = {**_tensors(m.vision_proj, "vision_proj."), "logit_scale": m.logit_scale.detach().float().clone()}
    if cfg.init_logit_bias is not None:
        heads["logit_bias"] = m.logit_bias.detach().float().clone()
    if cfg.text_tower != "class_embedding":
        heads.update(_tensors(m.text_proj, "text_proj."))
        for i, layer in enumerate(m.text.alignment):
            heads.update(_tensors(layer, f"alignment.{i}."))
        if cfg.text_strategy != "frozen_adapters":  # adapters live inside the LM's layers: rayvl.load only
            m.text.lm.save_pretrained(out / TEXT_DIR, safe_serialization=True)
    save_file(heads, str(out / HEADS_FILE))


OPEN_CLIP_CONFIG, OPEN_CLIP_WEIGHTS = "open_clip_config.json", "open_clip_model.safetensors"


def open_clip_form(cfg) -> bool:
    """Whether open_clip's own ``CLIP`` holds this model: a whole CLIP (model.init_from_clip) with neither adapters
    nor alignment layers (model config)."""
    return bool(cfg.clip.vision_width) and (cfg.text_strategy in ("finetune", "frozen") or (
        cfg.text_strategy == "frozen_alignment" and cfg.alignment_layers == 0))


def write_open_clip(model: Model, out: Path) -> None:
    """open_clip's form beside rayvl's — ``open_clip_config.json`` and ``open_clip_model.safetensors``, which
    ``open_clip.create_model_and_transforms("local-dir:<export>")`` loads (and CLIP_benchmark through it) — where
    open_clip's ``CLIP`` holds the model (open_clip_form)."""
    from safetensors.torch import save_file

    from rayvl.models.whole_clip import open_clip_config, to_open_clip

    cfg = model.config.model
    if not open_clip_form(cfg):
        return
    m, scale = model.module, 255.0  # the tower's buffers normalise 0–255 pixels
    bias = float(m.logit_bias.detach()) if cfg.init_logit_bias is not None else None
    config = open_clip_config(cfg.clip, (m.vision.mean.flatten() / scale).tolist(),
                              (m.vision.std.flatten() / scale).tolist(), bias)
    (out / OPEN_CLIP_CONFIG).write_text(json.dumps(config, indent=2))
    save_file(to_open_clip({k: v.detach().float() for k, v in m.state_dict().items()}), str(out / OPEN_CLIP_WEIGHTS))


def _last_evaluation(ckpt: str) -> dict:
    """The evaluation metrics of the checkpoint's last report that has them ({} when none ran)."""
    from rayvl.eval.tasks import METRIC_PREFIXES  # imports Ray: not on rayvl.load's path
    path = storage.join(ckpt, METRICS_FILE)
    if not storage.is_file(path):
        return {}
    rows = [json.loads(x) for x in storage.read_text(path).splitlines() if x.strip()]
    evaluated = [r for r in rows if any(k.startswith(METRIC_PREFIXES) for k in r)]
    if not evaluated:
        return {}
    return {"step": evaluated[-1]["step"],
            **{k: v for k, v in evaluated[-1].items() if k.startswith(METRIC_PREFIXES) and "_chance_" not in k}}


def model_card(record: dict) -> str:
    c = record["config"]
    m, t, d, cfg = c["model"], c["train"], c["data"], from_dict(c)
    rows = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                     for k, v in record["metrics"].items()) or "| (no evaluation ran) | |"
    return f"""---
library_name: rayvl
pipeline_tag: zero-shot-image-classification
tags: [clip, dual-encoder, image-text-retrieval, rayvl, {c["recipe"]}]
---

# rayvl dual encoder: {c["recipe"]}

Exported by `rayvl export` from `{record["source"]}` (step {record["step"]} of {t["max_steps"]}{
    ", final" if record["final"] else ", an intermediate checkpoint"}).

- Image tower: `{m["vision"]}` (timm), {m["vision_projection"]} projection; input: uint8 RGB
  {d["image_size"]}×{d["image_size"]}, centre-cropped (the tower normalises pixels itself).
- Text tower: `{m["text"]}`, strategy `{m["text_strategy"]}`{
    f" with {m['alignment_layers']} alignment layer{'s' if m['alignment_layers'] != 1 else ''}"
    if m["text_strategy"] == "frozen_alignment" else ""},
  {m["pooling"]} pooling, {m["text_projection"]} projection; {d["max_text_tokens"]} tokens.
- Embedding dimension {m["embed_dim"]}; loss `{c["loss"]["kind"]}`{
    "".join(f", {n} negatives a query in {where}" for n, where in plugins.extra_negatives(cfg))}.
- Training data: `{d["train"] or "the embedded demo dataset"}`; {t["num_workers"]} workers × micro-batch
  {t["micro_batch_size"]} × {t["grad_accumulation"]} accumulation, lr {t["lr"]}, {precision(cfg.train)}, ZeRO-{
    t["zero_stage"]}, seed {t["seed"]}.

## Evaluation (held-out split, during training)

| metric | value |
|---|---|
{rows}

## Use

```python
import rayvl
model = rayvl.load("{record.get("export_dir", ".")}")   # CPU by default; device="cuda" for a GPU
images = model.encode_image(["cat.jpg", "dog.jpg"])     # (2, {m["embed_dim"]}) L2-normalised
texts = model.encode_text(["a photo of a cat", "a photo of a dog"])
{_similarity(record)}
```
{without_rayvl(record)}{with_open_clip(record)}
Files: `model.safetensors` (every weight, fp32: what `rayvl.load` reads), `rayvl_model.json` (the full training
config), `text/` (the language model as a Hugging Face folder), `vision/` (the timm backbone's state dict and its
`config.json`), `heads.safetensors` (projections, alignment layers, logit scale). Not a `transformers`
`VisionTextDualEncoderModel`: that class embeds text through the LM's pooler and one linear map, which cannot express
this text tower's pooling and projection.
"""


def with_open_clip(record: dict) -> str:
    """The card's open_clip section, for an export in open_clip's form too (open_clip_form)."""
    from rayvl.config import from_dict

    if not open_clip_form(from_dict(record["config"]).model):
        return ""
    return f"""
## Use with open_clip

`{OPEN_CLIP_CONFIG}` and `{OPEN_CLIP_WEIGHTS}` hold this CLIP in open_clip's own form (and so CLIP_benchmark's):

```python
import open_clip
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{record.get("export_dir", ".")}")
tokenizer = open_clip.get_tokenizer("local-dir:{record.get("export_dir", ".")}")
```
"""


STANDALONE_FILE = "without_rayvl.py"


def without_rayvl(record: dict) -> str:
    """The model card's section that embeds with transformers, timm and torch alone, through the export's own
    ``without_rayvl.py`` (the suite runs it)."""
    d = record.get("export_dir", ".")
    if standalone_code(record) is None:
        return "\nThis text tower (class embeddings, or adapters inside the LM's layers) loads with `rayvl.load` only.\n"
    return f"""
## Use without rayvl

```python
import importlib.util  # the export's without_rayvl.py: transformers, timm and torch, no rayvl
spec = importlib.util.spec_from_file_location("without_rayvl", "{d}/without_rayvl.py")
model = importlib.util.module_from_spec(spec); spec.loader.exec_module(model)
from PIL import Image
import torch
pixels = torch.stack([model.preprocess(Image.open(f)) for f in ("cat.jpg", "dog.jpg")])  # rayvl's crop
images = model.encode_image(pixels)
texts = model.encode_text(["a photo of a cat", "a photo of a dog"])
{_similarity(record)}
```
"""


def _similarity(record: dict) -> str:
    """The card's last line: logits of a softmax model, probabilities of a SigLIP one (its bias added)."""
    if record["config"]["model"].get("init_logit_bias") is None:
        return "similarity = model.logit_scale() * images @ texts.T"
    return "match = (model.logit_scale() * images @ texts.T + model.logit_bias()).sigmoid()  # SigLIP: P(match)"


def _text_code(pooling: str) -> tuple[str, str, str, str]:
    """without_rayvl.py's text tower: (its load, its last layer, its forward and attention mask, its pooling)."""
    pool = {"cls": "x[:, 0]", "avg": "(x * a).sum(1) / a.sum(1).clamp(min=1)",
            # CLIP's: the end-of-text token's feature (causal attention: the padding after it never reached it)
            "eot": "x[torch.arange(len(x)), (t['input_ids'] == tokenizer.eos_token_id).int().argmax(-1)]"}[pooling]
    if pooling == "eot":  # a whole CLIP: Hugging Face's CLIPTextModel, causal attention in every layer
        return ('lm = transformers.CLIPTextModel.from_pretrained(f"{d}/text").eval()',
                'getattr(lm, "text_model", lm).encoder.layers[-1]',
                'x = lm(input_ids=t["input_ids"]).last_hidden_state\n    n = x.shape[1]\n'
                '    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]  # causal, as CLIP\'s own layers',
                pool)
    return ('lm = transformers.AutoModel.from_pretrained(f"{d}/text", add_pooling_layer=False).eval()',
            "lm.encoder.layer[-1]",
            'x = lm(input_ids=t["input_ids"], attention_mask=a).last_hidden_state\n'
            '    mask = (1.0 - a[:, None, None, :].float()) * torch.finfo(torch.float32).min  # additive: padding left '
            'out', pool)


def _image_code(size: int, projected: str) -> str:
    """without_rayvl.py's image side: rayvl's evaluation crop, exactly (open_clip's: the shorter side resized
    bicubic to the size, the centre cut — rayvl.data.images.centre_crop), and the tower."""
    return f'''

def preprocess(image):
    """A PIL image → uint8 (3, {size}, {size}), as open_clip's evaluation transform crops it: the shorter side resized
    bicubic to {size}, then the centre {size}×{size}."""
    from PIL import Image

    image = image.convert("RGB")
    w, h_ = image.size
    new = ({size}, int({size} * h_ / w)) if w <= h_ else (int({size} * w / h_), {size})
    left, top = int(round((new[0] - {size}) / 2.0)), int(round((new[1] - {size}) / 2.0))
    image = image.resize(new, Image.BICUBIC).crop((left, top, left + {size}, top + {size}))
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).copy())


@torch.no_grad()
def encode_image(pixels):
    x = vision((pixels.float() / 255 - mean) / std)
    return F.normalize({projected}, dim=-1)
'''


# CLIP's tokenizer cleans each caption first, as OpenAI's and open_clip's do (rayvl.data.text.clip_cleaned)
CLIP_CLEAN_CODE = '''

def clean(text):  # CLIP's own clean-up before its BPE: ftfy, HTML entities, whitespace
    import html

    import ftfy

    return " ".join(html.unescape(html.unescape(ftfy.fix_text(text))).split())
'''


def standalone_code(record: dict) -> str | None:
    """``without_rayvl.py``: this export's towers, heads and pooling in transformers + timm + torch — what
    rayvl.load computes, in code a user can read and keep (None where only rayvl.load can: class embeddings, or
    adapters inside the LM)."""
    m, d = record["config"]["model"], record["config"]["data"]
    if m["text_tower"] == "class_embedding" or m["text_strategy"] == "frozen_adapters":
        return None
    project = {"linear": "F.linear({x}, h['{p}.weight'])",
               "mlp2": "F.linear(F.gelu(F.linear({x}, h['{p}.0.weight'], h['{p}.0.bias'])), h['{p}.2.weight'], "
                       "h['{p}.2.bias'])"}
    lm_line, last, masked, pool = _text_code(m["pooling"])
    layers = m["alignment_layers"] if m["text_strategy"] == "frozen_alignment" else 0
    clean = CLIP_CLEAN_CODE if m["pooling"] == "eot" else ""  # a whole CLIP's tokenizer
    texts = "[clean(x) for x in texts]" if clean else "texts"
    bias = ('\n\ndef logit_bias():  # SigLIP: torch.sigmoid(logit_scale() * image @ text.T + logit_bias())\n'
            '    return float(h["logit_bias"])\n') if m.get("init_logit_bias") is not None else ""
    return f'''"""A rayvl export, embedded without rayvl: transformers (the language model), timm (the image tower) and
torch (the heads). preprocess(PIL image) gives rayvl's evaluation crop as uint8 (3, {d["image_size"]}, {d["image_size"]});
encode_image(uint8 (N, 3, {d["image_size"]}, {d["image_size"]})) and encode_text(list of str) give L2-normalised embeddings;
logit_scale() turns their dot products into logits."""
import copy
import json
import os

import numpy as np
import timm
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

d = os.path.dirname(os.path.abspath(__file__))
v, h = json.load(open(f"{{d}}/vision/config.json")), load_file(f"{{d}}/heads.safetensors")
vision = timm.create_model(v["architecture"], num_classes=0, checkpoint_path=f"{{d}}/vision/model.safetensors",
                           **v.get("model_args", {{}})).eval()
{lm_line}
tokenizer = transformers.AutoTokenizer.from_pretrained(f"{{d}}/text")
align = [copy.deepcopy({last}) for _ in range({layers})]  # alignment layers: shaped like the LM's last
for i, layer in enumerate(align):
    layer.load_state_dict({{k.split(".", 2)[2]: w for k, w in h.items() if k.startswith(f"alignment.{{i}}.")}})
mean, std = (torch.tensor(v[k]).view(1, 3, 1, 1) for k in ("mean", "std"))


def logit_scale():
    return float(h["logit_scale"].exp().clamp(max={m["max_logit_scale"]}))
{bias}{clean}{_image_code(d["image_size"], project[m["vision_projection"]].format(x="x", p="vision_proj"))}

@torch.no_grad()
def encode_text(texts):
    t = tokenizer({texts}, padding="max_length", truncation=True, max_length={d["max_text_tokens"]}, return_tensors="pt")
    a = t["attention_mask"]
    {masked}
    for layer in align:
        out = layer(x, mask)
        x = out[0] if isinstance(out, tuple) else out
    a = a.unsqueeze(-1).float()
    x = {pool}
    return F.normalize({project[m["text_projection"]].format(x="x", p="text_proj")}, dim=-1)
'''
