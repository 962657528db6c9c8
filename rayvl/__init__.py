"""rayvl: a Ray-distributed trainer for CLIP-style dual encoders."""
import os

# rayvl never downloads models: weights come from installed packages or local paths (DESIGN, "no hub at run time")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__version__ = "0.1.0"


def load(path, device: str = "cpu"):
    """A trained model from a run directory, a checkpoint (any ZeRO stage, final or not) or a ``rayvl export``
    folder: ``.encode_image``, ``.encode_text``, ``.preprocess``, ``.tokenizer`` (rayvl.export.Model). Needs
    neither Ray nor DeepSpeed running."""
    from rayvl.export import load as _load

    return _load(path, device)
