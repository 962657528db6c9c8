"""[BoW]'s sections of the config tree: ``bow`` (Bag-of-Words captions, §2.2), ``memory_bank`` (the EMA memory
bank, §2.1) and ``pseudo_label`` (pseudo-BoW captions, §2.3). Registered with the method (rayvl/methods/__init__.py):
``rayvl.config.RayvlConfig`` has them under these keys, checked and documented as every section is."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rayvl.local_paths import FilePath, NamedOrPath, SpecPath


@dataclass
class BowConfig:
    """Bag-of-Words caption deformation of the training captions ([BoW] §2.2)."""

    enabled: bool = False
    """deform the training captions (held-out captions always stay intact)."""
    ops: list[Any] = field(default_factory=lambda: [dict(o) if isinstance(o, dict) else o for o in DEFAULT_BOW_OPS])
    """the cascade, in order; Keep(n) must be last. Names: shuffle, rm_stop_nalpha, limit_to_base_vocab,
    {rm_top_freq: t}, {keep: n}. Default: the paper's default BoW."""
    base_fraction: float = 0.1
    """share of captions kept intact (the "base" split, chosen by hashing the sample key); 0 = only BoW."""
    seed: int = 0
    """seed of the base split and of each caption's shuffle (hash of seed and sample key)."""
    stats_path: FilePath = ""
    """base-split statistics artifact (JSON, local or URL); reused when its fingerprint matches the shards and
    split, computed with Ray Data otherwise ('' = <run directory>/bow_stats.json)."""
    keep_base_intact: bool = True
    """False: the base split still gives the statistics, but its captions are deformed too ([BoW] Table 4, 100%
    BoW captions)."""
    top_freq_words: Literal["content", "all"] = "content"
    """what RmTopFreq(t) ranks: "content" = the t most frequent base words among those RmStopNalpha keeps (the
    words [BoW] Figure 2 shows it removing: "men", "table", "rocks"); "all" = the whole base vocabulary, stop words
    and punctuation included (the literal reading; after RmStopNalpha its top-t removes fewer real words)."""


DEFAULT_BOW_OPS = ("shuffle", "rm_stop_nalpha", "limit_to_base_vocab", {"rm_top_freq": 1000}, {"keep": 4})


@dataclass
class MemoryBankConfig:
    """EMA memory bank of negatives ([BoW] §2.1 eq. (1)–(3), MoCo)."""

    size: int = 0
    """K image keys and K text keys in the queue (paper: 8192); 0 = plain in-batch InfoNCE."""
    momentum: float = 0.999
    """EMA momentum m of the key encoders: θ' ← m·θ' + (1 − m)·θ."""
    temperature: float = 0.02
    """τ of eq. (1)–(2) (paper: 0.02, fixed)."""
    learn_temperature: bool = False
    """use the model's learnable logit scale instead of the fixed 1/τ."""


@dataclass
class PseudoLabelConfig:
    """Pseudo-BoW captions for images without captions ([BoW] §2.3): `rayvl pseudo-label`, jobs/pseudo_label.py."""

    checkpoint: NamedOrPath = ""
    """the labelling model: a run directory, a checkpoint or an export (normally a BoW run)."""
    aligned: SpecPath = ""
    """S_a, the aligned shards whose intact captions are retrieved (normally the labelling model's training data)."""
    unaligned: SpecPath = ""
    """the images to label: img2dataset shards (their captions ignored) or a folder of image files (searched
    recursively)."""
    out: FilePath = ""
    """output folder: one img2dataset-layout shard set per rule, <out>/<rule>/, and the index cache <out>/index/."""
    rules: list[str] = field(default_factory=lambda: ["weighted_count"])
    """word ranking rules (max_count, rm_top_max_count, rm_top_rand, weighted_count; Table 7's best is the last);
    several rules share one retrieval and each writes its own shard set."""
    crops: int = 10
    """c: random resized crops per image, each one query (the paper does not give c)."""
    crop_scale_min: float = 0.5
    """smallest crop area as a fraction of the image (Inception-style crops, aspect ratio 3/4–4/3)."""
    k: int = 5
    """top-k captions retrieved per crop: NN_i holds k·c captions."""
    words: int = 4
    """p: words kept in a pseudo caption (the default BoW keeps 4, Keep(4))."""
    top_t: int = 1000
    """t of rm_top_max_count / rm_top_rand: S_a's most frequent content words removed (1000 in the paper)."""
    index: Literal["auto", "flat", "ivf", "hnsw"] = "auto"
    """faiss index over the caption pool: exact (flat) up to index_exact_max captions under auto, IVF above."""
    index_exact_max: int = 100_000
    """largest pool searched exactly under index: auto."""
    index_nlist: int = 0
    """IVF cells (0 = 4·√pool size)."""
    index_nprobe: int = 16
    """IVF cells searched per query."""
    recall_sample: int = 256
    """unaligned images whose crops measure an approximate index's recall@k against exact search."""
    shard_size: int = 1000
    """images per output shard when the unaligned set is a folder of images (a shard input keeps its shards)."""
    actors: int = 0
    """labelling actors (each loads the model and the index once); 0 = one on CPU, or with gpus_per_actor as many
    as the cluster's GPUs hold when the job starts (GPUs ÷ gpus_per_actor, as eval.actors; fewer where their CPUs
    would leave Ray Data's reads none). One, on a machine with no cluster named (no GPU asked, or the machine's only
    GPU): the labeller runs in the command's process, with no Ray."""
    cpus_per_actor: float = 1.0
    """CPUs each labelling / caption-embedding actor reserves, with the actors that write its units: on a GPU
    labeller from 2 up, one in six of them (at least one) is a writer's, each writer an actor of one CPU, and the rest
    crop (a labeller without Ray decodes and crops on the machine's CPUs, local_num_cpus if set, and writes in its
    process)."""
    gpus_per_actor: float = 0.0
    """GPUs each labelling actor reserves (the model, its exact caption index and a faiss-gpu index then use
    CUDA)."""
    batch_size: int = 256
    """crops (or captions) per forward pass."""
    seed: int = 0
    """seed of the crops and of rm_top_rand's order (both also keyed by the image key)."""
