"""How embeddings are computed — the only thing in which training-time evaluation and ``rayvl eval`` differ.

- ``ModelEmbedder``: a model in this process. Inside a process group of ``world`` ranks every rank embeds an equal
  slice (padded) and the slices are all-gathered in order, so every rank runs the same forwards — which ZeRO-3
  needs, since each forward all-gathers partitioned parameters. On a GPU it embeds under the autocast dtype it is
  given (training-time evaluation: the run's precision, ``inference``), else in the model's own dtype.
- ``ActorEmbedder``: a pool of Ray actors, each loading the checkpoint once and embedding images (streamed to
  them by Ray Data) and texts; rows carry an ``index`` or ``key`` column so the result is put back in order.
  Actors given GPUs (``gpus_per_actor``) embed on theirs, in bf16 autocast; the others on CPU in fp32, as
  training-time evaluation on CPU does.
- ``LocalEmbedder``: ``rayvl eval``'s one model in its own process on a machine with no Ray — the same model code
  as an actor's, the batches a local torch DataLoader's workers decode embedded where they arrive.

All return float32 numpy arrays of L2-normalised embeddings, one row per input.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
import warnings
from collections import Counter

import numpy as np
import ray
import torch
import torch.distributed as dist

from rayvl import assets, device_decode
from rayvl.checkpoints import load_model
from rayvl.config import EVAL_CPU_BATCH, EVAL_GPU_BATCH, ConfigError
from rayvl.data import encoded_jpegs
from rayvl.data.text import tokenize

log = logging.getLogger("rayvl")
DEVICE_EMBEDDINGS_BYTES = 256 << 20  # an embedding model's image embeddings held on its device between copies back
QUEUED_BATCHES = 2  # forwards a GPU model keeps queued before the host waits for the oldest: it prepares the next


def batch_size(setting: int, gpu: bool, train_batch: int = 0) -> int:
    """``eval.batch_size``, or where it is 0 (the default): ``EVAL_GPU_BATCH`` images a forward on a GPU and
    ``EVAL_CPU_BATCH`` on a CPU — in training on a GPU, its rank's micro-batch, within those bounds (it held that
    batch's activations for the backward: an inference forward of as many holds a fraction; open_clip evaluates
    at its training batch)."""
    if setting:
        return setting
    if not gpu:
        return EVAL_CPU_BATCH
    return max(EVAL_CPU_BATCH, min(EVAL_GPU_BATCH, train_batch)) if train_batch else EVAL_GPU_BATCH


def array_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` (``device_decode.to_device``: to a GPU without blocking)."""
    with warnings.catch_warnings():  # Ray's zero-copy batches are read-only; nothing here writes into them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return device_decode.to_device(torch.from_numpy(np.ascontiguousarray(a)), device)


class ModelEmbedder:
    def __init__(self, model, tokenizer_path: str, max_tokens: int, batch_size: int = 128, rank: int = 0,
                 world: int = 1, autocast: torch.dtype | None = None):
        """``autocast``: the dtype a GPU embeds in under torch.autocast (None: the model's own); a CPU embeds as
        the model computes."""
        self.model, self.tokenizer_path, self.max_tokens = model, tokenizer_path, max_tokens
        self.batch_size, self.rank, self.world, self.autocast = batch_size, rank, world, autocast
        self.device = next(model.parameters()).device

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return array_to_device(a, self.device)

    # no_grad, not inference_mode: the model trains on after this (ZeRO-3 gathers its weights in these forwards)
    @torch.no_grad()
    def images(self, images: np.ndarray) -> np.ndarray:
        with inference(self.device, self.autocast):
            return self._split(lambda j: self.model.encode_image(self._tensor(images[j])), len(images))

    @torch.no_grad()
    def texts(self, texts: list[str]) -> np.ndarray:
        ids, mask = tokenize(list(texts), self.tokenizer_path, self.max_tokens)
        with inference(self.device, self.autocast):
            return self._split(lambda j: self.model.encode_text(self._tensor(ids[j]), self._tensor(mask[j])),
                               len(ids))

    def _split(self, encode, n: int) -> np.ndarray:
        """This rank's rows (padded to an equal count with the last row), encoded in batches, gathered in order."""
        per = math.ceil(n / self.world)
        index = np.minimum(np.arange(self.rank * per, (self.rank + 1) * per), n - 1)
        bs = self.batch_size
        mine = torch.cat([encode(index[i:i + bs]) for i in range(0, per, bs)]).float().contiguous()
        if self.world > 1 and dist.is_initialized():
            parts = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(parts, mine)
            mine = torch.cat(parts)
        return mine[:n].cpu().numpy()


class NoCudaError(RuntimeError):
    """Ray gave this process GPUs, but its torch cannot use them."""


def no_cuda_cause(error: BaseException) -> str | None:
    """The NoCudaError message behind a failed job: an actor that raised it in ``__init__`` dies, and Ray's
    ActorDiedError keeps only the text of its traceback, so the message is read from that."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = re.search(r"NoCudaError: (.+)", str(error))
        if isinstance(error, NoCudaError) or found:
            return str(error) if isinstance(error, NoCudaError) else found.group(1).strip()
        error = error.__cause__ or error.__context__
    return None


EVAL_GPUS_OFF = "rayvl eval --gpus 0"  # what runs an evaluation without GPUs, named where CUDA cannot be used


def actor_device(off: str = EVAL_GPUS_OFF) -> torch.device:
    """``cuda`` when Ray gave this process a GPU — it then sees only the GPUs it was given (Ray sets
    CUDA_VISIBLE_DEVICES), so ``cuda`` is its own — else ``cpu``: an actor without GPUs on a GPU node still sees
    every GPU of the node (Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone there), so CUDA being there decides nothing.
    ``off``: the setting that runs the command without GPUs, named when CUDA cannot be used."""
    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    if not gpus:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU build: install a CUDA build of torch on the GPU nodes "
               f"(https://pytorch.org/get-started/locally/)" if torch.version.cuda is None else
               f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU (NVIDIA driver; "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        given = ", ".join(sorted(map(str, gpus)))
        raise NoCudaError(f"this Ray actor was given GPU {given}, but {why}; or run without GPUs ({off})")
    return torch.device("cuda")


def inference(device: torch.device, dtype: torch.dtype | None = torch.bfloat16):
    """``dtype`` (bf16) autocast on a GPU (embeddings are returned in fp32); on CPU, or with ``dtype`` None, nothing
    changes, as training embeds."""
    if device.type != "cuda" or dtype is None:
        return contextlib.nullcontext()  # torch.autocast refuses some device types (meta) even when disabled
    return torch.autocast("cuda", dtype=dtype)


class EmbeddingActor:
    """One warm model, reused for every image and every text of an evaluation: the checkpoint's model (built without
    a random init, rayvl.models.meta_init) on this actor's device — on a GPU: NHWC image tower, bf16 autocast,
    batches copied from pinned memory without blocking (PyTorch's caching host allocator reuses the pinned blocks
    once their copies are done); the images' embeddings kept on the GPU (``hold``) and copied back once every
    ``DEVICE_EMBEDDINGS_BYTES`` and at the end (``collect``), so the host never waits for the batch it queued: it
    prepares the next one while the GPU runs it, and waits only for the forward ``QUEUED_BATCHES`` before."""

    def __init__(self, checkpoint: str, off: str = EVAL_GPUS_OFF, device: torch.device | None = None):
        self.device = device or actor_device(off)  # ``device``: a model in a process Ray did not start
        self.model, config = load_model(checkpoint)
        if self.device.type == "cuda":
            self.model.to(self.device).vision.to_channels_last()
        self.tokenizer_path = str(assets.text_model_path(config["model"]["text"]))
        self.max_tokens = config["data"]["max_text_tokens"]
        self.held: list[tuple[torch.Tensor, dict]] = []  # embeddings on the device and their rows' other columns
        self.kept, self.back = 0, []  # the bytes held; what was copied back
        self.queued: list = []  # a GPU's events, one a forward queued and maybe not finished
        self.image_size = config["data"]["image_size"]
        self.dropped: Counter = Counter()  # the read counts' change for rows no decoder here decodes (left out)
        self.warm_up(self.image_size)
        self.ready_at = time.time()

    def warm_up(self, image_size: int) -> None:
        """One forward of each tower on a tiny batch before the actor says it is ready: the first call's one-off
        costs (CUDA's libraries and kernels loaded, cuDNN's and oneDNN's set-up) fall in the start-up, not in the
        first batch the rate once running counts."""
        warm = self.on_device({"image": np.zeros((2, 3, image_size, image_size), np.uint8)})[0]
        if self.device.type == "cuda":  # nvJPEG's set-up too (a device-decoded evaluation's first batch met it)
            data, box = encoded_jpegs.prepare(device_decode.tiny_jpeg(), image_size, None, None)
            device_decode.decoded([data, data], [box, box], image_size, self.device)
        if getattr(self.model, "text", None) is not None:  # not a class-embedding model ([UniCL] eq. (4))
            self.texts(["a photo", "a photo of a dog"], 2)
        warm.cpu()  # on a GPU: waits for the forwards

    def decoding(self) -> str:
        """What decodes the JPEGs of device-decoded rows here (device_decode.device_decoding)."""
        return device_decode.device_decoding(self.device)

    def ready(self) -> float:
        """When this actor held its model (wall clock: the driver may be on another node, whose clock NTP keeps
        within milliseconds of this one's)."""
        return self.ready_at

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return array_to_device(a, self.device)

    @torch.inference_mode()
    def images(self, block) -> int:
        """One Ray Data block of images embedded and held (``hold``) with its other columns (index, or key,
        caption and cls): its row count (``collect`` returns the embeddings)."""
        from ray.data.block import BlockAccessor

        embedding, columns = self.on_device(BlockAccessor.for_block(block).to_numpy())
        # copies: a column read from the block is a view of its memory in the object store, which Ray then keeps,
        # the images with it, for as long as the view lives
        self.hold(embedding, {name: np.array(values) for name, values in columns.items()})
        return len(embedding)

    def hold(self, embedding: torch.Tensor, columns: dict) -> None:
        """A batch's embeddings kept where they were computed, copied back with the others held once they hold
        ``DEVICE_EMBEDDINGS_BYTES``; on a GPU, the host waits only for the batch ``QUEUED_BATCHES`` before it."""
        self.held.append((embedding, columns))
        self.kept += embedding.numel() * embedding.element_size()
        if self.device.type == "cuda":
            self.queued.append(torch.cuda.Event(blocking=True))  # a wait that sleeps: the read tasks share the CPUs
            self.queued[-1].record()
            if len(self.queued) > QUEUED_BATCHES:
                self.queued.pop(0).synchronize()
        if self.kept >= DEVICE_EMBEDDINGS_BYTES:
            self.back += copied_back(self.held)
            self.held, self.kept = [], 0

    def drop(self) -> None:
        """Forget what is held: an embedding pass that failed half-way leaves none of its rows to the next."""
        self.held, self.kept, self.back, self.queued, self.dropped = [], 0, [], [], Counter()

    def collect(self) -> tuple[list[dict], Counter]:
        """(every batch held since the last call, in the order held, as ``embed`` returns one — the embeddings
        still on the device copied back in one copy —, the change to the read counts of the rows left out since
        as undecodable: ``decoded``)."""
        out, dropped = self.back + copied_back(self.held), self.dropped
        self.drop()
        return out, dropped

    @torch.inference_mode()
    def embed(self, columns: dict[str, np.ndarray]) -> dict:
        """The embeddings of a batch's ``image`` column, and its other columns."""
        embedding, columns = self.on_device(columns)
        return {"embedding": embedding.cpu().numpy(), **columns}

    @torch.inference_mode()
    def on_device(self, columns: dict[str, np.ndarray]) -> tuple[torch.Tensor, dict]:
        """The embeddings of a batch's ``image`` column where they were computed (on a GPU: queued, not waited
        for), and the batch's other columns."""
        columns = dict(columns)
        if "image_bytes" in columns:  # JPEGs decoded here (device_decode): on a GPU, by it
            columns, images = self.decoded(columns)
        else:
            images = columns.pop("image", ())  # none: the empty block of a read task that kept no row
            images = self._tensor(images) if len(images) else ()
        if not len(images):
            return torch.zeros((0, self.model.cfg.embed_dim), dtype=torch.float32, device=self.device), columns
        with inference(self.device):
            return self.model.encode_image(images).float(), columns

    def decoded(self, columns: dict) -> tuple[dict, torch.Tensor]:
        """(the other columns of the rows that decode, their crops on the device) of a batch's ``image_bytes`` and
        ``image_box``. The rows no decoder takes are left out, and ``dropped`` moves them from the read task's kept
        samples (and their caption's words) to its corrupt images, as the CPU path counts them."""
        images, ok = device_decode.decoded(columns.pop("image_bytes"), columns.pop("image_box"), self.image_size,
                                           self.device)
        if not ok.all():
            left_out = int((~ok).sum())
            words = sum(len(str(c).split()) for c in np.asarray(columns.get("caption", []))[~ok])
            self.dropped.update({"dropped_corrupt_image": left_out, "samples_kept": -left_out,
                                 "caption_words": -words})
            columns = {name: np.asarray(values)[ok] for name, values in columns.items()}
        return columns, images

    def texts(self, texts: list[str], batch_size: int) -> np.ndarray:
        return text_embeddings(self.model, texts, self.tokenizer_path, self.max_tokens, batch_size, self.device,
                               self._tensor)


@torch.inference_mode()
def text_embeddings(model, texts: list[str], tokenizer_path: str, max_tokens: int, batch_size: int,
                    device: torch.device, tensor=None) -> np.ndarray:
    """strings → tokens (the tower's own fast tokenizer) → normalised text embeddings, float32 (n, d): an actor's
    share of a text set, in batches of ``batch_size``, in bf16 autocast on a GPU (``inference``); ``tensor`` puts a
    token array on ``device`` (None: a plain copy). The evaluation's actors and the pseudo-labellers embed here."""
    put = tensor or (lambda a: torch.from_numpy(a).to(device))
    ids, mask = tokenize([str(t) for t in texts], tokenizer_path, max_tokens)
    with inference(device):
        out = [model.encode_text(put(ids[i:i + batch_size]), put(mask[i:i + batch_size])).float()
               for i in range(0, len(ids), batch_size)]
    return torch.cat(out).cpu().numpy() if out else np.zeros((0, model.cfg.embed_dim), np.float32)


def shares(texts: list[str], n: int) -> list[list[str]]:
    """``texts`` split in order into at most ``n`` consecutive non-empty shares (one an actor): their embeddings,
    concatenated in order, are those of ``texts``."""
    return [c.tolist() for c in np.array_split(np.asarray(texts, dtype=object), n) if len(c)]


def gpu_shortfall(gpus_per_actor: float, node_gpus: list[float], largest: dict, autoscaled: bool) -> str:
    """Why an actor of ``gpus_per_actor`` GPUs can never be placed ('' when it can): with an autoscaler config,
    more than the cluster can grow to; without, more than its largest node has."""
    most = largest.get("GPU", 0.0) if autoscaled else max(node_gpus, default=0.0)
    if gpus_per_actor <= 0 or most >= gpus_per_actor - 1e-9:
        return ""
    if autoscaled:
        return f"the cluster can grow to {most:g} GPUs (its autoscaler config)"
    return f"no node has more than {most:g} GPUs" if most else "the cluster has no GPUs"


def check_gpus(gpus_per_actor: float, setting: str, off: str, fixed_size: bool) -> None:
    """Actors asking for GPUs the cluster will never have would wait forever: an error on a Ray of fixed size
    (``fixed_size``: started by this driver) or whose autoscaler config cannot add them, a warning on a cluster
    with no autoscaler config on this node (one may run elsewhere, as KubeRay's does)."""
    if gpus_per_actor <= 0:
        return
    from rayvl import session

    largest, autoscaled = session.largest_cluster()
    nodes = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]]
    why = gpu_shortfall(gpus_per_actor, nodes, largest, autoscaled)
    if not why:
        return
    problem = (f"{setting}: each actor asks for {gpus_per_actor:g} GPU(s), but {why}, so they would wait forever; "
               f"run on CPU ({off}) or on a cluster with GPU nodes")
    if fixed_size or autoscaled:
        raise ConfigError(problem)
    log.warning("%s (no autoscaler config on this node: waiting in case one adds GPUs)", problem)


def pool_options(actors: int, cpus_per_actor: float, gpus_per_actor: float = 0.0) -> dict:
    """A pool of ``actors`` embedding actors (``concurrency``), each reserving these CPUs and GPUs."""
    return {"concurrency": actors, "num_cpus": cpus_per_actor, "num_gpus": gpus_per_actor}


TEXT_BATCH = 4  # texts embed in batches this many times an image batch: a text costs a fraction of an image
IN_FLIGHT_BYTES = 512 << 20  # decoded images read ahead of the actors: what an eval holds, however large its set
STORE_SHARE_IN_FLIGHT = 4  # ... and at most this fraction of the object store: Ray Data reads within the rest
BLOCKS_AHEAD = 2  # blocks an actor has sent whatever their bytes: the next is there when it ends one


def in_flight_bytes() -> int:
    """The bytes of blocks the driver keeps sent to the actors and not yet embedded: ``IN_FLIGHT_BYTES``, or a
    quarter of the cluster's object store where that is less (Ray Data's own budget is half of it)."""
    store = ray.cluster_resources().get("object_store_memory", 0)
    return int(min(IN_FLIGHT_BYTES, store / STORE_SHARE_IN_FLIGHT)) if store else IN_FLIGHT_BYTES


class BlockStream:
    """The blocks of a Ray Dataset as (reference, bytes), read as they are iterated, with Ray Data told what the
    caller still holds (``hold`` / ``release``). Ray Data's ``iter_internal_ref_bundles`` names no consumer, and
    Ray Data then reads a pipeline's last operator on whatever its budget says, as it does for a write: the whole
    set went through the object store, and spilled, while the actors started. ``iter_batches`` and
    ``streaming_split`` tell the executor the bytes their consumer holds; this does the same for the references a
    driver hands to its actors (Ray 2.60: ``StreamingExecutor.set_external_consumer_bytes``)."""

    def __init__(self, ds: ray.data.Dataset):
        self.bundles, _, self.executor = ds._execute_to_iterator(capture_executor=False)
        self.held = 0
        self._tell()

    def __iter__(self):
        for bundle in self.bundles:
            for block in bundle.blocks:
                yield block.ref, block.metadata.size_bytes or 0

    def hold(self, size: int) -> None:
        self.held += size
        self._tell()

    def release(self, size: int) -> None:
        self.held -= size
        self._tell()

    def _tell(self) -> None:
        if self.executor is not None:  # None: a materialised set, read already
            self.executor.set_external_consumer_bytes(max(0, self.held))


def in_order(parts: list[dict]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The embedded blocks' rows put in order — by their ``index`` column (0..N-1), else by ``key`` —: (embeddings,
    the rows' other columns)."""
    parts = [p for p in parts if len(p["embedding"])]
    if not parts:
        raise ValueError("no image of the evaluation set could be read (every sample dropped, or none there)")
    merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(merged["index"] if "index" in merged else merged["key"].astype(str), kind="stable")
    return merged["embedding"][order], {k: v[order] for k, v in merged.items() if k != "embedding"}


class ActorEmbedder:
    """A pool of ``EmbeddingActor``s, started at once (they load their model while Ray Data starts reading) and
    kept for every call: images streamed to them block by block (nothing is materialised), then every text, split
    among them. ``close`` ends them. ``off``: the setting that runs the command without GPUs (actor_device)."""

    def __init__(self, checkpoint: str | os.PathLike, actors: int = 1, cpus_per_actor: float = 0.5,
                 batch_size: int = 128, gpus_per_actor: float = 0.0, off: str = EVAL_GPUS_OFF):
        options = pool_options(actors, cpus_per_actor, gpus_per_actor)
        remote = ray.remote(EmbeddingActor).options(num_cpus=options["num_cpus"], num_gpus=options["num_gpus"])
        self.started = time.time()
        self.actors = [remote.remote(str(checkpoint), off) for _ in range(options["concurrency"])]
        self.ready = [a.ready.remote() for a in self.actors]  # answered once each actor holds its model
        self.batch_size = batch_size
        self.rows: dict[str, np.ndarray] = {}  # the other columns of the last images() call's rows, in its order
        self.dropped: Counter = Counter()  # the last images() call's read counts' change (EmbeddingActor.decoded)

    def first_ready(self) -> float:
        """When (wall clock) the first actor held its model: the pool's start-up ends there, and the rate once
        running counts from there."""
        return min(ray.get(self.ready))

    def images(self, images: ray.data.Dataset) -> np.ndarray:
        """Embeddings of every row of ``images``, ordered by its ``index`` column (0..N-1) or else by ``key``;
        the rows' other columns, in the same order, in ``rows``. The driver hands the blocks' references (never
        their data) to the actors in turn as Ray Data makes them — the reading starts at once, beside the actors'
        start — and holds at most ``in_flight_bytes`` of blocks sent and not yet embedded (``BLOCKS_AHEAD``
        blocks an actor at least, the next one there while it embeds one): past that it waits for an actor, and
        Ray Data, told what it holds (``BlockStream``), holds the reading within its own budget, so a set larger
        than the object store streams through it. The actors keep the embeddings (``EmbeddingActor.hold``) and
        return them all at the end, a copy back each."""
        ray.get([a.drop.remote() for a in self.actors])
        stream, pending, sent = BlockStream(images), {}, 0
        budget = in_flight_bytes()
        for ref, size in stream:
            while len(pending) >= BLOCKS_AHEAD * len(self.actors) and stream.held + size > budget:
                done, _ = ray.wait(list(pending), num_returns=1)
                ray.get(done)  # an actor's error, raised here
                stream.release(pending.pop(done[0]))
            pending[self.actors[sent % len(self.actors)].images.remote(ref)] = size
            stream.hold(size)
            sent += 1
        ray.get(list(pending))
        collected = ray.get([a.collect.remote() for a in self.actors])
        self.dropped = Counter()
        for _, dropped in collected:
            self.dropped.update(dropped)  # update, not +: + keeps only the positive counts
        embeddings, self.rows = in_order([part for held, _ in collected for part in held])
        return embeddings

    def decoding(self) -> str:
        return ray.get(self.actors[0].decoding.remote())

    def texts(self, texts: list[str]) -> np.ndarray:
        size = self.batch_size * TEXT_BATCH
        split = shares(texts, len(self.actors))
        return np.concatenate(ray.get([a.texts.remote(c, size) for a, c in zip(self.actors, split)]))

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def copied_back(held: list[tuple[torch.Tensor, dict]]) -> list[dict]:
    """Batches' embeddings held on their device, and their other columns, as ``embed`` returns them: the
    embeddings copied to the host in one copy (one wait for the device)."""
    if not held:
        return []
    host, at, out = torch.cat([e for e, _ in held]).cpu().numpy(), 0, []
    for embedding, columns in held:
        out.append({"embedding": host[at:at + len(embedding)], **columns})
        at += len(embedding)
    return out


class LocalEmbedder:
    """`rayvl eval`'s one model in its own process, on a machine with no Ray (``session.runs_without_ray``): the
    batches a local loader's worker processes read and decode (rayvl.eval.local_read) embedded as they arrive. The
    workers start first — forked before this process loads the model, and reading while it loads —, then the model
    (an ``EmbeddingActor`` object, the actors' code) on ``device``. Same calls as ``ActorEmbedder``."""

    def __init__(self, checkpoint: str | os.PathLike, batch_size: int = 128,
                 device: torch.device = torch.device("cpu")):
        self.checkpoint, self.batch_size, self.device = str(checkpoint), batch_size, device
        self.started = time.time()
        self._model: EmbeddingActor | None = None
        self.rows: dict[str, np.ndarray] = {}
        self.dropped: Counter = Counter()

    def model(self) -> EmbeddingActor:
        if self._model is None:
            self._model = EmbeddingActor(self.checkpoint, device=self.device)
        return self._model

    def first_ready(self) -> float:
        return self.model().ready()

    def decoding(self) -> str:
        return self.model().decoding()

    def images(self, batches) -> np.ndarray:
        """As ``ActorEmbedder.images``, of ``batches`` (a local_read.Batches): every row embedded, in order; the
        rows' other columns in ``rows``. The embeddings stay on the model's device and are copied back once every
        ``DEVICE_EMBEDDINGS_BYTES`` (``EmbeddingActor.hold``): on a GPU this process does not wait for the forward
        it queued, and queues the next batch's copy and forward while the GPU runs it."""
        reading = iter(batches)  # the loader's workers start here, before the model loads
        model = self.model()
        model.drop()
        for batch in reading:
            model.hold(*model.on_device(batch))
        held, self.dropped = model.collect()
        embeddings, self.rows = in_order(held)
        return embeddings

    def texts(self, texts: list[str]) -> np.ndarray:
        return self.model().texts(texts, self.batch_size * TEXT_BATCH)

    def close(self) -> None:
        self._model = None
