"""One typed config tree for every rayvl job.

Defaults live in the dataclasses; recipes (configs/*.yaml) override a few fields; the command line overrides any
field with ``--set section.field=value``. Every error — unknown key, wrong type, impossible combination — is raised
as ``ConfigError`` naming the full dotted key, before Ray starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rayvl import local_paths, plugins
from rayvl.local_paths import FilePath, NamedOrPath, SpecPath, absolute_paths
from rayvl.errors import ConfigError  # raised here; callers import it from here too

REPORT_TO = ("tensorboard", "mlflow", "wandb")


@dataclass
class DataConfig:
    train: SpecPath = ""
    """img2dataset shards for training, written as webdataset / open_clip write them: brace ranges
    (``s3://b/laion/{00000..41407}.tar``), ``::`` between sources, comma lists, folders, globs, ``.txt`` list files,
    URLs (s3://, gs://, file://, any fsspec scheme) and ``pipe:COMMAND`` ('' = embedded demo dataset)."""
    eval: SpecPath = ""
    """held-out img2dataset shards for evaluation, the same forms as ``train`` ('' = the demo's held-out split;
    with ``train`` set, evaluation needs it)."""
    classes: FilePath = ""
    """zero-shot class list + prompt templates (JSON: {"classes": [...], "templates": [...]}, or CLIP_benchmark's
    classnames.txt with the zeroshot_classification_templates.txt beside it; '' = the demo's)."""
    paraphrases: FilePath = ""
    """paraphrase pairs over the eval images (JSON lines: caption, paraphrase; '' = the demo's)."""
    sts: FilePath = ""
    """STS sentence pairs (TSV: sentence1, sentence2, score; '' = the demo's)."""
    samples_per_pass: int = 0
    """samples one pass over ``train`` holds (open_clip's ``--train-num-samples``), for shards without img2dataset's
    parquet or ``_stats.json`` files (0 = count them from those files); with ``upsampling_factors``, the upsampled
    pass."""
    upsampling_factors: str = ""
    """how often a pass reads each ``::`` source of ``train``, one factor per source (``"1::4"``: the second
    source's shards 4 times a pass; ``0.5``: half of them, the other half the next pass) — open_clip's
    ``--train-data-upsampling-factors``, without its sampling with replacement, so a run still resumes row for row
    ('' = every shard once a pass)."""
    demo_dir: FilePath = "~/.cache/rayvl/demo"
    """where the embedded demo dataset is written when ``train`` is empty."""
    demo_samples: int = 4000
    """training samples of the generated demo dataset."""
    demo_eval_samples: int = 500
    """held-out samples of the generated demo dataset."""
    image_size: int = 64
    """side of the square crop fed to the image tower."""
    crop_scale_min: float = 0.6
    """lower bound of the random-resized-crop area fraction (upper bound is 1.0)."""
    decode: Literal["cpu", "device"] = "cpu"
    """where training images are decoded: "cpu" in the read tasks; "device" on each worker's GPU (nvJPEG): the read
    tasks keep a JPEG encoded with its crop box, for nodes whose CPUs cannot decode what their GPUs train on (the
    same crop boxes either way; other formats are decoded in the read tasks)."""
    max_text_tokens: int = 24
    """captions are padded/truncated to this many tokens (with model.init_from_clip: the CLIP's context, 77)."""
    read_cpus: float = 0.5
    """CPUs reserved per Ray Data read/transform task; keep < 1 on small machines so Ray Train cannot starve them."""
    read_threads: int = 2
    """batches each read task decodes, crops and tokenizes side by side in threads (PIL and the tokenizer release
    the GIL): one task keeps more than one core busy and fills the gaps Ray leaves around its tasks."""
    transform_batch_size: int = 256
    """rows a read task decodes, crops and tokenizes in one call, and the rows of each Ray Data block it emits.
    Ray Data's costs are per block (scheduling loop, object store, the consumer's fetch): larger blocks read faster
    in steady state and deliver the first batch later, which training hides behind the engine build (measured:
    docs/benchmarks.md, "Data plane"; benchmarks/data_pipeline.py)."""
    shuffle_files: bool = True
    """shuffle shard order every epoch."""
    local_shuffle_buffer: int = 256
    """rows in each worker's local shuffle buffer (0 = off); its draws are seeded by (train.seed, rank, execution)."""
    deterministic: bool = False
    """Ray Data keeps the order of its blocks (``preserve_order``): each rank receives the same rows in the same order
    run after run, so one train.seed gives one loss curve on CPU. Costs speed: a slow read task holds back every
    block after it, and the split to ranks ignores where blocks are (more transfer between nodes). Off: the order
    in which tasks finish decides which rank trains on which block, and when."""
    prefetch_batches: int = 2
    """batches prefetched by each worker's iterator."""
    stall_timeout_s: float = 300.0
    """raise if a worker waits this long for one batch (a starved Ray Data pipeline otherwise hangs silently)."""
    io_retries: int = 5
    """retries of a shard read after a transient I/O error (timeout, reset connection, throttling, a failed
    ``pipe:`` command), each resuming at the byte reached; pyarrow's S3 client already retries each request."""
    io_retry_wait_s: float = 2.0
    """wait before the first retry, doubled at each next one (at most 60 s, jittered)."""
    unreadable_shards: Literal["fail", "skip"] = "fail"
    """a shard that cannot be read (missing, access denied, errors past ``io_retries``): fail the run naming the
    shard and the cause, or skip the rest of it, counted as ``unreadable_shards`` and named in the data report."""
    read_buffer_mib: int = 16
    """bytes asked of storage per request when reading a shard (one ranged GET on object storage)."""


@dataclass
class ClipArchitecture:
    """A whole CLIP's shapes (``model.init_from_clip`` reads them from its weights before Ray starts; 0 = no CLIP).
    Set by hand only where the weights cannot say: ``vision_heads`` / ``text_heads`` (CLIP's heads are 64 wide) and
    ``quick_gelu`` for an open_clip model trained with it (OpenAI's releases and Hugging Face folders say so
    themselves)."""

    vision_width: int = 0
    """the image transformer's width (its patch embedding's channels)."""
    vision_layers: int = 0
    """the image transformer's residual blocks."""
    vision_heads: int = 0
    """the image transformer's attention heads (its source's, else width ÷ 64 up to ViT-L and 16 above)."""
    vision_mlp: int = 0
    """the hidden width of the image transformer's MLPs (4 × width up to ViT-H; ViT-g's and bigG's are other)."""
    patch_size: int = 0
    """the image transformer's patch side in pixels."""
    image_size: int = 0
    """the size the image transformer is built for: data.image_size (the checkpoint's own unless set; another size
    resamples its position embeddings)."""
    text_width: int = 0
    """the text transformer's width."""
    text_layers: int = 0
    """the text transformer's residual blocks."""
    text_heads: int = 0
    """the text transformer's attention heads (its source's, else width ÷ 64)."""
    text_mlp: int = 0
    """the hidden width of the text transformer's MLPs."""
    context_length: int = 0
    """the text transformer's positions (CLIP: 77); data.max_text_tokens may be fewer."""
    vocab_size: int = 0
    """the token embedding's rows (CLIP's BPE: 49,408)."""
    embed_dim: int = 0
    """the shared embedding's size (both projections' output)."""
    quick_gelu: bool = False
    """CLIP's x·sigmoid(1.702x) activation (OpenAI's models) instead of GELU."""


@dataclass
class ModelConfig:
    vision: str = "efficientnet-lite0"
    """image tower: a rayvl asset name or any timm model name (``clip``: the image transformer of
    ``init_from_clip``)."""
    vision_checkpoint: FilePath = ""
    """checkpoint file for a timm model name, a local path or on object storage (s3://, gs://: each node copies it
    once) ('' = random init unless ``vision`` is an asset)."""
    text: NamedOrPath = "minilm-l6"
    """text tower: a rayvl asset name or a local HF model directory (``clip``: the text transformer of
    ``init_from_clip``, with CLIP's tokenizer)."""
    init_from_clip: FilePath = ""
    """a whole pretrained CLIP to start from: OpenAI's .pt (TorchScript or state dict), an open_clip checkpoint
    (.pt/.bin/.safetensors, plain or as its training saves it) or a Hugging Face CLIPModel folder. Both towers, both
    projections and the temperature load; model.vision/text/embed_dim/projections/pooling/clip and data.image_size
    are read from it (a --set that contradicts it is an error; data.image_size may differ)."""
    clip: ClipArchitecture = field(default_factory=ClipArchitecture)
    """the CLIP's shapes (read from init_from_clip)."""
    text_strategy: Literal["finetune", "frozen", "frozen_adapters", "frozen_alignment"] = "frozen_alignment"
    """[Paraphrase] §4: finetune the LM, freeze it, freeze it with bottleneck adapters in every layer, or freeze it and
    append alignment layers."""
    text_unlocked_layers: int = 0
    """with text_strategy=frozen: the LM's last N transformer layers train (a CLIP's final LayerNorm with them), its
    embeddings and other layers stay locked — open_clip's --lock-text-unlocked-layers (a whole CLIP: its projection
    counts as the last, as open_clip counts it, and is locked at 0)."""
    alignment_layers: int = 2
    """m, the number of appended alignment layers ([Paraphrase] uses 6 at LAION scale; 0 = the frozen LM alone)."""
    text_tower: Literal["lm", "class_embedding"] = "lm"
    """lm: the pretrained text encoder; class_embedding: one learned vector per class of image_label (the CE
    baseline of [UniCL] eq. (4): no text encoder, so no zero-shot to unseen classes)."""
    num_classes: int = 0
    """rows of the class-embedding matrix (set from image_label's class list by the trainer)."""
    adapter_reduction: int = 2
    """bottleneck adapters' reduction factor: hidden size d → d / r → d ([Paraphrase] §4: 2)."""
    pooling: Literal["avg", "cls", "eot"] = "avg"
    """how token features become one text feature (eot: the end-of-text token's, CLIP's own — a whole CLIP's)."""
    embed_dim: int = 256
    """dimension of the shared embedding space."""
    vision_projection: Literal["linear", "mlp2"] = "linear"
    """[Paraphrase] §5: a linear projection for vision."""
    text_projection: Literal["linear", "mlp2"] = "mlp2"
    """[Paraphrase] §5: a 2-layer MLP projection for text."""
    init_logit_scale: float = 14.285714
    """exp(s) at init, 1/τ (CLIP: 1/0.07)."""
    learn_logit_scale: bool = True
    """learn the temperature (CLIP) or keep it fixed at ``init_logit_scale``."""
    max_logit_scale: float = 100.0
    """clamp on exp(s), as in CLIP; a gradient that lowers s still reaches it at the clamp (open_clip's)."""
    vision_strategy: Literal["finetune", "frozen"] = "finetune"
    """finetune: every image-tower weight trains; frozen: the backbone is locked (LiT, Zhai et al. 2022,
    arXiv:2111.07991 — give it pretrained weights), run without a graph, its projection still training (a whole
    CLIP's own projection is locked with it, as open_clip's --lock-image locks it)."""
    vision_unlocked_groups: int = 0
    """with vision_strategy=frozen: the image tower's last N layer groups (timm's grouping: the stem, each block
    or stage; a ViT's final norm with its last block; a whole CLIP's projection last) train, the rest stay locked —
    open_clip's --lock-image-unlocked-groups, counted as it counts them. A tower with groups of its own unlocked
    runs with a graph and in training mode, as open_clip's does."""
    vision_freeze_bn_stats: bool = False
    """with vision_unlocked_groups: the locked groups' BatchNorm statistics stay as pretrained (timm's
    FrozenBatchNorm2d) — open_clip's --lock-image-freeze-bn-stats."""
    patch_dropout: float = 0.0
    """share of a ViT image tower's patch tokens dropped at random in each training forward (FLIP, Li et al. 2023,
    arXiv:2212.00794: 0.5–0.75), through timm's patch_drop_rate; evaluation sees all of them. ViTs only."""
    init_logit_bias: float | None = None
    """a learnable bias b added to every logit, at this initial value: loss.kind=siglip's (−10 unless set); None:
    no bias (a softmax loss has no use for one)."""
    activation_checkpointing: bool = False
    """recompute layer activations in the backward pass instead of keeping them — the text tower's trained layers
    and a transformer image tower (ViT; a BatchNorm tower is not recomputed, its statistics would move twice): less
    GPU memory for a larger batch, about one more forward pass of compute."""


@dataclass
class LossConfig:
    gather_with_grad: bool = True
    """gather features from all workers with gradients flowing back to their owners (open_clip semantics)."""
    kind: str = "clip"
    """the core's clip or siglip, or a kind a method registers (``Method.loss_kinds``). clip: InfoNCE with one
    positive per query; unicl: label-aware targets, every key with the query's label is a positive ([UniCL] eq.
    (1)–(3)); identical when all labels are unique (image-text data only); ce: cross-entropy against a learned
    class-embedding matrix ([UniCL] eq. (4); needs model.text_tower=class_embedding);
    siglip: SigLIP's sigmoid loss (Zhai et al. 2023, arXiv:2303.15343), a binary term per image-text pair with a
    learnable bias — model.init_logit_scale and model.init_logit_bias default to the paper's 10 and −10."""


@dataclass
class TrainConfig:
    num_workers: int = 2
    """Ray Train workers (data-parallel ranks)."""
    use_gpu: bool = False
    """one GPU per worker, NCCL backend; CPU workers use gloo."""
    wait_for_gpus: bool = False
    """with ``use_gpu`` on a cluster that has no GPU now and no autoscaler config rayvl can read (KubeRay's
    autoscaler runs beside the head, not on it): wait for GPU nodes instead of refusing the run."""
    cpus_per_worker: float = 0.5
    """CPUs reserved per worker; leave CPUs for Ray Data (DESIGN: starvation hangs silently)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """how the workers' placement group spreads them over nodes (Ray's ScalingConfig.placement_strategy);
    STRICT_SPREAD = one worker per node."""
    micro_batch_size: int = 32
    """samples per worker per step."""
    grad_accumulation: int = 1
    """micro-batches per optimizer step."""
    zero_stage: Literal["auto", 0, 1, 2, 3] = "auto"
    """DeepSpeed ZeRO stage 0-3; auto = the fastest layout whose weights, gradients and optimizer state fit the
    GPUs beside the activations: stage 0 where it fits, then ZeRO-1, 2, 3, then offload (rayvl.train.layout; stage 0
    on CPU workers). A resume takes its checkpoint's stage."""
    zero_overlap_comm: bool = True
    """ZeRO-2/3 on two or more GPUs: reduce gradients while the backward pass goes on (DeepSpeed's overlap_comm;
    ZeRO-1 reduces after the backward, without DeepSpeed's per-gradient hooks)."""
    zero_contiguous_gradients: bool = False
    """ZeRO-1/2: copy each gradient into one contiguous buffer as the backward makes it (DeepSpeed's
    contiguous_gradients: less memory fragmentation for a model near the GPU's memory, a host-side copy per gradient
    every step; ZeRO-1 then hooks every gradient too). ZeRO-3 always does."""
    zero_bucket_size: int = 50_000_000
    """elements per ZeRO gradient-reduction / all-gather bucket (and ZeRO-3's prefetch bucket): larger buckets mean
    fewer, larger collectives and more memory."""
    zero_offload: Literal["none", "optimizer", "optimizer_and_params"] = "none"
    """ZeRO-Offload: keep the optimizer state (ZeRO ≥ 1), and with ZeRO-3 the parameters too, in pinned host
    memory — for a model whose state does not fit the GPUs, at the cost of host-device traffic every step."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto = bf16 on GPUs, fp32 on CPUs; bf16 also runs on CPUs (DeepSpeed's CPU accelerator); fp16 only on GPUs.
    fp32 master weights in every case: bf16 at ZeRO-0 is torch autocast over fp32 weights, at ZeRO ≥ 1 DeepSpeed's
    bf16 weights with fp32 copies in the optimizer; BatchNorm statistics stay fp32."""
    tf32: bool = True
    """on Ampere and later GPUs, fp32 matrix products and convolutions use TF32 tensor cores."""
    compile: str = ""
    """a torch.compile backend for the model ("inductor" on GPUs; '' = eager)."""
    lr: float = 1e-3
    """peak learning rate ([Paraphrase] Table B.1)."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases, norms and the logit scale)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW β1, β2 ([Paraphrase]: 0.98 for ViT)."""
    eps: float = 1e-6
    """AdamW ε."""
    warmup_steps: int = 20
    """linear warm-up steps before the schedule."""
    max_steps: int = 200
    """optimizer steps in total (replaced by max_passes when that is set)."""
    max_passes: float = 0.0
    """the budget in passes over the training data (open_clip's --epochs) instead of steps: max_steps becomes
    ceil(max_passes × samples a pass ÷ the global batch), the samples a pass as the run's plan counts them (img2dataset's
    stats, or data.samples_per_pass); 0 = max_steps as set."""
    lr_schedule: Literal["cosine", "constant", "constant_cooldown"] = "cosine"
    """after the warm-up: cosine decay to 0 at max_steps; constant; or constant, then the last cooldown_steps decay
    to cooldown_end_lr — open_clip's --lr-scheduler cosine, const, const-cooldown (the same formulas)."""
    cooldown_steps: int = 0
    """constant_cooldown's decay steps at the end (open_clip's --epochs-cooldown, in steps)."""
    cooldown_power: float = 1.0
    """constant_cooldown's decay (1 − t)^power over the cooldown: 1 = linear (open_clip's --lr-cooldown-power)."""
    cooldown_end_lr: float = 0.0
    """the learning rate constant_cooldown ends at (open_clip's --lr-cooldown-end)."""
    stop_at_step: int = 0
    """end this invocation after this step, with an evaluation and a checkpoint holding the weights, and leave the
    run to be continued with ``train.resume`` (a time-limited allocation, a planned preemption); 0 = run to
    ``max_steps``."""
    grad_clip: float = 1.0
    """global gradient-norm clip (0 = off)."""
    log_every: int = 10
    """report metrics every N steps."""
    sync_every_s: float = 300.0
    """seconds between copies of what the run records — metrics.jsonl, the TensorBoard events, the dashboard
    (redrawn then), MLflow's store — into its run directory on object storage: at a report, once at least this long
    has passed since the last copy (0 = at every report). On a local storage path they are written there directly;
    the dashboard is redrawn as often."""
    checkpoint_every: int = 100
    """checkpoint every N steps (the last step is always checkpointed)."""
    checkpoints_to_keep: int = 2
    """checkpoints kept in the run directory."""
    max_failures: int = 1
    """worker-group restarts Ray Train may do from the latest checkpoint."""
    storage_path: FilePath = "~/rayvl-runs"
    """where runs are stored: a local path, or a URL (s3://, gs://, file://, any fsspec scheme)."""
    shared_storage: bool = False
    """a local ``storage_path`` is a mount every node shares (NFS, Lustre); otherwise a cluster of several nodes
    needs an fsspec URL (s3://, gs://) there, since every worker writes its checkpoint shards to it."""
    run_name: str = ""
    """run directory name ('' = <recipe>-<timestamp>)."""
    resume: bool = False
    """continue from the latest checkpoint of ``run_name`` (``--resume [RUN|latest]`` sets both)."""
    init_from: NamedOrPath = ""
    """start a new run from the weights of another run: a run directory (its newest checkpoint), a checkpoint or a
    ``rayvl export`` directory; its model settings must match this run's ('' = pretrained towers)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """experiment loggers beside metrics.jsonl: ``tensorboard`` (event files in the run directory), ``mlflow``
    (``train.mlflow_uri``), ``wandb`` (Weights & Biases, set up by the driver's ``WANDB_*`` environment: API key,
    ``WANDB_MODE=offline``, project — default the recipe —, entity; its files under ``wandb/`` in the run
    directory)."""
    mlflow_uri: str = ""
    """MLflow tracking URI ('' = ``MLFLOW_TRACKING_URI`` if set, else a SQLite store beside the runs:
    ``mlruns/mlflow.db`` under a local ``storage_path``, in the run directory on object storage); experiment = the
    recipe name, run = the run name."""
    seed: int = 0
    """seed of the model's new layers, each row's crop and prompt (with its key and pass), each pass's shard order,
    the local shuffle buffers (with the rank) and the TOnICS node draws; with ``data.deterministic`` two runs of one
    seed train on the same batches."""

    @property
    def end_step(self) -> int:
        """the step this invocation ends at: ``stop_at_step``, else ``max_steps``."""
        return self.stop_at_step or self.max_steps


EVAL_GPU_BATCH, EVAL_CPU_BATCH = 1024, 128  # eval.batch_size=0: images a forward on a GPU (enough to fill it), on CPU


@dataclass
class EvalConfig:
    every_steps: int = 0
    """run the evaluation tasks every N steps during training (0 = only at the end)."""
    tasks: list[str] = field(default_factory=lambda: ["zeroshot", "retrieval", "paraphrase", "sts"])
    """evaluation tasks run in training (the linear probe runs in `rayvl eval`)."""
    paraphrase_k: int = 10
    """k of AO@k / JS@k ([Paraphrase] §3 uses 10)."""
    batch_size: int = 0
    """images per forward pass during evaluation (and per `rayvl eval` actor call; texts: 4× as many). 0 = by the
    device: 1,024 on a GPU (in training, the rank's micro_batch_size within 128–1,024), 128 on CPU."""
    checkpoint_tasks: list[str] = field(
        default_factory=lambda: ["zeroshot", "retrieval", "paraphrase", "sts", "linear_probe"])
    """tasks `rayvl eval` runs on a checkpoint unless --tasks names others (the linear probe too)."""
    actors: int = 0
    """`rayvl eval`'s embedding actors (a Ray Data actor pool): 0 = one on CPU, or with gpus_per_actor as many as
    the cluster's GPUs hold when it starts. One model on a machine of its own (no cluster named, one actor on CPU,
    or the machine's only GPU) embeds in the command's process, with no Ray (loader_workers)."""
    cpus_per_actor: float = 0.5
    """CPUs each `rayvl eval` embedding actor reserves."""
    gpus_per_actor: float = 0.0
    """GPUs each `rayvl eval` embedding actor reserves, at most 1 (0: embed on CPU in fp32; 1: an actor per GPU, in
    bf16 autocast; 0.5: two actors share a GPU)."""
    loader_workers: int = 0
    """processes that read and decode the images when `rayvl eval` runs on one machine without Ray (a torch
    DataLoader's workers; 0 = this machine's CPUs less the one the model runs on)."""
    decode: Literal["auto", "cpu", "device"] = "cpu"
    """where `rayvl eval` decodes held-out shards' JPEGs: "cpu" in the read tasks; "device" by the embedding model's
    GPU (nvJPEG); "auto": the device where the model has a GPU. "cpu" until a GPU check has held the device's
    metrics to the CPU's (docs/gpu.md)."""

    def decode_on(self, gpu: bool) -> str:
        """Where the images of an evaluation whose model is on a GPU (``gpu``) or not are decoded."""
        return ("device" if gpu else "cpu") if self.decode == "auto" else self.decode


@dataclass
class SweepConfig:
    """How `rayvl tune` runs trials (the search space itself is a tune_spaces/*.yaml file)."""

    storage_path: FilePath = "~/rayvl-sweeps"
    """where sweeps are stored: <storage_path>/<sweep name>/ (Tune's state, each trial's Train run, the report)."""
    driver_cpus: float | None = None
    """CPUs reserved for each trial's driver, the function that builds and fits the TorchTrainer (it mostly waits;
    its Train workers reserve their own). Unset: 0.1, or none when tune.driver_resources says where drivers go (a
    node with both is not needed: cluster.yaml's head has `on_demand` and no CPUs)."""
    driver_resources: dict[str, float] = field(default_factory=dict)
    """custom resources each trial driver needs, e.g. {on_demand: 1} to keep drivers on nodes that declare
    that resource (Ray's advice for spot clusters: a lost driver loses its trial)."""

    def driver_bundle(self) -> dict[str, float]:
        """What each trial's driver reserves (Tune's resources for the trial)."""
        cpus = self.driver_cpus if self.driver_cpus is not None else 0.0 if self.driver_resources else 0.1
        return {**({"CPU": cpus} if cpus else {}), **self.driver_resources}


@dataclass
class CoreConfig:
    """The core's sections; ``RayvlConfig`` adds each registered method's (rayvl.plugins)."""

    recipe: str = "laion_adapt"
    """name of the recipe, used in run names."""
    ray_address: str = ""
    """Ray cluster to join ('' = RAY_ADDRESS or a local Ray started on demand)."""
    local_num_cpus: int = 0
    """CPUs of a local Ray started on demand (0 = all); where a command runs without Ray (`rayvl pseudo-label`'s one
    labeller on one machine), the CPUs it decodes, crops and runs the model on."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tune: SweepConfig = field(default_factory=SweepConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _config_tree() -> type:
    """The whole tree: the core's sections, then each registered method's own (``Method.sections``, in registration
    order) — one dataclass, so a method's keys are typed, checked and documented as the core's are, and the core
    names none of them."""
    sections = [(key, cls, field(default_factory=cls)) for key, cls in plugins.config_sections()]
    tree = dataclasses.make_dataclass("RayvlConfig", sections, bases=(CoreConfig,))
    tree.__module__ = __name__  # pickled by reference (a run's workers get the config typed)
    tree.__doc__ = "The config tree of every rayvl job: the core's sections and the registered methods'."
    return tree


RayvlConfig = _config_tree()


EVAL_TASKS = ("zeroshot", "retrieval", "paraphrase", "sts")


# ----------------------------------------------------------------------------- typed construction

def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return _build(hint, value, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            hint = f" (a list of one: {key}=[{value}])" if isinstance(value, (str, int, float)) else ""
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}{hint}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return {_coerce(k, args[0], f"{key} key"): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if key in NUMBERS_AS_TEXT and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # one source's factor, which YAML and --set read as a number
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


NUMBERS_AS_TEXT = {"data.upsampling_factors"}


def _build(cls: type, values: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in values:
        if k not in names:
            full = f"{prefix}.{k}" if prefix else k
            close = difflib.get_close_matches(k, names, n=1)
            hint = f"did you mean {f'{prefix}.{close[0]}' if prefix else close[0]}? " if close else ""
            raise ConfigError(f"{full}: unknown key ({hint}known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in values.items()}
    return cls(**kwargs)


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _Loader(yaml.SafeLoader):
    """YAML as a user writes numbers: ``1e-3`` is a float (YAML 1.1, PyYAML's default, wants ``1.0e-3`` and
    reads ``1e-3`` as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789."))


def load_yaml(text: str, where: str):
    """YAML text → Python values; a syntax error is a ConfigError naming ``where`` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None


# the YAML files installed with rayvl, by what the command line calls them: configs/ and tune_spaces/ as packages
INSTALLED = {"--config": "rayvl.configs", "search space": "rayvl.tune_spaces"}


def installed_dir(key: str) -> Path:
    """The folder of INSTALLED[key]: the installed package, or the checkout's folder where rayvl runs from its source
    tree without an install that maps it (PYTHONPATH, an editable install made before the package existed)."""
    try:
        return Path(str(importlib.resources.files(INSTALLED[key])))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / INSTALLED[key].split(".", 1)[1]


def installed_file(path: str | Path, key: str) -> Path:
    """``path``; where no such file exists and it is a bare name (``bow_pretrain``, ``curriculum.yaml``), the file
    of that name installed with rayvl for ``key`` (INSTALLED), so it works from any folder."""
    given = Path(path).expanduser()
    if given.exists() or given.name != str(path):
        return given
    packaged = installed_dir(key) / f"{given.stem}.yaml"
    return packaged if packaged.is_file() and given.suffix in ("", ".yaml") else given


def recipe_file(path: str | Path) -> Path:
    return installed_file(path, "--config")


def read_yaml(path: str | Path, key: str) -> Any:
    """A YAML file's values; a missing file or a syntax error is a ConfigError naming ``key`` and the file."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        hint = ""
        if key in INSTALLED:
            names = sorted(p.stem for p in installed_dir(key).glob("*.yaml"))
            hint = f"; the {'recipes' if key == '--config' else 'search spaces'} rayvl has: {', '.join(names)}"
        raise ConfigError(f"{key}: cannot read {str(path)!r} ({e.strerror or e}{hint})") from None
    return load_yaml(text, f"{key} {path}")


def parse_override(text: str) -> dict:
    """``a.b.c=value`` → {"a": {"b": {"c": value}}}; the value is read as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    value = load_yaml(raw, f"{key.strip()} (override {text!r})") if raw.strip() else ""
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def given_keys(overrides: list[str]) -> frozenset[str]:
    """The dotted keys a list of ``key=value`` overrides sets."""
    return frozenset(text.split("=", 1)[0].strip() for text in overrides if "=" in text)


def precision(t: TrainConfig) -> str:
    """The precision a run trains in: ``train.precision``, with auto resolved by ``train.use_gpu``."""
    if t.precision != "auto":
        return t.precision
    return "bf16" if t.use_gpu else "fp32"


# a recipe's top-level mapping of the dotted keys it cannot run without to what each one is (configs/clip_finetune.yaml:
# the whole CLIP to fine-tune, which no package ships): the recipe or the command line must give each a value
REQUIRES = "requires"


def _check_required(values: dict, requires: dict, path) -> None:
    """A key a recipe requires that neither it nor a --set gives is a ConfigError naming the key, before Ray starts."""
    for key, what in requires.items():
        node: Any = values
        for part in str(key).split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node in (None, "", [], {}):
            recipe = values.get("recipe") or Path(str(path)).stem
            raise ConfigError(f"{key}: the {recipe} recipe needs it: {' '.join(str(what).split())}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                cwd: str | None = None) -> RayvlConfig:
    """Defaults ← recipe YAML ← ``--set`` overrides, relative local paths made absolute against ``cwd`` (the
    working directory where the command runs: ``absolute_paths``), then validated."""
    values: dict = {}
    requires: dict = {}
    if path:
        loaded = read_yaml(recipe_file(path), "--config") or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of sections")
        values = dict(loaded)
        requires = values.pop(REQUIRES, None) or {}
        if not isinstance(requires, dict):
            raise ConfigError(f"{path}: {REQUIRES}: expected a mapping of dotted keys to what each one is")
    given: dict = {}
    for text in overrides or []:
        given = _merge(given, parse_override(text))
    values = _merge(values, given)
    _check_required(values, requires, path)
    base = cwd or os.getcwd()
    values = _clip_settings(_absolute_clip(values, base), given)
    cfg = absolute_paths(_build(RayvlConfig, _loss_defaults(values)), base)
    validate(cfg)
    return cfg


def with_overrides(cfg: RayvlConfig, overrides: list[str], cwd: str | None = None) -> RayvlConfig:
    """``cfg`` with ``key=value`` overrides applied as load_config applies them to a recipe, validated again."""
    base = cwd or os.getcwd()
    if not overrides:
        return absolute_paths(cfg, base)
    given: dict = {}
    for text in overrides:
        given = _merge(given, parse_override(text))
    values = _absolute_clip(_merge(cfg.to_dict(), given), base)
    cfg = absolute_paths(_build(RayvlConfig, _loss_defaults(_clip_settings(values, given))), base)
    validate(cfg)
    return cfg


def _absolute_clip(values: dict, base: str) -> dict:
    """``values`` with a relative model.init_from_clip under ``base``: its weights decide settings before the
    config is built (``_clip_settings``), where absolute_paths would come too late."""
    clip = values.get("model", {}).get("init_from_clip") if isinstance(values.get("model"), dict) else None
    if not isinstance(clip, str) or not clip:
        return values
    return {**values, "model": {**values["model"], "init_from_clip": local_paths.absolute(clip, "file", base)}}


# what a whole CLIP's weights cannot say, so model.clip may set it by hand
CLIP_BY_HAND = ("vision_heads", "text_heads", "quick_gelu")
# what a whole CLIP's weights give as defaults only: a recipe or a --set may choose another
CLIP_DEFAULTS = (("data", "image_size"), ("data", "max_text_tokens"))


def _clip_settings(values: dict, given: dict) -> dict:
    """With ``model.init_from_clip``: the settings its weights decide (rayvl.models.whole_clip.settings) replace the
    recipe's; a ``--set`` of one of them to another value is an error naming the key — except the CLIP_DEFAULTS
    (data.image_size: a CLIP fine-tuned at another resolution, its position embeddings resampled; data.max_text_tokens:
    fewer tokens than its context), which a recipe or a --set keeps, and the model.clip fields the weights cannot say
    (CLIP_BY_HAND)."""
    source = (values.get("model") or {}).get("init_from_clip")
    if not source:
        return values
    if not isinstance(source, str):
        raise ConfigError(f"model.init_from_clip: expected a path, got {source!r}")
    from rayvl.models import whole_clip

    found = whole_clip.settings(source)
    # model.clip as the recipe or the command line give it (a config's own to_dict() too): what weights cannot say
    # is kept, the rest must agree with the weights (image_size follows data.image_size, below)
    by_hand = dict((values.get("model") or {}).get("clip") or {})
    for key, value in by_hand.items():
        if key not in (*CLIP_BY_HAND, "image_size") and found["model"]["clip"].get(key, value) != value:
            raise ConfigError(f"model.clip.{key}: {value!r}, but the CLIP in model.init_from_clip has "
                              f"{found['model']['clip'][key]!r} (only {', '.join(CLIP_BY_HAND)} are set by hand)")
    found["model"]["clip"].update({k: v for k, v in by_hand.items() if k in CLIP_BY_HAND})
    for section, settings in found.items():
        for key, value in settings.items():
            mine = (given.get(section) or {}).get(key, value)
            if key != "clip" and (section, key) not in CLIP_DEFAULTS and mine != value:
                raise ConfigError(f"{section}.{key}: {mine!r} contradicts the CLIP in model.init_from_clip, whose "
                                  f"{key} is {value!r} (leave it unset: it is read from the checkpoint)")
    out = dict(values)
    for section, settings in found.items():  # an image size or token count the recipe or the command line set is kept
        mine = {k: v for k, v in (values.get(section) or {}).items() if (section, k) in CLIP_DEFAULTS}
        out[section] = {**(values.get(section) or {}), **settings, **mine}
    out["model"]["clip"] = {**out["model"]["clip"], "image_size": out["data"]["image_size"]}
    return out


def _loss_defaults(values: dict) -> dict:
    """SigLIP's own initial temperature and bias (Zhai et al. 2023 §3: t' = log 10, b = −10) where loss.kind=siglip
    and neither the recipe nor a --set gives them."""
    if (values.get("loss") or {}).get("kind") != "siglip":
        return values
    model = {"init_logit_scale": 10.0, "init_logit_bias": -10.0, **(values.get("model") or {})}
    return {**values, "model": model}


def check_overrides(overrides: list[str]) -> None:
    """Each ``key=value`` on its own: the key exists and the value has its type or is one of its values
    (ConfigError naming the key); what they make together with a recipe is load_config's to check."""
    values: dict = {}
    for text in overrides:
        values = _merge(values, parse_override(text))
    _check_loss_kind(_build(RayvlConfig, values))


def from_dict(values: dict) -> RayvlConfig:
    model = values.get("model") or {}
    if model.get("init_from_clip") and not (model.get("clip") or {}).get("vision_width"):
        values = _clip_settings(values, {})  # a dict not made by load_config: the CLIP's settings read now
    cfg = _build(RayvlConfig, values)
    validate(cfg)
    return cfg


def _validate_logit_bias(cfg: RayvlConfig) -> None:
    if (cfg.model.init_logit_bias is None) == (cfg.loss.kind == "siglip"):
        raise ConfigError("model.init_logit_bias: the siglip loss learns a logit bias (the paper starts it at -10) "
                          "and only it: set it with loss.kind=siglip, leave it unset otherwise")
    if cfg.loss.kind == "siglip" and not cfg.loss.gather_with_grad:
        raise ConfigError("loss.gather_with_grad: siglip pairs each rank's images with every rank's texts, each pair "
                          "once; the texts' gradients must flow back to their owners: set it true")


LOSS_KINDS = ("clip", "siglip")
"""the core's loss kinds; the methods add theirs (rayvl.plugins.loss_kinds)."""


def _check_loss_kind(cfg: RayvlConfig) -> None:
    if cfg.loss.kind not in (kinds := [*LOSS_KINDS, *plugins.loss_kinds()]):
        raise ConfigError(f"loss.kind: {cfg.loss.kind!r} is not one of {kinds}")


def validate(cfg: RayvlConfig) -> None:
    """Impossible combinations, each naming the key to change."""
    _check_loss_kind(cfg)
    _validate_train(cfg.train)
    _validate_data(cfg.data, cfg.train)
    m = cfg.model
    if m.embed_dim < 1:
        raise ConfigError(f"model.embed_dim: must be ≥ 1, got {m.embed_dim}")
    if m.init_logit_scale <= 0 or m.init_logit_scale > m.max_logit_scale:
        raise ConfigError(
            f"model.init_logit_scale: must be in (0, model.max_logit_scale={m.max_logit_scale}], "
            f"got {m.init_logit_scale}"
        )
    _validate_clip(m, cfg.data.image_size, cfg.data.max_text_tokens)
    if not 0.0 <= m.patch_dropout < 1.0:
        raise ConfigError(f"model.patch_dropout: a share of the patch tokens, in [0, 1), got {m.patch_dropout}")
    _validate_unlocking(m)
    # a whole CLIP's first unlocked group is its projection: its ViT stays locked (DualEncoder)
    if m.patch_dropout and m.vision_strategy == "frozen" and m.vision_unlocked_groups <= bool(m.clip.vision_width):
        raise ConfigError("model.patch_dropout: a locked image tower runs as at evaluation, with every patch "
                          "(model.vision_strategy=frozen" + (", a whole CLIP's projection alone unlocked"
                                                              if m.vision_unlocked_groups else "")
                          + "): drop patches of a tower that trains")
    _validate_logit_bias(cfg)
    for i, task in enumerate(cfg.eval.tasks):
        if task == "linear_probe":
            raise ConfigError(f"eval.tasks[{i}]: linear_probe fits a classifier and runs in `rayvl eval`, "
                              f"not inside training")
        if task not in EVAL_TASKS:
            raise ConfigError(f"eval.tasks[{i}]: unknown task {task!r} (known: {', '.join(EVAL_TASKS)})")
    if cfg.eval.batch_size < 0:
        raise ConfigError(f"eval.batch_size: must be ≥ 0 (0: by the device), got {cfg.eval.batch_size}")
    if cfg.eval.every_steps < 0:
        raise ConfigError(f"eval.every_steps: must be ≥ 0, got {cfg.eval.every_steps}")
    if (cfg.tune.driver_cpus or 0.0) < 0 or any(v <= 0 for v in cfg.tune.driver_resources.values()):
        raise ConfigError("tune.driver_cpus / tune.driver_resources: amounts must be ≥ 0 (resources > 0)")
    if cfg.tune.driver_cpus == 0 and not cfg.tune.driver_resources:
        raise ConfigError("tune.driver_cpus: a trial driver needs some resource (Ray schedules no empty bundle): "
                          "> 0, or name tune.driver_resources")
    plugins.check(cfg)  # each registered method's own constraints


def _validate_unlocking(m: ModelConfig) -> None:
    """Partial unlocking (open_clip's lock flags) applies to a locked tower only."""
    for key, value, strategy, wanted in (("vision_unlocked_groups", m.vision_unlocked_groups, m.vision_strategy,
                                          "model.vision_strategy=frozen"),
                                         ("text_unlocked_layers", m.text_unlocked_layers, m.text_strategy,
                                          "model.text_strategy=frozen")):
        if value < 0:
            raise ConfigError(f"model.{key}: must be ≥ 0, got {value}")
        if value and strategy != "frozen":
            raise ConfigError(f"model.{key}: unlocks the last layers of a locked tower; set {wanted} (now "
                              f"{strategy})")
    if m.vision_freeze_bn_stats and not m.vision_unlocked_groups:
        raise ConfigError("model.vision_freeze_bn_stats: a wholly locked image tower keeps its statistics already; "
                          "it is for the locked groups beside model.vision_unlocked_groups")
    locked = (m.vision_strategy == "frozen" and not m.vision_unlocked_groups and m.text_tower == "lm"
              and m.text_strategy == "frozen" and not m.text_unlocked_layers)
    if m.clip.vision_width and locked and not m.learn_logit_scale and m.init_logit_bias is None:
        raise ConfigError("model.learn_logit_scale: a whole CLIP locked in both towers is locked with its "
                          "projections (open_clip's --lock-image --lock-text), so only its temperature trains: "
                          "nothing would train without it (unlock groups or layers, or learn the temperature)")


def _validate_clip(m: ModelConfig, image_size: int, max_tokens: int) -> None:
    """A whole CLIP is both towers at once: its shapes, its end-of-text pooling and no other image weights."""
    named = {k for k, on in (("model.vision", m.vision == "clip"), ("model.pooling", m.pooling == "eot"),
                             ("model.clip", m.clip.vision_width > 0)) if on}
    if named and len(named) < 3:
        raise ConfigError(f"{sorted({'model.vision', 'model.pooling', 'model.clip'} - named)[0]}: a whole CLIP's "
                          f"towers (model.vision=clip, model.pooling=eot, model.clip's shapes) come together — "
                          f"set model.init_from_clip, which sets them all")
    if named and m.vision_checkpoint:
        raise ConfigError("model.vision_checkpoint: the image tower's weights come from model.init_from_clip; "
                          "leave it unset")
    if named and max_tokens > m.clip.context_length:
        raise ConfigError(f"data.max_text_tokens: {max_tokens}, but the CLIP's text transformer has "
                          f"{m.clip.context_length} positions")
    if named and m.clip.image_size != image_size:
        raise ConfigError(f"model.clip.image_size: the CLIP's image tower is built for data.image_size "
                          f"({image_size}), not {m.clip.image_size}")
    if named and m.text_tower != "lm":
        raise ConfigError("model.text_tower: a whole CLIP has its text transformer; class_embedding replaces it")


def _validate_steps(t: TrainConfig) -> None:
    """What must fit in train.max_steps — checked against the steps a budget in passes resolves to
    (run_plan.steps_for_passes validates it with those), not the placeholder max_steps."""
    if t.max_passes > 0:
        return
    if not 0 <= t.stop_at_step <= t.max_steps:
        raise ConfigError(f"train.stop_at_step: must be in [0, train.max_steps={t.max_steps}], got {t.stop_at_step}")
    if t.warmup_steps < 0 or t.warmup_steps >= t.max_steps:
        raise ConfigError(f"train.warmup_steps: must be in [0, train.max_steps={t.max_steps}), got {t.warmup_steps}")


def _validate_schedule(t: TrainConfig) -> None:
    if t.max_passes < 0:
        raise ConfigError(f"train.max_passes: must be ≥ 0, got {t.max_passes}")
    if t.lr_schedule != "constant_cooldown":
        if t.cooldown_steps:
            raise ConfigError(f"train.cooldown_steps: a cooldown ends train.lr_schedule=constant_cooldown (now "
                              f"{t.lr_schedule})")
        return
    if t.max_passes > 0:  # checked against the steps the plan resolves (run_plan.steps_for_passes)
        return
    if not 0 < t.cooldown_steps <= t.max_steps - t.warmup_steps:
        raise ConfigError(f"train.cooldown_steps: constant_cooldown decays over the last steps after the warm-up: in "
                          f"[1, {t.max_steps - t.warmup_steps}], got {t.cooldown_steps}")
    if not 0 <= t.cooldown_end_lr <= t.lr:
        raise ConfigError(f"train.cooldown_end_lr: must be in [0, train.lr={t.lr:g}], got {t.cooldown_end_lr:g}")


def _validate_train(t: TrainConfig) -> None:
    if t.sync_every_s < 0:
        raise ConfigError(f"train.sync_every_s: must be ≥ 0, got {t.sync_every_s}")
    if t.zero_stage not in ("auto", 0, 1, 2, 3) or isinstance(t.zero_stage, bool):
        raise ConfigError(f"train.zero_stage: {t.zero_stage} is not a DeepSpeed ZeRO stage (0, 1, 2 or 3) or auto")
    if t.zero_offload == "optimizer" and t.zero_stage == 0:
        raise ConfigError("train.zero_offload: offloading the optimizer state needs train.zero_stage ≥ 1")
    if t.zero_offload == "optimizer_and_params" and t.zero_stage not in (3, "auto"):
        raise ConfigError("train.zero_offload: offloading parameters needs train.zero_stage=3")
    if t.compile:
        import torch._dynamo

        if t.compile not in torch._dynamo.list_backends(exclude_tags=()):
            raise ConfigError(f"train.compile: {t.compile!r} is not a torch.compile backend (known: "
                              f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))})")
    if t.zero_bucket_size < 1:
        raise ConfigError(f"train.zero_bucket_size: must be ≥ 1, got {t.zero_bucket_size}")
    if not t.use_gpu and t.precision == "fp16":
        raise ConfigError("train.precision: fp16 needs GPUs (train.use_gpu=true); CPU workers train in fp32 or bf16")
    for name in ("num_workers", "micro_batch_size", "grad_accumulation", "max_steps", "log_every",
                 "checkpoint_every", "checkpoints_to_keep"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}: must be ≥ 1, got {getattr(t, name)}")
    _validate_schedule(t)
    _validate_steps(t)
    if t.lr <= 0:
        raise ConfigError(f"train.lr: must be > 0, got {t.lr}")
    if t.cpus_per_worker <= 0:
        raise ConfigError(f"train.cpus_per_worker: must be > 0, got {t.cpus_per_worker}")
    if t.max_failures < 0:
        raise ConfigError(f"train.max_failures: must be ≥ 0, got {t.max_failures}")
    for i, logger in enumerate(t.report_to):
        if logger not in REPORT_TO:
            raise ConfigError(f"train.report_to[{i}]: unknown logger {logger!r} (known: {', '.join(REPORT_TO)})")


def upsampling_factors(d: DataConfig) -> tuple[float, ...]:
    """data.upsampling_factors as numbers, one per ``::`` source of data.train (the demo is one source); () when
    unset. ConfigError naming the key for a bad entry or count."""
    if not d.upsampling_factors.strip():
        return ()
    factors = []
    for entry in d.upsampling_factors.split("::"):
        try:
            f = float(entry)
        except ValueError:
            f = float("nan")
        if not f > 0 or f == float("inf"):
            raise ConfigError(f"data.upsampling_factors: every factor is a positive number, got {entry.strip()!r} "
                              f"in {d.upsampling_factors!r}")
        factors.append(f)
    n = len([s for s in d.train.split("::") if s.strip()]) if d.train else 1
    if len(factors) != n:
        raise ConfigError(f"data.upsampling_factors: {len(factors)} factor{'s' if len(factors) != 1 else ''} for "
                          f"{n} source{'s' if n != 1 else ''} in data.train (one per '::' source, e.g. "
                          f"{'::'.join(['1'] * n)!r})")
    return tuple(factors)


def _validate_data(d: DataConfig, t: TrainConfig) -> None:
    if d.image_size < 32:
        raise ConfigError(f"data.image_size: must be ≥ 32, got {d.image_size}")
    if not 0.0 < d.crop_scale_min <= 1.0:
        raise ConfigError(f"data.crop_scale_min: must be in (0, 1], got {d.crop_scale_min}")
    if d.max_text_tokens < 4:
        raise ConfigError(f"data.max_text_tokens: must be ≥ 4, got {d.max_text_tokens}")
    if d.read_cpus <= 0:
        raise ConfigError(f"data.read_cpus: must be > 0, got {d.read_cpus}")
    if d.samples_per_pass < 0:
        raise ConfigError(f"data.samples_per_pass: must be ≥ 0 (0 = from img2dataset's files), got {d.samples_per_pass}")
    if d.read_threads < 1:
        raise ConfigError(f"data.read_threads: must be ≥ 1, got {d.read_threads}")
    upsampling_factors(d)
    if d.io_retries < 0 or d.io_retry_wait_s < 0:
        raise ConfigError(f"data.io_retries / data.io_retry_wait_s: must be ≥ 0, got {d.io_retries} / "
                          f"{d.io_retry_wait_s}")
    if d.read_buffer_mib < 1:
        raise ConfigError(f"data.read_buffer_mib: must be ≥ 1, got {d.read_buffer_mib}")
    # the embedded demo's size matters only when the demo is what the run reads
    if not d.train and d.demo_samples < t.num_workers * t.micro_batch_size:
        raise ConfigError(
            f"data.demo_samples: {d.demo_samples} cannot fill one global batch of "
            f"{t.num_workers}×{t.micro_batch_size} (train.num_workers × train.micro_batch_size)"
        )
