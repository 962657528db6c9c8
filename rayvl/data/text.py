"""Caption text: validation, the word tools of the caption transforms (BoW, the TOnICS noun lookup), and batched
tokenisation with the text tower's own HF fast tokenizer."""
from __future__ import annotations

import json
import re
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from rayvl.private_copy import readable

RESOURCES = Path(__file__).resolve().parent.parent / "resources" / "nltk_data"
TOKEN_PATTERN = r"\w+(?:[-'’]\w+)*|[^\w\s]+"
# nltk's RegexpTokenizer(TOKEN_PATTERN) gives the same tokens (tested) but routes every call through its ReDoS guard
# (the `regex` engine with a timeout), several times slower: this fixed pattern cannot backtrack catastrophically,
# so `re` is safe here and keeps the BoW deformation a small share of the pipeline (docs/benchmarks.md).
_TOKENS = re.compile(TOKEN_PATTERN)


def validate_caption(raw) -> tuple[str, str | None]:
    """(caption, None) or ("", reason) — the reason is the DataReport counter to bump."""
    if raw is None:
        return "", "dropped_missing_caption"
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            return "", "dropped_non_utf8_caption"
    text = " ".join(str(raw).split())
    if not text:
        return "", "dropped_empty_caption"
    return text, None


def validate_caption_lines(raw) -> tuple[str, str | None]:
    """``validate_caption`` of a held-out sample, its lines kept apart: each line's whitespace collapsed, empty lines
    left out, the rest joined by newlines — the captions of its image (CLIP_benchmark's retrieval shards hold an
    image's captions as the lines of one text)."""
    text, reason = validate_caption(raw)
    if reason:
        return text, reason
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    return "\n".join(line for line in (" ".join(part.split()) for part in str(raw).splitlines()) if line), None


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """The HF tokenizer of a model folder, loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)


@lru_cache(maxsize=8)
def fixed_length_tokenizer(path: str, max_tokens: int):
    """The model folder's own fast tokenizer (``tokenizer.json``, HF ``tokenizers``) set once to truncate and pad
    to ``max_tokens`` with the folder's pad token — what ``AutoTokenizer(..., padding="max_length",
    truncation=True)`` does (tested equal), without importing transformers and torch in every new Ray Data worker
    process, and thread-safe (nothing is reconfigured per call, so the read tasks' threads
    share it). None when the folder has no ``tokenizer.json`` or names no pad token: then AutoTokenizer."""
    folder = Path(path)
    pad = _pad_token(folder)
    if not (folder / "tokenizer.json").is_file() or pad is None:
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    pad_id = tokenizer.token_to_id(pad)
    if pad_id is None:
        return None
    tokenizer.enable_truncation(max_tokens)
    tokenizer.enable_padding(length=max_tokens, pad_id=pad_id, pad_token=pad)
    return tokenizer


def _pad_token(folder: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            pad = json.loads((folder / name).read_text()).get("pad_token")
        except (OSError, ValueError):
            continue
        if isinstance(pad, dict):
            pad = pad.get("content")
        if isinstance(pad, str):
            return pad
    return None


_AUTO_LOCK = threading.Lock()  # transformers' lazy imports and per-call padding setup are not thread-safe
# nltk's lazy corpus loaders and WordNet's reader (seek + readline on shared files) are not thread-safe either; the
# read tasks transform batches in threads (shards._transformed_ahead)
NLTK_LOCK = threading.RLock()


def tokenize(captions: list[str], tokenizer_path: str, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-length (padded/truncated) ids and attention mask, so batches stack without ragged tensors; CLIP's
    tokenizer gets each caption as CLIP's own tokenizer cleans it first (``clip_cleaned``)."""
    if not captions:
        empty = np.zeros((0, max_tokens), np.int64)
        return empty, empty.copy()
    if cleans_like_clip(tokenizer_path):
        captions = [clip_cleaned(c) for c in captions]
    fast = fixed_length_tokenizer(tokenizer_path, max_tokens)
    if fast is not None:
        encodings = fast.encode_batch(list(captions))
        return (np.array([e.ids for e in encodings], dtype=np.int64),
                np.array([e.attention_mask for e in encodings], dtype=np.int64))
    with _AUTO_LOCK:
        enc = load_tokenizer(tokenizer_path)(list(captions), padding="max_length", truncation=True,
                                             max_length=max_tokens, return_tensors="np")
    return enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)


@lru_cache(maxsize=8)
def cleans_like_clip(path: str) -> bool:
    """Whether the tokenizer folder holds CLIP's byte-level BPE (a ``CLIPTokenizer`` class, the one rayvl writes
    for model.text=clip and the one a Hugging Face CLIP folder ships), whose captions are cleaned first."""
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return str(config.get("tokenizer_class", "")).startswith("CLIPTokenizer")


def clip_cleaned(caption: str) -> str:
    """A caption as OpenAI's CLIP tokenizer and open_clip's clean it before their BPE (``basic_clean`` then
    ``whitespace_clean``; the BPE lower-cases): mojibake and ligatures fixed by ftfy, HTML entities unescaped
    twice, whitespace runs one space. Hugging Face's fast CLIP tokenizer does none of it, so "&amp;", "don’t" or
    "cafÃ©" would get other ids than the weights were trained on. Printable ASCII without "&" is left as it is,
    which ftfy and the unescaping would do too (tested), at a fraction of ftfy's cost."""
    if caption.isascii() and caption.isprintable() and "&" not in caption:
        return " ".join(caption.split())
    import html

    import ftfy

    return " ".join(html.unescape(html.unescape(ftfy.fix_text(caption))).split())


def words(caption: str) -> list[str]:
    """Lower-cased word and punctuation tokens: letters/digits with inner apostrophes or hyphens stay whole
    ("should've", "t-shirt"), punctuation runs are tokens (":" and "." as in [BoW] Figure 2); typographic
    apostrophes are folded so "don’t" meets NLTK's "don't"."""
    return _TOKENS.findall(caption.lower().replace("’", "'"))


@lru_cache(maxsize=1)
def stopwords() -> frozenset[str]:
    """NLTK's English stopword list (179 words) through nltk's own corpus reader; the file ships with rayvl
    (rayvl/resources/nltk_data) because nltk.download cannot reach the network on these machines."""
    import nltk

    with NLTK_LOCK:
        root = str(readable(RESOURCES))  # a group-writable checkout: nltk reads a private copy (rayvl.private_copy)
        if root not in nltk.data.path:
            nltk.data.path.insert(0, root)
        from nltk.corpus import stopwords as corpus

        return frozenset(corpus.words("english"))


def is_alphabetical(word: str) -> bool:
    """Letters only, apart from inner apostrophes and hyphens ("o'clock", "t-shirt"); not numbers or punctuation."""
    return word.replace("'", "").replace("-", "").isalpha()
