"""Make timm importable next to a CPU build of torch, and import timm and DeepSpeed without the loggers they import
for features rayvl does not use (``import_without``).

timm imports torchvision at import time (timm/layers/create_norm.py). On machines without CUDA the only
torchvision 0.28 on the registry is a CUDA build (``0.28.0+cu130``); its C extension cannot load over CPU torch,
and its ``_meta_registrations`` then fails on ``register_fake("torchvision::nms")`` because the op schema was
never defined. We define the two schemas that module registers fake kernels for (``nms``, ``qnms``) so the import
succeeds; torchvision.ops kernels and torchvision.io stay unavailable, which rayvl never uses (JPEGs are decoded
with Pillow). This is a no-op whenever torch itself has CUDA or torchvision is a CPU build (it then defines the
schemas itself), so a GPU cluster runs the stock packages untouched.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # keep the torch.library.Library alive: dropping it would unregister the schemas


def torchvision_is_cuda_build_over_cpu_torch() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations or torch.version.cuda is not None:
        return False
    version_file = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    if not version_file.exists():
        return False
    match = re.search(r"__version__\s*=\s*'([^']+)'", version_file.read_text())
    return bool(match and "+cu" in match.group(1))


def ensure_torchvision_importable() -> None:
    """Call before anything imports timm."""
    global _library
    if _library is not None or "torchvision" in sys.modules or not torchvision_is_cuda_build_over_cpu_torch():
        return
    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)


def import_without(module: str, optional: str):
    """``import module`` leaving out ``optional``, a package that ``module`` imports only where it is installed
    (``try: import optional / except ImportError``) for a feature rayvl never calls — unless this process imported
    either already. Every Ray Train worker imports timm and DeepSpeed in its start-up; timm imports wandb for its
    training scripts' summaries (timm.utils.summary), DeepSpeed mlflow for its autotuner, while only the driver logs
    to W&B or MLflow (rayvl.train.run_log). ``module`` then sees ``optional`` as absent; a later ``import optional``
    in this process imports it as usual."""
    if module in sys.modules or optional in sys.modules:
        return importlib.import_module(module)
    sys.modules[optional] = None  # `import optional` raises ImportError, which module's optional import catches
    try:
        return importlib.import_module(module)
    finally:
        del sys.modules[optional]


def import_timm():
    """timm, importable next to a CPU torch and without wandb (import_without)."""
    ensure_torchvision_importable()
    return import_without("timm", "wandb")
