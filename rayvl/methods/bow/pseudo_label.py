"""Pseudo-BoW captions for images without captions ([BoW] §2.3, Table 7, Fig. 5), on Ray Data and faiss.

1. Caption pool: every intact, valid caption of the aligned set S_a (sorted by sample key), embedded by the
   labelling model's text tower — by the labellers themselves (``Labeler.texts``, the captions split among them),
   which the job starts first so that they load their model while the driver reads S_a — and S_a's word document
   frequencies: the BoW statistics pass (``bow.load_or_compute``) with every caption in the "base" split, saved as
   its fingerprinted artifact.
2. Index: faiss over the pool (``eval.knn``): exact up to ``index_exact_max`` captions, IVF above; an approximate
   index's recall@k against exact search is measured on crops of real unaligned images. Pool, index and recall
   are saved in ``<out>/index/`` with the fingerprint of the checkpoint, the shards and the index settings, and
   reused while it matches.
3. Labelling: one labeller call per unit — an input shard, or ``shard_size`` image files — each unit to the next
   free labeller (``labelled``). A labeller holds the model from its start and loads the index at its
   first unit; per image c random resized crops (seeded by the image key;
   ``rayvl.methods.bow.roi_crops``: decoded at a reduced JPEG scale, downscaled once, cut by Pillow on a CPU actor's
   threads or on its GPU), the top-k captions of each crop; NN_i keeps all k·c retrievals ordered by similarity (a
   caption found by several crops counts once per crop); each rule of ``data.word_rank`` keeps p words. A GPU
   labeller searches an exact index on its GPU (``knn.DeviceIndex``: matmul + top-k, a unit's retrievals read back
   once), faiss every other index and on CPU.
4. Output: per rule one img2dataset-layout shard per unit, ``<out>/<rule>/<unit>.tar|.parquet|_stats.json``,
   caption in ``txt``, rule, words, neighbours' keys and scores in ``json`` (with ``"pseudo_bow": true``, so a
   BoW run trains on the pseudo caption as it is). Written by the labeller's finishers (``Finisher``: actors of
   its own on Ray, one for each six CPUs of a GPU labeller, ``labelled``), stats file last:
   not a Ray Datasink, whose write tasks get blocks without regard to input shards — resuming at shard
   granularity needs a shard to be one unit of work, written whole or not at all. A rerun skips units whose
   every rule's stats file exists; ``<out>/pseudo_label.json`` holds the job's fingerprint, and a rerun with
   another model, data or settings is refused instead of mixing two labellings.
Undecodable images and images whose retrieved words were all filtered out are listed in the parquet with their
status (as img2dataset lists failed downloads), counted, and not in the tar.

On one machine with one labeller and no cluster named (``session.runs_without_ray``), the job starts no Ray: S_a is
read by local torch DataLoaders (``rayvl.eval.local_read``: its word statistics, its captions) and the one
``Labeler`` runs in the command's process (``Labellers``), the same code as an actor's.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch
from ray.util import ActorPool

from rayvl import storage
from rayvl.checkpoints import checkpoint_uri, read_meta
from rayvl.config import ConfigError, RayvlConfig
from rayvl.data import artifacts
from rayvl.methods.bow import roi_crops
from rayvl.data.report import DataPlaneError
from rayvl.data.shards import Reading, ShardStream, read, sum_over_shards
from rayvl.data.shard_io import ReadPolicy, ShardIOError, open_shard
from rayvl.data import specs
from rayvl.data.specs import resolve_shards
from rayvl.data.tar import DAMAGED, IMAGE_EXTENSIONS as TAR_IMAGE_EXTENSIONS, iter_tar_samples, write_img2dataset_shard
from rayvl.data.text import validate_caption, words
from rayvl.methods.bow import deformation as bow
from rayvl.methods.bow.config import PseudoLabelConfig
from rayvl.methods.bow.deformation import rm_stop_nalpha
from rayvl.methods.bow.marks import PSEUDO_FLAG, PSEUDO_MARKER
from rayvl.methods.bow.word_rank import WordRanker, caption_words, count_words
from rayvl.eval import knn, local_read
from rayvl.eval.data import IMAGE_EXTENSIONS
from rayvl.eval.embed import TEXT_BATCH, actor_device, check_gpus, inference, shares, text_embeddings
from rayvl.train.profiling import SYNC_ENV, SyncWatch

log = logging.getLogger("rayvl")
META, INDEX_DIR, FORMAT = PSEUDO_MARKER, "index", 1
WORD_STATS = "aligned_word_stats.json"  # S_a's word statistics, in INDEX_DIR
CAPTIONS_SPLIT_KEPT = 1 << 20  # pool captions a labeller keeps split into words (a bound on its memory)
# the caption pool's keys and captions, in INDEX_DIR: an uncompressed Arrow file, which each finisher maps instead of
# holding a copy of its own (the pages are the node's page cache, shared by every finisher on it)
POOL_FILE = "captions.arrow"
GPUS_OFF = "pseudo_label.gpus_per_actor=0"  # what runs the labelling without GPUs, named where CUDA cannot be used
# roi_crops: decoded reduced, an image's boxes drawn at once, downscaled once, cut by Pillow or grid_sample
CROPS_CUT = "reduced-3"


@dataclass
class Unit:
    """One unit of work: an input shard (kind "tar") or a run of image files ("files") → one output shard."""

    id: int
    kind: str
    paths: list[str]


def units_of(spec: str, shard_size: int) -> list[Unit]:
    local = os.path.expanduser(spec)
    if os.path.isdir(local) and not glob.glob(os.path.join(local, "*.tar")):
        files = sorted(str(p) for p in Path(local).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
        if not files:
            raise ConfigError(f"pseudo_label.unaligned: no .tar shards and no image files in {spec!r}")
        return [Unit(i, "files", files[j:j + shard_size]) for i, j in enumerate(range(0, len(files), shard_size))]
    return [Unit(i, "tar", [p]) for i, p in enumerate(specs.checked("pseudo_label.unaligned", spec).paths)]


def check(cfg: RayvlConfig) -> tuple[str, list[Unit]]:
    """(the checkpoint, the units) — every input named by its key before Ray starts."""
    x = cfg.pseudo_label
    for key in ("checkpoint", "aligned", "unaligned", "out"):
        if not getattr(x, key):
            raise ConfigError(f"pseudo_label.{key}: required")
    try:
        ckpt = checkpoint_uri(x.checkpoint)
    except FileNotFoundError as e:
        raise ConfigError(f"pseudo_label.checkpoint: {e}") from None
    specs.checked("pseudo_label.aligned", x.aligned)
    return ckpt, units_of(x.unaligned, x.shard_size)


def fingerprints(x: PseudoLabelConfig, ckpt: str, units: list[Unit]) -> tuple[dict, dict]:
    """(what the index depends on, what the labelling depends on)."""
    meta = read_meta(ckpt)
    index = {"checkpoint": ckpt, "step": meta["step"], "aligned": artifacts.shard_sizes(resolve_shards(x.aligned)),
             "kind": x.index, "exact_max": x.index_exact_max, "nlist": x.index_nlist, "nprobe": x.index_nprobe,
             "format": FORMAT}
    labelling = {"index": index, "units": [asdict(u) for u in units], "crops": x.crops,
                 "crop_scale_min": x.crop_scale_min, "k": x.k, "words": x.words, "top_t": x.top_t, "seed": x.seed,
                 # how crops are cut (rayvl.methods.bow.roi_crops): a labelling is never finished with other crops
                 "crops_cut": f"{CROPS_CUT}-{'gpu' if x.gpus_per_actor else 'cpu'}"}
    return index, labelling


def claim(out: Path, expected: dict) -> None:
    """Record the job's fingerprint in ``out``; refuse an ``out`` that holds another labelling."""
    path = out / META
    if path.is_file():
        saved = json.loads(path.read_text())["fingerprint"]
        if saved != expected:
            raise ConfigError(f"pseudo_label.out: {out} holds a labelling made with another checkpoint, data or "
                              f"settings ({artifacts.diff(saved, expected)[:300]}); choose another folder or "
                              f"delete it")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fingerprint": expected}, indent=1))


# ----------------------------------------------------------------------------- caption pool and index

def read_pool(spec: str, read_cpus: float, io: ReadPolicy = ReadPolicy(),
              here: int = 0) -> tuple[list[str], list[str]]:
    """(keys, captions) of S_a's valid captions, sorted by key: a Ray Data read of the key and txt members, or
    (``here``) a local loader's of that many workers (no Ray)."""
    paths, reading = resolve_shards(spec), Reading(read_cpus=read_cpus, io=io)
    if here:
        batches = local_read.Batches(local_read.ShardBatches(paths, reading, valid_captions, ("key", "txt")),
                                     here, reading.batch_size * 256, not local_read.on_this_machine(paths))
    else:
        batches = (valid_captions(b) for b in read(ShardStream(paths, reading, columns=("key", "txt"))).iter_batches(
            batch_size=None, batch_format="numpy"))
    pairs = sorted(pair for b in batches for pair in zip(b["key"].tolist(), b["caption"].tolist()))
    if not pairs:
        raise DataPlaneError(f"pseudo_label.aligned: no valid caption in {spec!r}")
    return [k for k, _ in pairs], [c for _, c in pairs]


def valid_captions(batch: dict, counts: Counter | None = None) -> dict:
    """The keys and valid captions of a raw batch of (key, txt) members."""
    found = [(str(key), text) for key, txt in zip(batch["key"], batch["txt"])
             for text, reason in [validate_caption(txt)] if not reason]
    keys, captions = zip(*found) if found else ((), ())
    return {"key": np.array(keys, dtype=object), "caption": np.array(captions, dtype=object)}


def reusable_index(folder: Path, expected: dict) -> dict | None:
    """The metadata of the index in ``folder`` when its fingerprint is ``expected``, else None — also for an index
    made before its pool was a POOL_FILE (a parquet file then), which is made again from the same checkpoint and pool
    (its fingerprint unchanged: a labelling in progress resumes)."""
    meta_path = folder / "index.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    fits = meta is not None and meta["fingerprint"] == expected and (folder / POOL_FILE).is_file()
    return meta if fits else None


def build_index(cfg: RayvlConfig, ckpt: str, folder: Path, expected: dict, units: list[Unit], embed_texts,
                here: int = 0) -> dict:
    """The pool's index in ``folder`` (made, or reused when its fingerprint matches); its metadata. The captions
    are embedded by ``embed_texts`` (the labellers, split among them); ``here``: S_a read without Ray, by a local
    loader of that many workers."""
    import faiss

    x = cfg.pseudo_label
    if (meta := reusable_index(folder, expected)) is not None:
        log.info("caption index reused from %s (%d captions, %s)", folder, meta["captions"], meta["kind"])
        return meta
    (folder / "index.json").unlink(missing_ok=True)  # reusable again only once all of it is written (index.json last)
    started = time.time()
    keys, captions = read_pool(x.aligned, cfg.data.read_cpus, ReadPolicy.of(cfg.data), here)
    log.info("caption pool: embedding %d captions of %s", len(captions), x.aligned)
    vectors = embed_texts(captions)
    index = knn.build_index(vectors, x.index, exact_max=x.index_exact_max, nlist=x.index_nlist,
                            nprobe=x.index_nprobe, seed=x.seed)
    kind = type(index).__name__
    recall = None
    if not isinstance(index, faiss.IndexFlat) and x.recall_sample:
        queries = _sample_queries(cfg, ckpt, units)
        recall = knn.recall(index, vectors, queries, x.k) if len(queries) else None  # no image decodes: no recall
    folder.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(folder / "index.faiss"))
    write_pool(folder, keys, captions)
    meta = {"fingerprint": expected, "captions": len(captions), "kind": kind, "dim": int(vectors.shape[1]),
            f"recall_at_{x.k}": recall, "seconds": round(time.time() - started, 1)}
    storage.write_text(str(folder / "index.json"), json.dumps(meta, indent=1))  # whole, as the pool is
    log.info("caption index: %s over %d captions%s (%.0f s)", kind, len(captions),
             "" if recall is None else f", recall@{x.k} {recall:.3f} vs exact on real crops", meta["seconds"])
    return meta


def write_pool(folder: Path, keys: list[str], captions: list[str]) -> None:
    """The caption pool in ``folder``'s POOL_FILE, one record batch (so one array a column when mapped), 64-bit
    offsets (a pool's captions may pass 2 GiB)."""
    table = pa.table({"key": pa.array(keys, pa.large_string()), "caption": pa.array(captions, pa.large_string())})

    def write(path: Path) -> None:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=max(1, len(table)))

    storage.replaced(folder / POOL_FILE, write)


def mapped_pool(folder: Path) -> tuple[pa.Array, pa.Array]:
    """(keys, captions) of ``folder``'s caption pool, their buffers the file's pages mapped: nothing copied."""
    table = pa.ipc.open_file(pa.memory_map(str(folder / POOL_FILE))).read_all()
    return tuple(c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in (table["key"], table["caption"]))


def _sample_queries(cfg: RayvlConfig, ckpt: str, units: list[Unit]) -> np.ndarray:
    """Crop embeddings of the first ``recall_sample`` decodable unaligned images (the labelling's own queries, cut
    as a CPU labeller cuts them: a GPU's cut differs by resampling only); no rows when none decodes."""
    from rayvl.export import load

    x = cfg.pseudo_label
    model = load(ckpt)

    def decodable():
        for unit in units:
            for key, data, *_ in unit_samples(unit, ReadPolicy.of(cfg.data))[0]:
                q = crops(data, key, x, model.image_size) if data is not None else None
                if q is not None:
                    yield q

    embedded = [model.encode_image(q).numpy() for q in islice(decodable(), x.recall_sample)]
    return np.concatenate(embedded) if embedded else np.zeros((0, 0), np.float32)


# ----------------------------------------------------------------------------- one unit

def unit_samples(unit: Unit, io: ReadPolicy = ReadPolicy()) -> tuple[list[tuple[str, bytes | None, str, str]],
                                                                       str | None]:
    """(key, image bytes, source, image extension) per sample, and what damaged the shard (the samples before the
    damage kept). An I/O failure is not damage: it raises ShardIOError (shard_io.py), and the unit is not
    labelled."""
    if unit.kind == "files":
        return [(f"{unit.id:05d}{i:04d}", Path(p).read_bytes(), p, _member_extension(p))
                for i, p in enumerate(unit.paths)], None
    out: list = []
    try:
        with open_shard(unit.paths[0], io) as f:
            out += [(s["key"], s.get("img"), s["key"], s.get("img_ext"))
                    for s in iter_tar_samples(f, ("key", "img", "img_ext"))]
    except DAMAGED as e:
        return out, f"{unit.paths[0]}: {e}"
    return out, None


def _member_extension(path: str) -> str:
    """An image file's extension as a shard member: its own where webdataset reads it, else jpg (as before: rayvl
    decodes by the bytes; a .bmp member would be skipped by every reader)."""
    ext = Path(path).suffix[1:].lower()
    return ext if ext in TAR_IMAGE_EXTENSIONS else "jpg"


def prepared(samples: list, indices: list[int], x: PseudoLabelConfig, size: int,
             on_cpu: bool) -> tuple[list[int], list[roi_crops.CropSource], np.ndarray | None]:
    """(the decodable samples of ``indices``, their crop sources, and — ``on_cpu`` — their crops cut by Pillow,
    uint8 (Σ c, 3, size, size)): the CPU's share of labelling a chunk, run on a labeller's threads (Pillow's
    decoders and resize release the GIL)."""
    kept, sources = [], []
    for i in indices:
        key, data, *_ = samples[i]
        source = (roi_crops.prepare(data, key, x.crops, size, x.crop_scale_min, x.seed)
                  if data is not None else None)
        if source is not None:
            kept.append(i)
            sources.append(source)
    cut = roi_crops.cut_on_cpu(sources, size) if on_cpu and sources else None
    return kept, sources, cut


def crops(data: bytes, key: str, x: PseudoLabelConfig, size: int) -> np.ndarray | None:
    """The image's c random resized crops as a CPU labeller cuts them, uint8 (c, 3, size, size), drawn from (seed,
    image key); None when the bytes are not a decodable image."""
    _, sources, cut = prepared([(key, data)], [0], x, size, on_cpu=True)
    return cut if sources else None


def ahead_of_use(items: list, work, threads: ThreadPoolExecutor, ahead: int):
    """(item, work(item)) for each item in order, ``work`` running on ``threads`` for up to ``ahead`` items beyond
    the one being used (so at most that many results are held)."""
    pending = deque((item, threads.submit(work, item)) for item in items[:ahead])
    for n in range(len(items)):
        item, result = pending.popleft()
        if n + ahead < len(items):
            pending.append((items[n + ahead], threads.submit(work, items[n + ahead])))
        yield item, result.result()


def by_image(kept: list[int], ids: np.ndarray, scores: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per decodable sample (``kept``, by index): (pool ids, scores) of its row of retrievals, best first, without
    faiss's −1 padding (where it found fewer than k)."""
    return {i: (n[n >= 0], s[n >= 0]) for i, n, s in zip(kept, ids, scores)}


@dataclass
class Retrieved:
    """What a labeller found in one unit, for its finisher to write: the unit's samples (up to a damage) and per
    decodable sample (``kept``, by index in ``samples``), the pool ids and scores of its k·c retrievals, best first
    (id −1 where faiss found fewer than k)."""

    unit: Unit
    samples: list  # (key, image bytes, source, image extension) each
    damaged: str | None
    kept: list[int]
    ids: np.ndarray  # int64 (len(kept), k·c)
    scores: np.ndarray  # float32 (len(kept), k·c)
    started: float  # when its labeller began the unit (time.time(), that labeller's clock)


class Labeler:
    """One warm labelling model, for the whole job ([BoW] §2.3): it embeds the caption pool (``texts``), then finds
    each unit's retrievals (``retrieve``; ``label`` also writes the unit, with a ``Finisher`` in this process) against
    the pool's index, which it loads from ``index_dir`` at its first unit — so the job starts its labellers before the
    index exists and they load their model while the driver reads the aligned set, and a labeller Ray restarts after
    a failure finds the index where its predecessor did. ``df``: S_a's document frequencies for its finisher (None:
    read from ``index_dir``'s word statistics)."""

    def __init__(self, checkpoint: str, index_dir: str, settings: dict, df: dict | None, out: str,
                 io: ReadPolicy = ReadPolicy(), device: torch.device | None = None):
        from rayvl.export import load

        self.x = PseudoLabelConfig(**settings)
        # cuda only on the GPUs Ray gave this actor (pseudo_label.gpus_per_actor), or ``device`` where Ray did not
        # start this process
        self.device = device or actor_device(GPUS_OFF)
        self.model = load(checkpoint, str(self.device))
        # NHWC here and in GPU embedding actors; CPU evaluation embeds as training does, so `rayvl eval` on CPU
        # reproduces its metrics exactly
        self.model.module.vision.to_channels_last()
        self.index_dir, self.df, self.index = Path(index_dir), df, None
        self.out, self.io = Path(out), io
        self.finisher: Finisher | None = None  # label's, made at its first unit
        # decoding and cropping on every CPU this actor holds (Pillow's decode and resize release the GIL), the
        # next chunks prepared while one is embedded: one thread cropped 10 crops an image for the whole actor
        self.cpus = max(1, int(self.x.cpus_per_actor))
        self.cut_on_cpu = self.device.type != "cuda"  # else in one op on the GPU (roi_crops.cut)
        self.threads = ThreadPoolExecutor(self.cpus, thread_name_prefix="crops")
        # RAYVL_SYNC_DEBUG (rayvl check gpu): the host synchronisations of each unit's chunks, from the third unit
        self.syncs, self.units = SyncWatch(os.environ.get(SYNC_ENV, ""), rank=0), 0

    def texts(self, captions: list[str]) -> np.ndarray:
        """The normalised text embeddings of ``captions`` (the caption pool's share of this labeller), embedded as
        the evaluation's actors embed texts."""
        m = self.model
        embedded = text_embeddings(m.module, captions, m.tokenizer_path, m.max_tokens, self.x.batch_size * TEXT_BATCH,
                                   self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what torch cached is the GPU memory a faiss-gpu index needs next
        return embedded

    def _load_index(self) -> None:
        import faiss

        index = faiss.read_index(str(self.index_dir / "index.faiss"))
        # on a GPU an exact index is searched where the crops are embedded (knn.DeviceIndex: nothing read back a
        # chunk, the CPUs only feed the GPU), an approximate one by faiss on the actor's own GPU(s) — the only ones
        # it sees — where faiss has kernels for them; a CPU actor (on a GPU node too) searches with faiss on CPU
        if self.device.type == "cuda":
            self.index = knn.DeviceIndex.of(index, self.device) or knn.on_device(index)
        else:
            self.index = index

    def neighbours(self, samples: list, size: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per decodable sample (by index): (pool ids, scores) of its k·c retrievals, best first (``retrievals``)."""
        return by_image(*self.retrievals(samples, size))

    def retrievals(self, samples: list, size: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """(the decodable samples' indices, their k·c retrievals' pool ids and scores, (n, k·c) each, best first). A
        chunk of images is decoded, downscaled and given its crop boxes on the actor's threads (on a CPU actor its
        crops cut there too), up to two chunks a thread ahead of the one being embedded; on a GPU the chunk's crops
        are cut there in one op (``roi_crops.cut``), embedded and searched there, and the unit's retrievals read back
        once: the GPU is never waited for between chunks."""
        if self.index is None:
            self._load_index()
        x, per = self.x, max(1, self.x.batch_size // self.x.crops)
        chunks = [list(range(j, min(j + per, len(samples)))) for j in range(0, len(samples), per)]
        on_cpu = self.cut_on_cpu
        work = partial(prepared, samples, x=x, size=size, on_cpu=on_cpu)
        kept, found = [], []
        self.units += 1
        self.syncs.before(self.units)
        try:
            for _, (chunk, sources, cut) in ahead_of_use(chunks, work, self.threads, 2 * self.cpus):
                if not chunk:
                    continue
                queries = cut if on_cpu else roi_crops.cut(sources, size, self.device)
                with inference(self.device):
                    embedded = self.model.encode_image(queries)
                kept += chunk
                found.append(self._search(embedded))
        finally:
            self.syncs.after(self.units)  # what follows reads the unit's retrievals back: the one wait meant
        if not found:
            return [], np.zeros((0, x.k * x.crops), np.int64), np.zeros((0, x.k * x.crops), np.float32)
        scores, ids = (torch.cat(part).cpu().numpy() for part in zip(*found))  # a unit's one read-back
        return kept, ids, scores

    def _search(self, embedded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, pool ids) of each image's k·c retrievals (NN_i, [BoW] §2.3), (images, k·c) best first: on the
        index's device, or faiss's results (read back for it) as tensors."""
        if isinstance(self.index, knn.DeviceIndex):
            return knn.merged(*self.index.search(embedded, self.x.k), self.x.crops)
        scores, ids = knn.search(self.index, embedded.cpu().numpy(), self.x.k)
        return knn.merged(torch.from_numpy(scores), torch.from_numpy(ids), self.x.crops)

    def retrieve(self, unit: Unit) -> Retrieved | dict:
        """``unit``'s samples and retrievals, for a ``Finisher`` to write — or, where the unit cannot be read and
        ``data.unreadable`` skips it, its counts (nothing written: a rerun reads it again)."""
        started = time.time()
        try:
            samples, damaged = unit_samples(unit, self.io)
        except ShardIOError as e:  # nothing written, so a rerun reads the unit again (finished() looks for stats)
            if self.io.unreadable == "fail":
                raise
            return {"unit": unit.id, "unreadable_shard": str(e)}
        kept, ids, scores = self.retrievals(samples, self.model.image_size)
        return Retrieved(unit, samples, damaged, kept, ids, scores, started)

    def label(self, unit: Unit) -> dict:
        """Label ``unit``: its retrievals found, then its output shards written (one per rule) by this process's
        ``Finisher``; its counts."""
        if self.finisher is None:
            self.finisher = Finisher(str(self.index_dir), asdict(self.x), self.df, str(self.out))
        return self.finisher.write(self.retrieve(unit))


class Finisher:
    """Writes a labelled unit ([BoW] §2.3): each decodable image's retrieved captions' words counted, ranked by each
    rule of ``data.word_rank``, and one img2dataset shard written per rule, its stats file last. In the labeller's
    process where it labels alone (``Labeler.label``: without Ray); on Ray actors of the labeller's own
    (``Labellers``, ``finishers_per_labeller``), so that the labeller's one interpreter — whose lock its crop
    threads share — only reads, prepares, embeds and searches while its units before are written here. Maps the
    caption pool (``mapped_pool``: a node's finishers share its pages, none holds a copy) and reads S_a's document
    frequencies (``df``, None: ``index_dir``'s word statistics) from ``index_dir`` at its first unit."""

    def __init__(self, index_dir: str, settings: dict, df: dict | None, out: str):
        self.x = PseudoLabelConfig(**settings)
        self.index_dir, self.df, self.out = Path(index_dir), df, Path(out)
        self.keys: pa.Array | None = None

    def load(self) -> None:
        """The caption pool, S_a's document frequencies and the word filters, read before the first unit comes (on
        Ray the job asks for it as labelling starts: the first write then waits for nothing)."""
        if self.keys is not None:
            return
        self.keys, self.captions = mapped_pool(self.index_dir)
        if self.df is None:
            self.df = json.loads((self.index_dir / WORD_STATS).read_text())["df"]
        self.ranker = WordRanker(self.df, self.x.words, self.x.top_t, self.x.seed)
        # a pool caption is retrieved for many crops: split into its words once, not k·c times an image
        self.caption_words = lru_cache(maxsize=CAPTIONS_SPLIT_KEPT)(
            lambda j: caption_words(self.captions[j].as_py()))
        if len(self.captions):
            self.caption_words(0)  # the word filters' first use loads their lists

    def write(self, found: Retrieved | dict) -> dict:
        """Write the unit ``found`` holds (``Labeler.retrieve``'s); its counts (a unit its labeller could not read:
        its counts as they are)."""
        if isinstance(found, dict):
            return found
        self.load()
        unit, samples, damaged = found.unit, found.samples, found.damaged
        counted = {i: (ids, scores, count_words(map(self.caption_words, ids.tolist())))  # once, for all rules
                   for i, (ids, scores) in by_image(found.kept, found.ids, found.scores).items()}
        counts = Counter(images=len(samples), decoded=len(counted))
        for rule in self.x.rules:
            rows = [self._row(rule, samples[i], counted.get(i), counts) for i in range(len(samples))]
            written = sum(r["status"] == "success" for r in rows)
            counts[f"{rule}_written"] = written
            stats = {"count": len(rows), "successes": written, "status_dict": dict(Counter(r["status"] for r in rows)),
                     "damaged_shard": damaged, "duration": time.time() - found.started, "rule": rule}
            (self.out / rule).mkdir(parents=True, exist_ok=True)
            write_img2dataset_shard(self.out / rule, f"{unit.id:05d}", rows, stats)
        return {"unit": unit.id, **counts, "damaged_shard": damaged, "seconds": round(time.time() - found.started, 2)}

    def _row(self, rule: str, sample: tuple, found, counts: Counter) -> dict:
        key, data, source, ext = sample
        row = {"key": key, "caption": "", "status": "success", "error_message": None, "source": source,
               "rule": rule, "words": [], "neighbours": [], "scores": [], PSEUDO_FLAG: True}
        if found is None:
            counts[f"{rule}_failed_to_decode"] += 1
            return {**row, "status": "failed_to_decode", "error_message": "not a decodable image"}
        ids, scores, (word_counts, first) = found
        ws = self.ranker.ranked(rule, word_counts, first, key)
        row.update(words=ws, neighbours=self.keys.take(ids).to_pylist(), scores=[round(float(s), 4) for s in scores])
        if not ws:
            counts[f"{rule}_empty"] += 1
            return {**row, "status": "empty_pseudo_caption", "error_message": "every retrieved word filtered out"}
        return {**row, "caption": " ".join(ws), "jpg": data, "img_ext": ext}  # the image as it came


# ----------------------------------------------------------------------------- the job

def finished(out: Path, unit: Unit, rules: list[str]) -> bool:
    return all((out / rule / f"{unit.id:05d}_stats.json").is_file() for rule in rules)


def sized(cfg: RayvlConfig, node_cpus: list[float] | None = None) -> RayvlConfig:
    """``pseudo_label.actors`` 0 resolved on the connected Ray as `rayvl eval`'s pool is (rayvl.eval.runner.pool_size):
    with gpus_per_actor, as many labellers as the cluster's GPUs hold now (GPUs ÷ gpus_per_actor), fewer where
    their CPUs would leave no node a read task's (``leaves_reads``), at least one; one labeller on CPU."""
    x = cfg.pseudo_label
    if x.actors:
        return cfg
    from rayvl.eval.runner import pool_size

    node_cpus = _node_cpus() if node_cpus is None else node_cpus
    actors = pool_size(0, x.gpus_per_actor, x.cpus_per_actor)
    while actors > 1 and not leaves_reads(node_cpus, actors, x.cpus_per_actor, cfg.data.read_cpus):
        actors -= 1
    log.info("pseudo-label: %d labeller(s) (pseudo_label.actors=0: %s)", actors,
             "as many as the cluster's GPUs hold" if x.gpus_per_actor else "one on CPU")
    return replace(cfg, pseudo_label=replace(x, actors=actors))


def _node_cpus() -> list[float]:
    return [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]]


def leaves_reads(node_cpus: list[float], actors: int, cpus_per_actor: float, read_cpus: float) -> bool:
    """Whether ``actors`` labellers placed as Ray packs them leave some node a read task's CPUs (``data.read_cpus``,
    at least one)."""
    from rayvl.session import place_workers

    free = place_workers(node_cpus, actors, cpus_per_actor, "PACK")
    return free is not None and place_workers(free, 1, max(1.0, read_cpus), "PACK") is not None


def check_cluster(cfg: RayvlConfig, fixed_size: bool, node_cpus: list[float] | None = None) -> None:
    """The labellers, which live from the job's start, must leave a read task's CPUs (``data.read_cpus``, at least
    one) on some node for Ray Data's reads of S_a (its word statistics, its captions) and their repartitions: with
    pseudo_label.actors=2 × cpus_per_actor=1 on 2 CPUs the reads waited forever. An error on a Ray of fixed size, a
    warning on a cluster that may autoscale. Likewise GPUs the cluster cannot have."""
    x = cfg.pseudo_label
    check_gpus(x.gpus_per_actor, f"pseudo_label.gpus_per_actor={x.gpus_per_actor:g}", "pseudo_label.gpus_per_actor=0",
               fixed_size)
    node_cpus = _node_cpus() if node_cpus is None else node_cpus
    if leaves_reads(node_cpus, x.actors, x.cpus_per_actor, cfg.data.read_cpus):
        return
    read = max(1.0, cfg.data.read_cpus)
    problem = (f"pseudo_label.actors={x.actors} × pseudo_label.cpus_per_actor={x.cpus_per_actor:g} CPUs leave no "
               f"{read:g} free CPUs for Ray Data's read and repartition tasks on nodes with "
               f"{', '.join(f'{c:g}' for c in node_cpus)} CPUs: the job would wait forever. Lower pseudo_label.actors "
               f"or pseudo_label.cpus_per_actor, or add nodes.")
    if fixed_size:
        raise ConfigError(problem)
    log.warning("%s (waiting for the autoscaler)", problem)


def run(cfg: RayvlConfig, fixed_size: bool = False, checked: tuple[str, list[Unit]] | None = None,
        without_ray: bool = False) -> dict:
    """Label ``pseudo_label.unaligned`` (Ray must be connected, unless ``without_ray``: one labeller in this process
    and local loaders, ``session.runs_without_ray``; ``fixed_size``: a Ray that cannot grow; ``checked``: what
    ``check(cfg)`` returned, if it ran already); the job's summary, also in <out>/summary.json."""
    ckpt, units = checked or check(cfg)
    if not without_ray:
        cfg = sized(cfg)
        check_cluster(cfg, fixed_size)
    x = cfg.pseudo_label
    out = Path(x.out).expanduser()
    index_fp, labelling_fp = fingerprints(x, ckpt, units)
    claim(out, labelling_fp)
    todo = [u for u in units if not finished(out, u, x.rules)]
    if not todo and (index := reusable_index(out / INDEX_DIR, index_fp)) is not None:
        return summarize(out, x.rules, units, index, len(units), 0.0)
    labellers = Labellers(cfg, ckpt, out, without_ray)
    try:
        here = labellers.loader_workers  # 0: on Ray
        summed = partial(local_read.sum_over_shards, workers=here) if here else sum_over_shards
        stats, reused = bow.load_or_compute(x.aligned, str(out / INDEX_DIR / WORD_STATS), seed=0, fraction=1.0,
                                            reading=Reading.of(cfg, None), summed=summed)
        log.info("S_a word statistics %s: %d captions, %d words", "reused" if reused else "computed",
                 stats.captions, len(stats.df))
        index = build_index(cfg, ckpt, out / INDEX_DIR, index_fp, units, labellers.texts, here)
        log.info("labelling %d of %d shards (%d finished before) with %s", len(todo), len(units),
                 len(units) - len(todo), ", ".join(x.rules))
        started = time.time()
        _label(labellers.label(todo), len(todo), started)
    finally:
        labellers.close()
    return summarize(out, x.rules, units, index, len(units) - len(todo), time.time() - started)


def labeller_cpus(cfg: RayvlConfig) -> int:
    """The CPUs a labeller without Ray uses: ``local_num_cpus`` where set, at most this machine's."""
    return min(cfg.local_num_cpus or local_read.this_machines_cpus(), local_read.this_machines_cpus())


def finisher_cpus(cpus_per_actor: float, gpus_per_actor: float) -> float:
    """The CPUs of a labeller's share (``pseudo_label.cpus_per_actor``) each of its finisher actors holds: one where
    a GPU labeller holds two or more (its crop threads take the rest: it feeds a GPU from one interpreter), else
    none — a CPU labeller's model runs on its CPUs (torch's threads: as many as the CPUs Ray gives it), and its
    finisher's work is a small part of its own."""
    return 1.0 if gpus_per_actor and cpus_per_actor >= 2 else 0.0


# a GPU labeller's CPUs a finisher of its own serves. A finisher writes in one interpreter (the words of an image's
# retrievals counted and ranked, its rows and shard written: Python throughout), which bounds the images a second it
# writes below what one GPU labeller finds (docs/benchmarks.md, "What one labeller's Python costs an image"); the
# labeller's crop threads, which decode, need the other CPUs
CPUS_PER_FINISHER = 6


def finishers_per_labeller(cpus_per_actor: float, gpus_per_actor: float) -> int:
    """How many finisher actors write a labeller's units: on a GPU labeller one for each CPUS_PER_FINISHER of its
    CPUs — a finisher's one interpreter writes a bounded number of images a second, whatever the GPU labels —
    else one."""
    if not finisher_cpus(cpus_per_actor, gpus_per_actor):
        return 1
    return max(1, int(cpus_per_actor // CPUS_PER_FINISHER))


class Labellers:
    """The job's labellers: ``pseudo_label.actors`` Ray actors, started at once — they load their model while the
    driver reads the aligned set twice (its word statistics, its captions), then each embeds its share of the
    caption pool and finds units' retrievals, one in flight, which ``Finisher`` actors of its own write (on a GPU
    labeller one for each CPUS_PER_FINISHER of its CPUs, each holding one of them, ``finishers_per_labeller``; else
    one of no CPU: ``finisher_cpus``) — or (``without_ray``) one ``Labeler`` in this process,
    decoding and cropping on the machine's CPUs (``local_num_cpus`` caps them), loaded where it is first needed:
    after the local loaders (``loader_workers`` processes) have read S_a, so that they are forked from a process
    that holds no model and runs no thread."""

    def __init__(self, cfg: RayvlConfig, ckpt: str, out: Path, without_ray: bool):
        x = cfg.pseudo_label
        self.args = [ckpt, str(out / INDEX_DIR), asdict(x), None, str(out), ReadPolicy.of(cfg.data)]
        self.actors, self.finishers, self.here, self.loader_workers = [], [], None, 0
        if without_ray:
            cpus = labeller_cpus(cfg)
            if cfg.local_num_cpus:  # the model's and faiss's threads too, as an actor's would be
                torch.set_num_threads(cpus)
            self.args[2] = {**asdict(x), "cpus_per_actor": float(cpus)}
            self.device = torch.device("cuda" if x.gpus_per_actor else "cpu")
            self.loader_workers = max(1, cpus - 1)
            return
        writing = finisher_cpus(x.cpus_per_actor, x.gpus_per_actor)
        writers = finishers_per_labeller(x.cpus_per_actor, x.gpus_per_actor)
        crops = x.cpus_per_actor - writing * writers  # the labeller's crop threads
        # a unit is found, or written whole, or not at all: safe to redo
        actor = ray.remote(Labeler).options(num_cpus=crops, num_gpus=x.gpus_per_actor, max_restarts=1,
                                            max_task_retries=1)
        finisher = ray.remote(Finisher).options(num_cpus=writing, max_restarts=1, max_task_retries=1)
        settings = {**asdict(x), "cpus_per_actor": crops}
        self.actors = [actor.remote(ckpt, self.args[1], settings, *self.args[3:]) for _ in range(x.actors)]
        self.finishers = [[finisher.remote(*self.args[1:5]) for _ in range(writers)] for _ in range(x.actors)]
        self.pool = ActorPool(self.actors)

    def labeler(self) -> Labeler:
        """The labeller in this process (without Ray), loaded at its first use."""
        if self.here is None:
            self.here = Labeler(*self.args, device=self.device)
        return self.here

    def texts(self, captions: list[str]) -> np.ndarray:
        if self.loader_workers:
            return self.labeler().texts(captions)
        shared = shares(captions, len(self.actors))
        return np.concatenate(list(self.pool.map(lambda a, share: a.texts.remote(share), shared)))

    def label(self, todo: list[Unit]):
        """Each unit's counts as it is written: by the actors (``labelled``), or one unit after another here."""
        if self.loader_workers:
            return (self.labeler().label(unit) for unit in todo)
        return labelled(todo, self.actors, self.finishers)

    def close(self) -> None:
        for a in self.actors + [f for own in self.finishers for f in own]:
            ray.kill(a)
        if self.here is not None:  # a unit that failed half-way leaves crops being cut: not waited for
            self.here.threads.shutdown(wait=False, cancel_futures=True)
        self.actors, self.finishers, self.here = [], [], None


WRITES_AHEAD = 2  # units a labeller's finisher may hold handed and not yet written


def labelled(todo: list[Unit], labellers: list, finishers: list[list], ahead: int = WRITES_AHEAD):
    """Each unit's counts as its finisher ends it. Labeller i finds one unit's samples and retrievals at a time
    (``Labeler.retrieve``, the next unit as soon as it is free) and its finishers (``finishers[i]``) write them
    (``Finisher.write``), each unit handed to the one with the fewest units unwritten (ties in turn: units are
    shards of uneven size, and a finisher on a large one takes no more meanwhile), reading what the labeller
    returned from Ray's object store: the driver passes the reference on, so a unit's images never pass through it,
    and it owns every result — a write outlives the labeller that found its unit, and Ray redoes a write whose
    finisher died. A labeller whose every finisher holds ``ahead`` units unwritten waits for one, so the object
    store holds at most that many units' images a finisher."""
    units = iter(todo)
    finding: dict = {}  # a retrieve's result → its labeller
    writing: dict = {}  # a write's result → (its labeller, its finisher's place among the labeller's)
    load = [[0] * len(own) for own in finishers]  # each finisher's units handed and not yet written
    waiting, handed = set(), [0] * len(labellers)

    def find(i: int) -> None:
        unit = next(units, None)
        if unit is not None:
            finding[labellers[i].retrieve.remote(unit)] = i

    for finisher in (f for own in finishers for f in own):
        finisher.load.remote()  # an actor's calls run in order: before its first write, while the labellers find
    for i in range(len(labellers)):
        find(i)
    while finding or writing:
        # not fetched here: a unit's images go from its labeller's node to its finisher's
        (done,), _ = ray.wait([*finding, *writing], num_returns=1, fetch_local=False)
        if done in finding:
            i = finding.pop(done)
            n = len(finishers[i])
            j = min(range(n), key=lambda j: (load[i][j], (j - handed[i]) % n))
            writing[finishers[i][j].write.remote(done)] = (i, j)  # resolved in the finisher, never fetched here
            handed[i] += 1
            load[i][j] += 1
            # each unit went to a least loaded finisher, so none holds more than ``ahead``: all do at the total
            if sum(load[i]) < ahead * n:
                find(i)
            else:
                waiting.add(i)
        else:
            i, j = writing.pop(done)
            load[i][j] -= 1
            if i in waiting:
                waiting.discard(i)
                find(i)
            yield ray.get(done)


def _label(results, total: int, started: float) -> None:
    """A progress line per unit done (``results``: each unit's counts as it ends)."""
    done = Counter()
    for c in results:
        done.update({k: v for k, v in c.items() if isinstance(v, int) and k != "unit"})
        done["shards"] += 1
        elapsed = time.time() - started
        eta = elapsed / done["shards"] * (total - done["shards"])
        log.info("pseudo-label: shard %d/%d | %d images (%d undecodable) | %.1f images/s | ETA %.0f s%s",
                 done["shards"], total, done["images"], done["images"] - done["decoded"],
                 done["images"] / max(elapsed, 1e-9), eta,
                 f" | damaged: {c['damaged_shard']}" if c.get("damaged_shard") else
                 f" | not labelled: {c['unreadable_shard']}" if c.get("unreadable_shard") else "")


def summarize(out: Path, rules: list[str], units: list[Unit], index: dict, reused: int, seconds: float) -> dict:
    """Counts over every unit's stats files (those written by earlier runs too) → <out>/summary.json."""
    per_rule = {}
    labelled = [u for u in units if finished(out, u, rules)]  # an unreadable shard skipped has no stats file
    for rule in rules:
        status: Counter = Counter()
        for u in labelled:
            status.update(json.loads((out / rule / f"{u.id:05d}_stats.json").read_text())["status_dict"])
        per_rule[rule] = {"shards": str(out / rule), **dict(sorted(status.items()))}
    summary = {"rules": per_rule, "units": len(units), "units_reused": reused, "seconds": round(seconds, 1),
               "not_labelled": [u.paths[0] for u in units if u not in labelled],
               "index": {k: v for k, v in index.items() if k != "fingerprint"}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"{'rule':<18} {'written':>8} {'undecodable':>12} {'empty':>7}  shards"]
    for rule, s in summary["rules"].items():
        lines.append(f"{rule:<18} {s.get('success', 0):>8} {s.get('failed_to_decode', 0):>12} "
                     f"{s.get('empty_pseudo_caption', 0):>7}  {s['shards']}")
    index = summary["index"]
    recall = next((v for k, v in index.items() if k.startswith("recall_at_")), None)
    lines.append(f"caption index: {index['kind']} over {index['captions']} captions"
                 + ("" if recall is None else f", recall vs exact {recall:.3f}")
                 + f"; {summary['units']} shards, {summary['units_reused']} finished before this run")
    if summary.get("not_labelled"):
        lines.append(f"not labelled (unreadable, skipped under data.unreadable_shards=skip; a rerun tries them "
                     f"again): {', '.join(summary['not_labelled'])}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- precision, where the truth is known

def true_captions(spec: str) -> dict[str, str]:
    """{key: caption} from the img2dataset parquets of unaligned shards that still carry their captions (the demo's
    held-back half); {} for image folders or shards without them."""
    try:
        shards = resolve_shards(spec)
    except DataPlaneError:
        return {}
    out: dict[str, str] = {}
    for shard in shards:
        parquet = Path(shard[:-4] + ".parquet")
        if parquet.is_file():
            t = pq.read_table(parquet, columns=["key", "caption"])
            out.update(zip(t["key"].to_pylist(), t["caption"].to_pylist()))
    return out


def word_precision(rule_dir: Path, truth: dict[str, str]) -> dict:
    """{"pseudo_word_precision": % of pseudo-caption words that are words of the image's true caption (after
    RmStopNalpha)}, over the written samples whose true caption is known; {} when none is."""
    hits = total = 0
    for parquet in sorted(Path(rule_dir).glob("*.parquet")):
        for row in pq.read_table(parquet, columns=["source", "status", "words"]).to_pylist():
            true = truth.get(row["source"])
            if row["status"] != "success" or true is None:
                continue
            true_words = set(rm_stop_nalpha(words(true)))
            hits += sum(w in true_words for w in row["words"])
            total += len(row["words"])
    return {"pseudo_word_precision": 100.0 * hits / total} if total else {}
