"""[UniCL]'s section of the config tree, ``image_label``; registered with the method (rayvl/methods/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rayvl.local_paths import FilePath, NamedOrSpec


@dataclass
class ImageLabelConfig:
    """Image-label data mixed with image-text data ([UniCL] §3, App. B.2)."""

    data: NamedOrSpec = ""
    """'' = none; "fashion-mnist" (Debian dataset-fashion-mnist), a folder of Fashion-MNIST IDX files, or
    shards whose samples carry ``cls`` (a member, as webdataset's classification shards do, or in their JSON)."""
    classes: FilePath = ""
    """JSON {"classes": [...]}: the name of each class id ('' = Fashion-MNIST's names for Fashion-MNIST)."""
    templates: FilePath = ""
    """JSON {"templates": [...]} with "{}" for the class name ('' = CLIP's 80 ImageNet templates)."""
    train_classes: list[int] = field(default_factory=list)
    """class ids trained on ([] = all); the others stay unseen, for zero-shot on held-out classes."""
    weight: float = 0.5
    """share of every micro-batch drawn from image-label data ([UniCL] App. B.2: 1:1); 1.0 = image-label only."""
    limit: int = 0
    """use only the first N Fashion-MNIST training images (0 = all 60,000): quick runs, or the rest kept apart
    (jobs/unicl_coverage.py captions them as image-text pairs)."""
