"""Checkpoints and mid-epoch resume on a worker, in one place.

Saving and restoring a run in the format of ``rayvl.checkpoints``: every rank's DeepSpeed files, the train state, and
(final checkpoints) consolidated weights, reported through ``ray.train.report``. Every rank saves into its own local
directory and reports it; Ray Train merges the ranks' files into one checkpoint directory in the run's storage (the
DeepSpeed file names carry the rank), so no shared filesystem is needed between nodes.

The data position: the one of the checkpoint Ray Train restores goes to the run's data report before any stream
starts (read tasks plan from it: rayvl.data.position), the rows trained on are kept until a checkpoint, and at a
checkpoint every rank's rows settle on rank 0 into the position saved with it."""
from __future__ import annotations

import io
import json
import tempfile
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path

import ray
import ray.train
import torch

from rayvl.checkpoints import CURRENT_DECAY_RULE, DECAY_RULE, META_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE, TAG, \
    read_train_state, weights_only_loads
from rayvl.data.position import DataPosition
from rayvl.data.report import report_actor
from rayvl.train.faults import fail_here
from rayvl.train.state import TrainState
from rayvl.train.batches import ROW
from rayvl.train.worker import WorkerSetup


def consolidated_state_dict(engine) -> dict | None:
    """Full fp32 model weights on rank 0 (gathered from ZeRO-3 partitions when needed), None elsewhere. Under bf16
    the trained parameters are the optimizer's fp32 master copies, not their bf16 rounding."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    rank = torch.distributed.get_rank()
    gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None) \
        if engine.zero_optimization_stage() == 3 else nullcontext()
    with gathered:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else None
    masters = {}
    if engine.bfloat16_enabled():  # a collective: every rank asks for every parameter, in the same order
        masters = {name: safe_get_full_fp32_param(p) for name, p in module.named_parameters()}
    if state is None:
        return None
    return {k: (masters[k] if masters.get(k) is not None else v).float().cpu() if v.is_floating_point() else v
            for k, v in state.items()}


@contextmanager
def saved(engine, state: TrainState, config: dict, final: bool):
    """Write this rank's part of the checkpoint into a temporary directory and yield it as a Checkpoint; ``final``
    (the last step of this invocation) adds the consolidated weights, and the run is finished (``rayvl.json``)
    when that step is ``train.max_steps``."""
    with tempfile.TemporaryDirectory(prefix="rayvl-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=TAG)
        fail_here("checkpoint_write", state.progress)
        weights = consolidated_state_dict(engine) if final else None  # every rank joins the ZeRO-3 gather
        if torch.distributed.get_rank() == 0:
            torch.save(state.state_dict(), Path(tmp) / STATE_FILE)
            meta = {"step": state.progress.step, "config": config,
                    "final": state.progress.step == config["train"]["max_steps"],
                    ALIGNED: getattr(engine, "rayvl_aligned", True),
                    DECAY_RULE: getattr(engine, "rayvl_decay_rule", CURRENT_DECAY_RULE)}
            (Path(tmp) / META_FILE).write_text(json.dumps(meta))
            with open(Path(tmp) / METRICS_FILE, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in state.progress.history)
            if weights is not None:
                torch.save(weights, Path(tmp) / MODEL_FILE)
        yield ray.train.Checkpoint.from_directory(tmp)


ALIGNED = "zero_parameter_alignment"  # rayvl.json: the checkpoint's ZeRO-1/2 buffers are padded (engine.zero_config)


def decay_rule(checkpoint: ray.train.Checkpoint | None) -> int:
    """The weight-decay rule a resume groups its parameters by: its checkpoint's (1 for one written before the rule
    was recorded); the current one for a new run."""
    if checkpoint is None:
        return CURRENT_DECAY_RULE
    with checkpoint.filesystem.open_input_file(f"{checkpoint.path}/{META_FILE}") as f:
        return int(json.loads(f.read()).get(DECAY_RULE, 1))


def aligned_buffers(checkpoint: ray.train.Checkpoint | None) -> bool:
    """Whether a resume builds ZeRO-1/2's buffers padded: as its checkpoint was written — unpadded for one written
    before the padding was recorded (DeepSpeed loads a checkpoint into its own layout only); padded for a new run."""
    if checkpoint is None:
        return True
    with checkpoint.filesystem.open_input_file(f"{checkpoint.path}/{META_FILE}") as f:
        return bool(json.loads(f.read()).get(ALIGNED, False))


def restored_state(checkpoint: ray.train.Checkpoint) -> dict:
    """The train state of a checkpoint, read alone (not its DeepSpeed files) from wherever it is stored."""
    with checkpoint.filesystem.open_input_file(f"{checkpoint.path}/{STATE_FILE}") as f:
        data = f.read()
    with weights_only_loads(checkpoint.path):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def restore(engine, state: TrainState, train_state: dict | None = None) -> bool:
    """Load Ray Train's latest checkpoint (if any) into the engine and the train state (``train_state``: that
    checkpoint's, when the caller has read it already); True if one was loaded."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return False
    with checkpoint.as_directory() as d, weights_only_loads(checkpoint.path):
        engine.load_checkpoint(d, tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        state.load_state_dict(train_state if train_state is not None else read_train_state(d))
    return True


class TrainedRows:
    """The row ids (and TOnICS objects) of the micro-batches trained since the last checkpoint, left where they
    are until the data position needs them: a copy to the host per micro-step would wait for the GPU each time."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def add(self, batch: dict) -> None:
        if ROW in batch:
            self.parts.append(tuple(batch[k] for k in (ROW, "object") if k in batch))

    def flush(self, position: DataPosition) -> None:
        """Hand every row since the last flush to ``position`` (DataPosition.trained)."""
        if self.parts:
            position.trained(*(torch.cat(column).cpu().numpy() for column in zip(*self.parts)))
        self.parts = []


class DataResume:
    """The data position of one worker and what it exchanges with the run's data report."""

    def __init__(self, setup: WorkerSetup, rank: int, world: int):
        self.setup, self.rank, self.world = setup, rank, world
        self.position = DataPosition(setup.train_shards, setup.train_mix)
        self.rows = TrainedRows()

    def restore(self):
        """Before any stream starts: the restored checkpoint's position (or none) to the data report; the reports
        of the methods' own streams start again. Returns (that checkpoint's train state, read once here for
        checkpoint.restore, or None; ``begin(n)``, which numbers the passes of the n-th further Ray Data execution,
        train/batches.epochs — None without a report)."""
        import torch.distributed as dist

        ckpt = ray.train.get_checkpoint()
        saved = restored_state(ckpt) if ckpt is not None else None
        restored = saved.get("data_position") if saved is not None else None
        if restored is not None:
            self.position.load_state_dict(restored)
        if not self.setup.report_name:
            return saved, None
        actor, token = report_actor(self.setup.report_name), uuid.uuid4().hex
        if self.rank == 0:  # a new token per worker group: what the lost group's reads counted is dropped
            ray.get(actor.restore.remote(token, restored, self.position.n_shards, self.position.mix))
            for report in self.setup.stream_reports.values():  # no position: read again from the start, from 0
                ray.get(report_actor(report).restore.remote(token, None, 0))
        if dist.is_initialized():
            dist.barrier()
        first = self.position.execution  # rank 0's moves on at checkpoints; the count starts here
        return saved, lambda n: ray.get(actor.begin_execution.remote(first + n))

    def add(self, batch: dict) -> None:
        self.rows.add(batch)

    def settle(self) -> dict:
        """At a checkpoint: every rank's rows since the last one go to rank 0 (as runs, position.RowSet), which
        settles the shards now finished and their counts; returns the position's summary for the report."""
        import torch.distributed as dist

        self.rows.flush(self.position)
        mine = self.position.take_trained()
        parts = [mine]
        if dist.is_initialized():
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, parts, dst=0)
        if self.rank == 0 and self.setup.report_name:
            actor = report_actor(self.setup.report_name)
            self.position.merge(*parts)
            done = self.position.settle(ray.get(actor.unit_rows.remote(list(self.position.partial))))
            self.position.report, self.position.execution = ray.get(
                actor.settle.remote(done, self.position.open_pass()))
        return self.position.summary()
