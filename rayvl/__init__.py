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


def __getattr__(name: str):
    """``rayvl.train`` before anything imported it: the package, callable — ``rayvl.train(config)`` runs a training
    job (rayvl/train/__init__.py). Imported on first use, so that ``import rayvl`` (the data plane's read tasks,
    rayvl.load) stays light."""
    if name == "train":
        import importlib

        return importlib.import_module("rayvl.train")
    raise AttributeError(f"module 'rayvl' has no attribute {name!r}")
