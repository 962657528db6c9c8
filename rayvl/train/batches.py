"""Endless per-worker batches from a Ray Data shard, with the time spent waiting and starvation detection.

Ray Data inside Ray Train can starve silently (operators stay "pending" when workers hold every CPU). A producer
thread iterates the shard epoch after epoch; the training thread waits at most ``data.stall_timeout_s`` for a
batch and then fails with an error that says what to change, instead of hanging. On a GPU the batches arrive on
the worker's own device (rayvl.train.devices), copied from pinned host memory on a CUDA stream of the producer's
own, so that the copy overlaps the step (on the device's default stream, where Ray Data's own thread would copy, it
waits for the step's kernels and they for it); the training thread's stream waits for each batch's copy only. With
``data.decode: device`` the batches carry JPEG bytes and crop boxes, decoded into ``image`` on that stream
(rayvl.device_decode: nvJPEG on a GPU).
"""
from __future__ import annotations

import itertools
import queue
import logging
import threading
import time
import warnings
from typing import Iterator

import numpy as np
import torch
from ray.data.collate_fn import NumpyBatchCollateFn

from rayvl import device_decode
from rayvl.config import RayvlConfig
from rayvl.data.pipeline import TRAIN_COLUMNS, read_columns
from rayvl.data.report import DataPlaneError
from rayvl.data.seeding import shuffle_seed
from rayvl.train import devices

ROW = "row"  # the row id of the data position (data/position.py); training shards carry it, image-label data not
_END = object()
COLUMNS = list(dict.fromkeys(read_columns("device") + TRAIN_COLUMNS + [ROW]))  # a batch's, as the read tasks make it
log = logging.getLogger("rayvl")


CPU = torch.device("cpu")


def batch_stream(shard, cfg: RayvlConfig, size: int | None = None, begin=None, rank: int = 0,
                 stream: int = 0, device: torch.device = CPU) -> Iterator[tuple[dict, float]]:
    """(micro-batch of torch tensors on ``device``, seconds waited for it), endlessly. ``begin(n)`` is called
    before the n-th further execution of the dataset (``epochs``); the shuffle buffer is seeded per (rank,
    ``stream``, execution). ``device`` carries its index: the producer thread binds it (a bare "cuda" in a new
    thread would mean GPU 0)."""
    t = cfg.train
    seeds = shuffle_seeds(cfg, rank, stream)

    # JPEG bytes stay a list (Ray Data's collation makes tensors of every column)
    collate = {"collate_fn": EncodedImages(device.type == "cuda")} if cfg.data.decode == "device" else {}

    def batches():
        for batch in epochs(lambda: shard.iter_torch_batches(  # pinned host tensors: the copy is prefetched's
                batch_size=t.micro_batch_size if size is None else size, drop_last=True,
                prefetch_batches=cfg.data.prefetch_batches, local_shuffle_seed=next(seeds),
                local_shuffle_buffer_size=cfg.data.local_shuffle_buffer or None, device=CPU,
                pin_memory=device.type == "cuda" and not collate, **collate), begin):
            yield {k: batch[k] for k in COLUMNS if k in batch}

    return prefetched(batches, cfg, device, copy=True)


def shuffle_seeds(cfg: RayvlConfig, rank: int, stream: int = 0) -> Iterator[int]:
    """The local shuffle seed of each next execution of one of this rank's streams: ``epochs`` calls its iterator
    factory once per execution, which takes the next one."""
    return (shuffle_seed(cfg.train.seed, rank, execution, stream) for execution in itertools.count())


def epochs(iterate, begin=None) -> Iterator:
    """Execution after execution of a Ray Data iterator (streaming_split(equal=True) gives every rank the same
    count). A training dataset lists every pass its run needs (shards.passes_needed), so a second execution — and
    its start-up stall — happens only when dropped samples made the listed passes too few; ``begin(k)`` tells the
    read tasks of the k-th further execution to number their passes after the listed ones."""
    for execution in itertools.count():
        if execution and begin is not None:
            begin(execution)
        n = 0
        for batch in iterate():
            yield batch
            n += 1
        if n == 0:
            raise DataPlaneError("an epoch produced no full batch: every sample was dropped or there are "
                                 "fewer samples than train.micro_batch_size × train.num_workers")


def prefetched(make, cfg: RayvlConfig, device: torch.device = CPU, copy: bool = False,
               watched: bool = True) -> Iterator[tuple[object, float]]:
    """Items of ``make()`` produced by a thread started now, bound to ``device`` — the Ray Data execution starts
    while the caller builds the model and the DeepSpeed engine, instead of at the first step; the consumer waits
    at most data.stall_timeout_s for each item (``watched``; unwatched where ``make()`` reads a stream that is
    watched itself, and one item may take many of its reads). ``copy``: the items are dicts of host tensors, pinned
    where ``device`` is a GPU, which the producer copies there on a stream of its own (DeviceCopy)."""
    q: queue.Queue = queue.Queue(maxsize=max(1, cfg.data.prefetch_batches))
    failure: list[BaseException] = []
    copies = DeviceCopy(device, cfg.data.image_size) if copy else None

    def produce():
        try:
            devices.bind(device)  # a new thread's CUDA device is GPU 0, whatever its worker's is
            for item in make():
                q.put(copies.send(item) if copies else (item, None))
        except BaseException as e:  # handed to the training thread, which raises it
            failure.append(e)
            q.put(_END)

    threading.Thread(target=produce, name="rayvl-batches", daemon=True).start()
    return _consume(q, failure, cfg.data.stall_timeout_s if watched else None, copies)


class EncodedImages(NumpyBatchCollateFn):
    """A Ray Data collate function (numpy batches) for batches whose images travel encoded (data.decode: device):
    every column a host tensor — pinned for a GPU — but the JPEG bytes, a list."""

    def __init__(self, pin: bool):
        super().__init__()
        self.pin = pin

    def __call__(self, batch: dict) -> dict:
        out = {}
        with warnings.catch_warnings():  # Ray's zero-copy columns are read-only; nothing here writes into them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for name, values in batch.items():
                if name == "image_bytes":
                    out[name] = list(values)
                elif np.asarray(values).dtype != object:  # keys and captions stay behind, as without a collate
                    tensor = torch.from_numpy(np.ascontiguousarray(values))
                    out[name] = tensor.pin_memory() if self.pin else tensor
        return out


class DeviceCopy:
    """Host-to-GPU copies of batches on a CUDA stream of their own: ``send`` (in the producer thread) queues a
    batch's non-blocking copies there — and the decoding of its JPEGs, where they travel encoded (``decoded``) —
    and marks their end with an event; ``receive`` (in the training thread) makes the training stream wait for that
    event — on the GPU, not the host — and tells the caching allocator that the training stream uses the tensors
    (their memory came from the copy stream). On a CPU both pass the batch through, its JPEGs decoded."""

    def __init__(self, device: torch.device, image_size: int = 0):
        self.device, self.image_size = device, image_size
        self.stream = None  # made in the producer thread, on its bound device
        self.blank = 0  # rows whose JPEG no decoder here took, trained on as blank images
        self.said = False  # the log named the decoder

    def send(self, batch: dict) -> tuple[dict, object]:
        if self.device.type != "cuda":
            return self.decoded(batch), None
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            # the boxes stay on the host, where the decoder reads them
            batch = self.decoded({k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) and k != "image_box"
                                  else v for k, v in batch.items()})
            return batch, self.stream.record_event()

    def decoded(self, batch: dict) -> dict:
        """``batch`` with its JPEG bytes and boxes (data.decode: device) decoded into ``image`` on the device. A
        row no decoder takes — its read task found its header whole — keeps its place in the micro-batch (every
        rank steps on as many rows) as a blank image, and is said in the log with the count so far."""
        if "image_bytes" not in batch:
            return batch
        if not self.said:
            self.said = True
            log.info(f"data.decode=device: the training JPEGs decoded by {device_decode.device_decoding(self.device)}")
        batch = dict(batch)
        data, boxes = batch.pop("image_bytes"), batch.pop("image_box")
        crops, ok = device_decode.decoded(data, boxes.cpu().numpy(), self.image_size, self.device)
        if ok.all():
            return {"image": crops, **batch}
        image = torch.zeros((len(ok), 3, self.image_size, self.image_size), dtype=torch.uint8, device=self.device)
        image[torch.from_numpy(np.flatnonzero(ok)).to(self.device)] = crops  # rare: a pageable copy will do
        self.blank += int((~ok).sum())
        log.warning(f"data.decode=device: {self.blank} training row(s) so far whose JPEG neither the device's "
                    f"decoder nor Pillow decodes (their headers were whole), trained on as blank images")
        return {"image": image, **batch}

    def receive(self, batch: dict, copied) -> dict:
        if copied is None:
            return batch
        training = torch.cuda.current_stream(self.device)
        training.wait_event(copied)
        for v in batch.values():
            v.record_stream(training)
        return batch


def _consume(q: queue.Queue, failure: list, stall_timeout_s: float | None,
             copies: DeviceCopy | None = None) -> Iterator[tuple[object, float]]:
    while True:
        started = time.perf_counter()
        try:
            item = q.get(timeout=stall_timeout_s)
        except queue.Empty:
            raise DataPlaneError(
                f"no batch for {stall_timeout_s:.0f} s (data.stall_timeout_s): the Ray Data pipeline is starved "
                f"or stuck. Leave CPUs for it: lower train.cpus_per_worker or data.read_cpus, or add nodes."
            ) from None
        if item is _END:
            raise failure[0]
        item, copied = item
        yield (copies.receive(item, copied) if copies else item), time.perf_counter() - started
