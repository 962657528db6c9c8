"""Training runs on Ray Train. The package is also the Python API's entry point: ``rayvl.train(config)`` runs one
training job to its end and returns its ``RunResult`` (rayvl.train.trainer.train: the run directory ``uri`` /
``run_dir``, the final ``checkpoint_dir``, the last report's ``metrics``, the ``data_report``)."""
from __future__ import annotations

import sys
import types


class _Callable(types.ModuleType):
    """This package, callable: ``rayvl.train(config, overrides=(), **options)``."""

    def __call__(self, config="laion_adapt", overrides=(), **options):
        """Train ``config`` — a RayvlConfig (rayvl.config.load_config), its ``to_dict()`` form, or a recipe's name
        or YAML path — with ``overrides`` ("key=value", as --set) applied, checked before Ray starts (ConfigError
        naming the key). ``options``: rayvl.train.trainer.train's (``callbacks``: Ray Train UserCallbacks;
        ``progress``: a progress line per report; ``verbose``). Connects to the Ray of ``ray_address`` /
        RAY_ADDRESS, else starts a local one."""
        from rayvl.config import RayvlConfig, from_dict, load_config, with_overrides
        from rayvl.train.trainer import train

        if isinstance(config, dict):
            config = from_dict(config)
        if isinstance(config, RayvlConfig):  # rebuilt and checked as a recipe is: it reaches the workers as it is
            config = with_overrides(from_dict(config.to_dict()), list(overrides))
        else:
            config = load_config(config, list(overrides))
        return train(config, **options)


sys.modules[__name__].__class__ = _Callable
