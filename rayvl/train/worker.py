"""What every training worker gets from the driver (``WorkerSetup``, frozen, typed) and what it knows of itself once
started (``Worker``): the two things a method's training part is built from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rayvl.config import RayvlConfig
from rayvl.train.startup import Startup


@dataclass(frozen=True)
class WorkerSetup:
    """What the driver hands a run's workers beside the Ray Datasets (their setup).

    ``config``: the validated config tree, typed (the driver checked it before Ray started); ``report_name``:
    the run's training data report (rayvl.data.report), ``stream_reports`` those of the streams the methods' data
    parts read beside it, by stream;
    ``tokenizer_path``: the text tower's tokenizer on the workers' disk; ``train_shards``: shard reads a pass holds
    (the data position's size), ``train_mix`` the upsampled sources' (shards, reads) (rayvl.data.mix; () = none);
    ``init_from``: weights a new run starts from ('' = none); ``eval_files``: the held-out task files
    (classes_file, paraphrases_file, sts_file); ``placement_registry``: the sweep's named actor that collects the
    trials' placement groups ('' = not in a sweep); ``method_inputs``: what each enabled method's training part
    needs from the driver, by method name (e.g. the TOnICS class sizes); ``startup``: the driver's
    start-up stamps (rayvl.train.startup), which rank 0 completes and reports."""

    config: RayvlConfig
    report_name: str = ""
    stream_reports: dict[str, str] = field(default_factory=dict)
    tokenizer_path: str = ""
    train_shards: int = 0
    train_mix: tuple = ()
    init_from: str = ""
    eval_files: dict[str, str] = field(default_factory=dict)
    placement_registry: str = ""
    method_inputs: dict[str, dict] = field(default_factory=dict)
    startup: Startup | None = None


@dataclass
class Worker:
    """One training worker of a run: its setup, config, place in the group and device, ``begin`` (the callback that
    numbers the passes of a further Ray Data execution, rayvl.train.resume) and the held-out evaluation."""

    setup: WorkerSetup
    cfg: RayvlConfig
    rank: int
    world: int
    device: torch.device
    begin: Callable[[int], None] | None
    evaluation: object  # rayvl.train.evaluation.Evaluation

    def inputs(self, method: str) -> dict:
        """What the driver resolved for ``method`` (WorkerSetup.method_inputs)."""
        return self.setup.method_inputs.get(method, {})
