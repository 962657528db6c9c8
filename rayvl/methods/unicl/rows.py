"""[UniCL]'s data: image-label samples as (image, class prompt, class id) rows (§3, Algorithm 1) — from
shards whose samples carry ``cls`` (a member or in their JSON) or from Fashion-MNIST — and the image-label stream
the driver builds beside (or instead of) the image-text one (App. B.2)."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from rayvl import assets
from rayvl.data import fashion_mnist, shards
from rayvl.data.parts import Contribution, DataPart, RowTransform, RunData, Sample
from rayvl.data.pipeline import UNLABELLED, Rows, model_inputs, read_columns
from rayvl.methods.unicl.prompts import Prompts, load_prompts
from rayvl.data.report import current_token, record
from rayvl.data.seeding import row_rng
from rayvl.errors import ConfigError

if TYPE_CHECKING:
    import ray



class Prompted(RowTransform):
    """An image-label shard row: its ``cls`` (member or JSON) is the label and its caption a prompt drawn for that
    class (even for evaluation rows: the prompt is the caption); a class outside ``prompts.train_classes`` is
    excluded and counted, a row without a class dropped and counted."""

    columns = {"label": UNLABELLED}
    draws = True

    def __init__(self, prompts: Prompts):
        self.prompts = prompts

    def source(self, raw, sample: Sample) -> tuple[str, str | None]:
        return _prompt_for(sample.cls, self.prompts, sample.rng)

    def expand(self, text: str, sample: Sample, counts: Counter) -> list[dict[str, int]]:
        return [{"label": sample.cls}]  # Algorithm 1: the label of an image-label row is its class id


def _prompt_for(cls: int, prompts: Prompts, rng) -> tuple[str, str | None]:
    if not 0 <= cls < len(prompts.classes):
        return "", "dropped_missing_cls"
    if cls not in prompts.train_classes:
        return "", "excluded_held_out_class"
    return prompts.caption(cls, rng), None


def prompt_batch(batch: dict, *, prompts: Prompts, image_size: int, crop_scale_min: float, tokenizer_path: str,
                 max_tokens: int, report_name: str | None, seed: int = 0) -> dict:
    """Fashion-MNIST rows → model inputs with a drawn prompt as caption and the class id as label; a row's crop and
    prompt are drawn from (``seed``, its key, its ``pass`` column, 0 without one) alone. Counted in the report
    directly, before the batch is emitted."""
    token = current_token(report_name)  # the worker group this batch counts for, asked before it is made
    rows = Rows(image_size, crop_scale_min, True, tokenizer_path, max_tokens, seed)
    counts: Counter = Counter()
    images, captions, labels, keys = [], [], [], []
    passes = batch.get("pass", np.zeros(len(batch["key"]), np.int64))
    for key, pixels, cls, pass_ in zip(batch["key"], batch["pixels"], batch["cls"], passes):
        cls = int(cls)
        if cls not in prompts.train_classes:
            counts["excluded_held_out_class"] += 1
            continue
        rng = row_rng(seed, key, pass_)
        images.append(fashion_mnist.to_rgb(pixels, image_size, crop_scale_min, rng))
        captions.append(prompts.caption(cls, rng))
        labels.append(cls)
        keys.append(key)
    record(report_name, {"samples_seen": len(batch["key"]), "samples_kept": len(keys), **counts}, token=token)
    return {**model_inputs(images, captions, keys, rows), "label": np.array(labels, dtype=np.int64)}


class UniclData(DataPart):
    """The image-label stream, counted in its own data report; a class-embedding model gets one row per class."""

    name = "unicl"
    streams = {"image_label": "labels"}

    def __init__(self, prompts: Prompts):
        self.prompts = prompts

    def classes(self) -> int:
        # [UniCL] eq. (4): one learned class embedding per class of the image-label source
        return len(self.prompts.classes)

    def batch_rows(self, cfg) -> int:
        return label_rows(cfg)

    def build(self, run: RunData) -> Contribution:
        labeled = labeled_dataset(run.cfg, self.prompts, run.reports["image_label"])
        # App. B.2: next to image-text data, or instead of it (image_label.weight = 1)
        return Contribution(datasets={"labeled" if run.cfg.image_label.weight < 1.0 else "train": labeled})


def data_part(cfg, train: str, evalset: str) -> UniclData | None:
    """UniCL's data part when image_label.data is set."""
    if not cfg.image_label.data:
        return None
    if cfg.image_label.data == "fashion-mnist":
        try:
            assets.require_fashion_mnist()
        except assets.MissingAssetError as e:
            raise ConfigError(str(e)) from None
    return UniclData(resolve_prompts(cfg))


def resolve_prompts(cfg) -> Prompts | None:
    """Class names and templates of the image-label source (before Ray starts: a bad file is a config error)."""
    il = cfg.image_label
    if not il.data:
        return None
    try:
        default = fashion_mnist.CLASSES if fashion_mnist.is_fashion_mnist(il.data) else None
        return load_prompts(il.classes, il.templates, il.train_classes, default)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(str(e) if str(e).startswith("image_label") else f"image_label.classes: {e}") from None


def label_rows(cfg) -> int:
    """Image-label rows in each micro-batch of a mixed run (App. B.2); 0 without image-label data."""
    return round(cfg.train.micro_batch_size * cfg.image_label.weight) if cfg.image_label.data else 0


def labeled_dataset(cfg, prompts: Prompts, report_name: str | None) -> ray.data.Dataset:
    """The image-label stream: Fashion-MNIST IDX rows or img2dataset shards with ``cls``, prompts as captions."""
    d, il, t = cfg.data, cfg.image_label, cfg.train
    if not fashion_mnist.is_fashion_mnist(il.data):
        rows = Rows.of(cfg, True, (Prompted(prompts),))
        return shards.read_shards(il.data, rows, shards.Reading.of(cfg, report_name), read_columns(rows.decode))
    pixels, labels = fashion_mnist.read(il.data, limit=il.limit)
    # the rows the run trains on (+ one micro-batch per rank of slack): without a limit the stream runs through its
    # whole epoch ahead of training, as fast as the object store takes it, on CPUs the training workers need
    needed = (t.max_steps * t.grad_accumulation + 1) * t.num_workers * label_rows(cfg)
    usable = max(1, int(np.isin(labels, sorted(prompts.train_classes)).sum()))
    rows = Rows.of(cfg, True)
    # every pass the run needs in one execution: each pass draws its own photo order, crops and prompts
    ds = fashion_mnist.passes(pixels, labels, t.seed, -(-needed // usable), d.read_cpus).map_batches(
        prompt_batch, batch_size=d.transform_batch_size, batch_format="numpy", num_cpus=d.read_cpus,
        fn_kwargs=dict(prompts=prompts, seed=t.seed, image_size=rows.image_size, crop_scale_min=rows.crop_scale_min,
                       tokenizer_path=rows.tokenizer_path, max_tokens=rows.max_tokens, report_name=report_name))
    # given the map's CPUs, the column selection fuses into its tasks (alone it would ask for a whole CPU); the
    # photos are decoded already (prompt_batch's rows are the CPU's)
    return ds.select_columns(read_columns("cpu"), num_cpus=d.read_cpus).limit(needed)
