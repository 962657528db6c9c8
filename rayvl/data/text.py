"""Caption validation and batched tokenisation with the text tower's own HF fast tokenizer."""
from __future__ import annotations

from functools import lru_cache

import numpy as np


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


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """Loaded once per process (Ray reuses task worker processes, so once per worker)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)


def tokenize(captions: list[str], tokenizer_path: str, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-length (padded/truncated) ids and attention mask, so batches stack without ragged tensors."""
    if not captions:
        empty = np.zeros((0, max_tokens), np.int64)
        return empty, empty.copy()
    enc = load_tokenizer(tokenizer_path)(list(captions), padding="max_length", truncation=True,
                                         max_length=max_tokens, return_tensors="np")
    return enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)
