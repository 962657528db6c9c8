"""What a run or a sweep would do, found out without doing it (``--dry-run``; a labelling job's: the [BoW]
method's commands), and what a shard spec holds (``rayvl data check``): the config validated, every data spec
resolved and checked as far as is cheap, the first sample of the first and the last shard read, the batch
arithmetic, the storage and the resources the cluster is asked for. No Ray is started."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from itertools import islice

import numpy as np

from rayvl import plugins, storage
from rayvl.assets import VISION_ASSETS
from rayvl.config import ConfigError, RayvlConfig, precision
from rayvl.data.images import decode
from rayvl.data.mix import Mix
from rayvl.data.pipeline import class_of, label_vector
from rayvl.data.shard_io import ReadPolicy, ShardIOError, open_shard
from rayvl.data.shards import samples_per_pass
from rayvl.data.specs import SpecCheck, checked
from rayvl.data.tar import DAMAGED, IMAGE_EXTENSIONS, iter_tar_samples, member_extensions
from rayvl.data.text import validate_caption


def first_samples(path: str, n: int, policy: ReadPolicy, damage: dict | None = None) -> list[dict]:
    """The first ``n`` samples of a shard, as raw members: those before a damage, which goes in ``damage`` by path
    (the run reads the same samples and counts the shard in ``truncated_shards``)."""
    out: list[dict] = []
    with open_shard(path, policy) as f:
        try:
            out.extend(islice(iter_tar_samples(f), n))
        except DAMAGED as e:
            if damage is not None:
                damage[path] = f"{type(e).__name__}: {e}"
    return out


SAMPLED = 32  # samples read from the start of the first and of the last shard
IMAGE_DROPS = ("dropped_missing_image", "dropped_corrupt_image")  # the data report's names


def describe_sample(sample: dict, held_out: bool = False) -> tuple[str, str | None]:
    """(a line describing the sample, the reason it would be dropped or None): an image reason before a caption
    reason (a method may source the caption elsewhere; nothing sources the image). A ``held_out`` sample with a
    class, or a multi-hot vector of classes (a multilabel set's ``npy``: the line does not check it is one), needs
    no caption (rayvl.data.pipeline)."""
    text, reason = validate_caption(sample.get("txt"))
    uncaptioned = held_out and sample.get("txt") is None
    cls = class_of(sample) if uncaptioned else -1
    vector = label_vector(sample.get("npy")) if uncaptioned and cls < 0 else None
    if cls >= 0:
        text, reason = f"class {cls}, no caption", None
    elif vector is not None:
        text, reason = f"classes {np.flatnonzero(vector).tolist()}, no caption", None
    image = decode(sample["img"]) if sample.get("img") is not None else None
    if sample.get("img") is None:
        reason = "dropped_missing_image"
    elif image is None:
        reason = "dropped_corrupt_image"
    size = f"{image.width}×{image.height} {sample['img_ext']}" if image is not None else "no image"
    caption = text if len(text) <= 60 else text[:57] + "..."
    return f"{sample['key']}: {size}, {caption!r}" + (f" ({reason})" if reason else ""), reason


def sample_lines(key: str, paths: list[str], policy: ReadPolicy, read: dict | None = None) -> list[str]:
    """The first sample of the first and of the last shard, and what becomes of their first SAMPLED samples: a
    ConfigError naming ``key`` when the shards cannot be read, or when most of those samples have no image rayvl
    reads (naming the members they have). ``read``: gets the samples read, by shard, for the caller's own use."""
    lines, reasons, damage = [], Counter(), {}
    for path in dict.fromkeys([paths[0], paths[-1]]):
        try:
            samples = first_samples(path, SAMPLED, policy, damage)
        except ShardIOError as e:
            raise ConfigError(f"{key}: {e}") from None
        if read is not None:
            read[path] = samples
        described = [describe_sample(x, held_out=key == "data.eval") for x in samples]
        lines.append(f"    {path}: {described[0][0] if described else 'no sample (an empty or damaged shard)'}")
        if path in damage:
            lines.append(f"      damaged after {len(samples)} samples ({damage[path]}): the run reads those and "
                         f"counts the shard in truncated_shards")
        reasons.update(reason or "kept" for _, reason in described)
    seen, without = sum(reasons.values()), sum(reasons[r] for r in IMAGE_DROPS)
    said = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
    if without * 2 > seen:
        with open_shard(paths[0], policy) as f:
            members = ", ".join(f".{ext} in {n}" for ext, n in member_extensions(f, SAMPLED).items())
        raise ConfigError(f"{key}: {without} of the {seen} samples read from the start of its first and last shards "
                          f"would be dropped for their image ({said}); the first shard's first {SAMPLED} samples "
                          f"have these members: {members or 'none'} — rayvl reads images from "
                          f"{', '.join(IMAGE_EXTENSIONS)} members")
    lines.append(f"    of the first {SAMPLED} samples of the first and the last shard: {said}")
    return lines


def data_lines(key: str, check: SpecCheck, policy: ReadPolicy, given: int = 0,
               read: dict | None = None, known: tuple[int | None, str] | None = None,
               mix: Mix | None = None) -> tuple[list[str], int | None]:
    """``given``: the samples a pass holds as the config says (data.samples_per_pass; 0 = from the shards' files);
    ``read``: as sample_lines; ``known``: (samples a pass, how it was found) as a run's plan found it; ``mix``: the
    sources' upsampling (rayvl.data.mix), a line of its own when it reads a source other than once a pass."""
    samples, how = known or samples_per_pass(given, check.paths, mix)
    size = f"{samples:,} samples a pass ({how})" if samples else f"samples a pass unknown ({how})"
    mixed = [f"    upsampled (data.upsampling_factors), a pass reads {mix.n_slots:,} shards: {mix.describe()}"] \
        if mix is not None and mix.upsampled else []
    return [f"  {key}: {check.summary}", *mixed, f"    {size}", *sample_lines(key, check.paths, policy, read)], samples


def _data_section(d, planned, policy: ReadPolicy, read: dict) -> tuple[list[str], int | None]:
    """The dry run's lines on each data spec of a run's plan, and the samples a training pass holds."""
    lines, per_pass = [], None
    if not d.train:
        lines.append(f"  data.train: the embedded demo dataset ({d.demo_samples} + {d.demo_eval_samples} generated "
                     f"scenes in {d.demo_dir}, written on first use)"
                     + (f"; {planned.pass_size:,} samples a pass ({planned.pass_size_from})"
                        if planned.pass_size != d.demo_samples else ""))
        per_pass = planned.pass_size
    for key, check in planned.data.checks.items():
        train = key == "data.train"
        more, samples = data_lines(key, check, policy, read=read,
                                   known=(planned.pass_size, planned.pass_size_from) if train else None,
                                   mix=planned.data.train_mix if train else None)
        lines += more
        per_pass = samples if train else per_pass
    return lines, per_pass


def describe(cfg: RayvlConfig, given: frozenset[str] = frozenset()) -> str:
    """What one training run would do (``--dry-run``'s report); raises ConfigError for what would fail. ``given``:
    the dotted keys the command line set (no demo-budget warning for them)."""
    from rayvl.train.run_plan import plan_run

    d, t = cfg.data, cfg.train
    # the run plan a run would make (each enabled method's data part on the demo's paths when no data is given), with
    # nothing written: its checks, parts, pass size and paths are what the lines below print
    planned = plan_run(cfg, finished_ok=False, dry=True)
    if cfg.train.max_passes:  # the budget's steps, as the run resolves them
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=planned.data.cfg.train.max_steps))
        t = cfg.train
    checks, parts, store, name = planned.data.checks, planned.data.parts, planned.storage, planned.name
    policy = ReadPolicy.of(d)
    read: dict = {}  # the samples the data lines read, by shard: the evaluation lines look at the held-out ones
    more, per_pass = _data_section(d, planned, policy, read)
    lines = [f"recipe {cfg.recipe}: config valid", "data:", *more]
    if d.train and not d.eval and cfg.eval.tasks:
        lines.append("  data.eval: none — evaluation is off (give held-out shards with --eval-data)")
    # rows a method fills from a stream of its own (UniCL's image-label rows), not from the training shards
    own = {stream: n for stream, n in ((", ".join(p.streams) or p.name, p.batch_rows(cfg)) for p in parts) if n}
    text_rows = t.micro_batch_size - sum(own.values())
    global_batch = t.num_workers * t.micro_batch_size * t.grad_accumulation
    lines += ["batches:",
              f"  {t.num_workers} workers × {t.micro_batch_size} per micro-batch × {t.grad_accumulation} accumulated = "
              f"{global_batch:,} samples a step"
              + "".join(f" ({n} {stream} rows per micro-batch)" for stream, n in own.items()),
              f"  negatives per query: {t.num_workers * t.micro_batch_size:,} in the gathered batch"
              + "".join(f" + {n:,} in {where}" for n, where in plugins.extra_negatives(cfg))]
    if per_pass and text_rows:  # (image-label only: the image-text shards are not read)
        steps = per_pass / (t.num_workers * text_rows * t.grad_accumulation)
        lines.append(f"  {steps:,.0f} steps a pass; train.max_steps={t.max_steps:,} is "
                     f"{t.max_steps / steps:,.2f} passes")
    lines += _scale_warnings(cfg, steps if per_pass and text_rows else None, given)
    lines += model_lines(cfg) + evaluation_lines(cfg, checks.get("data.eval"), read,
                                                 planned.data.files.get("classes_file", ""))
    gpu = {"GPU": 1} if t.use_gpu else {}
    lines += ["cluster:",
              f"  {t.num_workers} Ray Train workers of {{CPU: {t.cpus_per_worker:g}"
              + (", GPU: 1" if gpu else "") + f"}} (train.placement_strategy={t.placement_strategy}), "
              f"{precision(t)}",
              f"  engine: {engine_line(planned.layout, t.zero_stage)}",
              f"  Ray Data read tasks of data.read_cpus={d.read_cpus:g} CPU each, {d.read_threads} transform threads, "
              f"I/O: {d.io_retries} retries, unreadable shards: {d.unreadable_shards}",
              f"  images decoded {decode_words(d.decode, t.use_gpu)} (data.decode={d.decode})",
              "storage:",
              f"  run directory {storage.join(store, name)}"
              + (" (continued from its latest checkpoint)" if t.resume else ""),
              f"  checkpoint every {t.checkpoint_every:,} steps, {t.checkpoints_to_keep} kept"]
    return "\n".join(lines)


def decode_words(decode: str, gpu: bool) -> str:
    """Where the training images are decoded, said in the dry run."""
    if decode == "cpu":
        return "and cropped in the read tasks"
    where = "each worker's GPU (nvJPEG, where its torchvision has it)" if gpu else "each worker (Pillow: no GPU)"
    return f"by {where}: the read tasks send JPEGs' bytes with their crop boxes, other formats decoded"


def engine_line(layout, stage) -> str:
    """The engine layout the run trains in, and why where auto chose it."""
    if layout is not None:
        return layout.line()
    if stage == "auto":
        return ("DeepSpeed ZeRO stage auto — chosen when the run joins its cluster, from the GPU type Ray reports "
                "(rayvl.train.layout)")
    return f"DeepSpeed ZeRO-{stage} (train.zero_stage)"


def _scale_warnings(cfg: RayvlConfig, steps_a_pass: float | None, given: frozenset[str] = frozenset()) -> list[str]:
    """What of a demo-sized budget applies to data of the user's own (``data.train`` set) — for the keys the
    recipe set, not those the command line (``given``) did."""
    d, t, e = cfg.data, cfg.train, cfg.eval
    if not d.train:
        return []
    out = []
    if steps_a_pass and t.max_steps < steps_a_pass and not {"train.max_steps", "train.max_passes"} & given:
        out.append(f"train.max_steps={t.max_steps:,} trains {t.max_steps / steps_a_pass:.2%} of one pass over "
                   f"data.train")
    if e.tasks and d.eval and not e.every_steps and "eval.every_steps" not in given:
        out.append("evaluation only at the last step (eval.every_steps=0)")
    if t.warmup_steps <= 20 and "train.warmup_steps" not in given:
        out.append(f"a warm-up of {t.warmup_steps} steps (train.warmup_steps)")
    return [f"  warning: {w} — the recipe's budget for its demo data; set it for yours" for w in out]


def model_lines(cfg: RayvlConfig) -> list[str]:
    """Each tower: where its weights come from, its trainable and frozen parameters (counted on the meta device:
    nothing allocated, no weights read); the optimizer and the schedule."""
    from rayvl.models.dual_encoder import meta_model

    m, t = cfg.model, cfg.train
    classes = m.num_classes  # a class-embedding tower's classes: from its image-label data when 0 (the run finds them)
    model = meta_model(m)

    def params(module) -> str:
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
        return f"{trainable:,} trainable" + (f", {frozen:,} frozen" if frozen else "") + " parameters"

    c = m.clip
    vision = ("pretrained, the package's weights" if m.vision in VISION_ASSETS else
              f"pretrained, {m.vision_checkpoint}" if m.vision_checkpoint else
              f"CLIP's ViT, width {c.vision_width}, {c.vision_layers} layers, patch {c.patch_size}, "
              f"{c.image_size} px" if c.vision_width else
              "random init: model.vision_checkpoint gives it weights")
    clip = ([f"  a whole CLIP, {m.init_from_clip}: both towers, both projections (embedding {c.embed_dim}) and the "
             f"temperature ({m.init_logit_scale:.4g}); {'QuickGELU' if c.quick_gelu else 'GELU'} (model.clip.quick_gelu)"]
            if c.vision_width else [])
    if m.text_tower == "lm" and c.vision_width:
        text = (f"text tower CLIP's transformer (width {c.text_width}, {c.text_layers} layers, {c.context_length} "
                f"positions), pretrained, {m.text_strategy}: {params(model.text)}")
    elif m.text_tower == "lm":
        text = f"text tower {m.text}, pretrained, {m.text_strategy}: {params(model.text)}"
    else:
        text = f"text tower: a class embedding, {m.embed_dim} trainable parameters per class" + (
            f", {classes} classes" if classes else " (the image-label data's classes)")
    # a whole CLIP counts its projection as the last group, as open_clip does (DualEncoder)
    whole = " (its projection the last)" if c.vision_width else ""
    if m.text_unlocked_layers:
        text = text.replace(f"{m.text_strategy}:", f"{m.text_strategy}, its last {m.text_unlocked_layers} layers"
                                                   f"{whole} unlocked:")
    if m.vision_unlocked_groups:
        vision += f"; locked, its last {m.vision_unlocked_groups} layer groups{whole} unlocked"
    return ["model:", *clip, f"  image tower {m.vision} ({vision}): {params(model.vision)}", f"  {text}",
            f"  in all {params(model)}" + ("" if m.text_tower == "lm" or classes else " with one class"),
            f"  AdamW lr {t.lr:g}, betas {t.betas[0]:g}/{t.betas[1]:g}, weight decay {t.weight_decay:g}; linear "
            f"warm-up over {t.warmup_steps:,} steps, {_schedule_words(t)}"
            + (f" (train.max_passes={t.max_passes:g})" if t.max_passes else "")]


def _schedule_words(t) -> str:
    """The learning rate after the warm-up, in words (train.lr_schedule)."""
    if t.lr_schedule == "constant":
        return f"then constant to step {t.max_steps:,}"
    if t.lr_schedule == "constant_cooldown":
        return (f"then constant to step {t.max_steps - t.cooldown_steps:,}, a cooldown (power {t.cooldown_power:g}) "
                f"to {t.cooldown_end_lr:g} at step {t.max_steps:,}")
    return f"cosine decay to 0 at step {t.max_steps:,}"


def evaluation_lines(cfg: RayvlConfig, held_out: SpecCheck | None, read: dict, classes: str = "") -> list[str]:
    """Which evaluation tasks will run and when, which are skipped and why — from the files the run is given
    (``classes``: the class file it resolved, data.classes or a CLIP_benchmark set's) and the first samples of the
    held-out shards, as the data lines read them (``read``; the demo's held-out split has every field)."""
    d, e = cfg.data, cfg.eval
    if not e.tasks:
        return ["evaluation: none (eval.tasks=[])"]
    if d.train and held_out is None:
        return ["evaluation: none — no held-out shards (data.eval, --eval-data)"]
    samples = read[held_out.paths[0]] if held_out is not None else []
    labelled = sum(class_of(x) >= 0 or label_vector(x.get("npy")) is not None for x in samples)
    captioned = sum(x.get("txt") is not None for x in samples)
    demo = not d.train  # the demo's held-out split and files
    skipped = {
        "zeroshot": None if (classes or d.classes or demo) and (labelled or demo) else
        "no class list (data.classes)" if not (classes or d.classes or demo) else
        f"none of the first {len(samples)} held-out samples has a class (a `cls` or `npy` member, a JSON field)",
        "retrieval": None if captioned or demo else f"none of the first {len(samples)} held-out samples has a caption",
        "paraphrase": None if d.paraphrases or demo else "no paraphrase file (data.paraphrases)",
        "sts": None if d.sts or demo else "no STS file (data.sts)"}
    when = f"every {e.every_steps:,} steps and at the last" if e.every_steps else "at the last step only"
    return [f"evaluation: {when}", *(f"  {task}: " + (f"skipped: {skipped[task]}" if skipped.get(task) else "runs")
                                    for task in e.tasks)]


def check_data(spec: str, samples: int, policy: ReadPolicy = ReadPolicy()) -> str:
    """``rayvl data check``: the shards a spec names, what img2dataset's files say a pass holds, and the first
    ``samples`` samples of the first shard decoded, with the reasons any would be dropped."""
    check = checked(spec, spec)  # the spec names itself in the lines and the errors
    seen: dict = {}
    lines, _ = data_lines(spec, check, policy, read=seen)
    damage: dict = {}
    try:  # the first SAMPLED were read already
        read = seen[check.paths[0]][:samples] if samples <= SAMPLED else first_samples(check.paths[0], samples, policy,
                                                                                     damage)
    except ShardIOError as e:
        raise ConfigError(f"{spec}: {e}") from None
    reasons: Counter = Counter()
    lines.append(f"  first {len(read)} samples of {check.paths[0]}:")
    if damage:
        lines.append(f"    damaged after {len(read)} samples ({damage[check.paths[0]]}): the run reads those and "
                     f"counts the shard in truncated_shards")
    for sample in read:
        line, reason = describe_sample(sample)
        reasons[reason or "kept"] += 1
        lines.append(f"    {line}")
    lines.append("  " + ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())))
    return "\n".join(lines)


def describe_sweep(sweep, name: str = "") -> str:
    """What a sweep would do (``rayvl tune --dry-run``'s report): its trials, its directory (named ``name``, --name,
    as the sweep would be), and one trial's run plan."""
    from rayvl.sweeps.directory import sweep_directory, sweep_name
    from rayvl.sweeps.spaces import trial_config

    grid = [len(v["grid"]) for v in sweep.space.values() if "grid" in v]
    trials = math.prod(grid) * sweep.num_samples * max(1, len(sweep.variants))
    cfg = trial_config(sweep.recipe, sweep.fixed, {}, next(iter(sweep.variants.values()), []))
    head = [f"sweep {sweep.path}: {trials} trials over {', '.join(sweep.space) or 'no key'}"
            + (f" × variants {', '.join(sweep.variants)}" if sweep.variants else "")
            + f", metric {sweep.metric} ({sweep.mode}), scheduler {sweep.scheduler.get('kind', 'fifo')}",
            f"  every trial: {' '.join(sweep.fixed) or 'the recipe as it is'}",
            f"  sweep directory {sweep_directory(cfg, sweep_name(sweep, name))} (each trial's run under runs/)",
            "one trial's run (the space's values left out):"]
    return "\n".join(head + ["  " + line for line in describe(cfg).splitlines()])
