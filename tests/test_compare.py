"""Comparisons (rayvl.sweeps.comparison): variants × seeds as one real Ray Tune grid, each trial trained under its own
seed, the per-trial after-evaluation, mean ± std against a float64 reference, and the errors a job's command line
gets before Ray starts."""
import csv
import json

import numpy as np
import pytest
import yaml

from conftest import REPO
from rayvl.sweeps.comparison import Comparison, Stages
from rayvl.sweeps.comparison_report import format_summary, seed_curve, summarize, write_report
from rayvl.sweeps.spaces import SweepError, load_sweep

RECIPE = str(REPO / "configs" / "laion_adapt.yaml")
ROWS = [("held-out text→image R@1 %", "heldout_t2i_R@1", ".1f"), ("final training loss", "loss", ".3f")]


def test_mean_and_sample_std_per_variant_against_float64():
    rng = np.random.default_rng(0)
    values = {"a": rng.normal(50, 5, 3), "b": rng.normal(40, 5, 3)}
    trials = [{"variant": v, "seed": s, "metrics": {"m": float(x)}} for v, xs in values.items()
              for s, x in enumerate(xs)]
    trials[-1]["metrics"] = {}  # a failed trial: the variant's n drops to 2
    out = summarize(trials, ["m"])
    assert out["a"]["m"]["mean"] == pytest.approx(values["a"].mean(), rel=1e-12)
    assert out["a"]["m"]["std"] == pytest.approx(values["a"].std(ddof=1), rel=1e-12)
    assert out["b"]["m"]["n"] == 2 and out["b"]["m"]["std"] == pytest.approx(values["b"][:2].std(ddof=1), rel=1e-12)
    table = format_summary(out, [("metric m", "m", ".2f"), ("absent", "x", ".1f")], seeds=3)
    assert f"{values['a'].mean():.2f} ± {values['a'].std(ddof=1):.2f}" in table and "(n=2)" in table
    assert table.splitlines()[-1].split()[-2:] == ["-", "-"]
    one = summarize([{"variant": "a", "seed": 0, "metrics": {"m": 1.5}}], ["m"])
    assert format_summary(one, [("m", "m", ".2f")], seeds=1).splitlines()[1].split()[-1] == "1.50"
    # the learning curves: each step's mean and std over the seeds that reported it, a share as a percentage
    seeds = [[{"step": 1, "loss": 2.0, "data_wait_share": 0.25}, {"step": 2, "loss": 1.0}],
             [{"step": 1, "loss": 4.0, "data_wait_share": 0.75}, {"step": 2, "loss": None}]]
    assert seed_curve(seeds, "loss") == ([1, 2], [3.0, 1.0], [pytest.approx(np.std([2, 4], ddof=1)), 0.0])
    assert seed_curve(seeds, "data_wait_share")[:2] == ([1], [50.0])


@pytest.mark.parametrize("variants, seeds, metric, match", [
    ({"a": ["train.lr=0.001"], "b": ["memory_bank.size=-3"]}, 3, "loss", r"variants\.b: .*memory_bank\.size"),
    ({"a": ["train.zero_stage=3"], "b": []}, 2, "loss", r"space \(train\.seed\) \(variant a\)|variants\.a"),
    ({"a": [], "b": ["train.lr=0.01"]}, 0, "loss", r"--seeds: must be ≥ 1"),
    ({"a": [], "b": []}, 3, "heldout_R@1", r"metric: 'heldout_R@1' is not reported"),
])
def test_a_bad_comparison_is_an_error_before_ray_starts(variants, seeds, metric, match):
    overrides = ["memory_bank.size=64"] if "zero_stage" in str(variants) else []  # ZeRO-3 cannot hold the bank
    with pytest.raises(SweepError, match=match):
        Comparison("t", RECIPE, variants, ROWS, metric=metric).sweep(overrides, seeds)


def test_a_job_given_data_without_held_out_data_is_refused_before_ray_starts(demo_dir, capsys):
    """`python jobs/bow_pretrain.py --data SHARDS` without --eval-data: its table is evaluation metrics, which a run
    without held-out shards never reports. One line naming the metric and data.eval, status 2, no Ray started
    (with held-out shards the grid validates: test_every_comparison_job_validates_on_the_demo_and_on_real_data)."""
    import ray

    job = _job("bow_pretrain")
    was_running = ray.is_initialized()
    capsys.readouterr()
    assert job.COMPARISON.main(["--data", str(demo_dir / "train"), "--seeds", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayvl: error: bow_pretrain (BoW Table 2): row 'zero-shot top-1 %': 'zeroshot_top1' is an "
                          "evaluation metric, but data.train is given without data.eval") and err.count("\n") == 1
    assert ray.is_initialized() == was_running  # checked before Ray starts


def test_variants_chosen_by_name_or_the_demo_default():
    c = Comparison("t", RECIPE, {"a": [], "b": ["train.lr=0.01"], "c": []}, ROWS, demo_variants=("a", "c"))
    assert list(c.chosen("", demo=True).variants) == ["a", "c"]
    assert list(c.chosen("", demo=False).variants) == list(c.chosen("all", demo=True).variants) == ["a", "b", "c"]
    assert c.chosen("b,a", demo=True).variants == {"b": ["train.lr=0.01"], "a": []}
    with pytest.raises(SweepError, match=r"--variants: unknown d; known: a, b, c"):
        c.chosen("a,d", demo=False)


def test_a_space_file_with_variants_loads_and_a_bad_one_names_the_key(tmp_path):
    path = tmp_path / "space.yaml"
    base = {"recipe": RECIPE, "metric": "loss", "mode": "min", "space": {"train.seed": {"grid": [0, 1, 2]}}}
    path.write_text(yaml.safe_dump({**base, "variants": {"frozen": {"model.text_strategy": "frozen"},
                                                         "finetune": {"model.text_strategy": "finetune"}}}))
    sweep = load_sweep(path)
    assert sweep.variants == {"frozen": ["model.text_strategy=frozen"], "finetune": ["model.text_strategy=finetune"]}
    path.write_text(yaml.safe_dump({**base, "variants": {"x": {"model.text_strategy": "thawed"}}}))
    with pytest.raises(SweepError, match=r"variants\.x: .*text_strategy") as e:
        load_sweep(path)
    assert str(path) in str(e.value)
    path.write_text(yaml.safe_dump({**base, "variants": ["frozen", "finetune"]}))
    with pytest.raises(SweepError, match=r"variants: a mapping of names"):
        load_sweep(path)


def trained_with(result) -> dict:
    """The grid test's ``after``: what the trial's final checkpoint says it was trained with (cheap; the real
    held-out evaluation, rayvl.eval.runner.after_training, is checked in test_training)."""
    from rayvl.checkpoints import read_meta

    config = read_meta(result.checkpoint_dir)["config"]
    return {"after_seed": config["train"]["seed"], "after_lr": config["train"]["lr"],
            "after_data": config["data"]["train"]}


def seeded_by_the_trials_seed(trials: list[dict], root) -> None:
    """Each trial trained under its own train.seed, read from what it trained: its logged losses differ from the
    other seed's, and its randomly initialised layer (vision_proj, new in every model) is near the same seed's
    trial of the other variant — two steps at lr ≤ 0.003 move a weight by at most ≈ 0.006 — and far from the
    other seed's (two initialisations differ by ≈ 0.019 on average)."""
    from rayvl.export import weights

    loss, proj = {}, {}
    for t in trials:
        run = root / {"fast": "lr-fast", "slow": "lr"}[t["variant"]] / "runs" / f"trial-{t['trial']}"
        at = (t["variant"], int(t["seed"]))
        loss[at] = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        proj[at] = weights(json.loads((run / "final_metrics.json").read_text())["checkpoint"])[0]["vision_proj.weight"]
    assert all(len(x) == 2 for x in loss.values())  # steps 1 and 2
    assert all(loss[(v, 0)] != loss[(v, 1)] for v in ("fast", "slow"))

    def distance(a, b):
        return float((proj[a].double() - proj[b].double()).abs().mean())

    same_seed = [distance(("fast", s), ("slow", s)) for s in (0, 1)]
    other_seed = [distance((v, 0), (v, 1)) for v in ("fast", "slow")]
    assert max(same_seed) < 0.5 * min(other_seed), (same_seed, other_seed)


class LearningRates(Comparison):
    """A job's comparison: its notes method adds to the report what a row cannot show."""

    def notes(self, trials: list[dict]) -> str:
        return f"notes: {sum(bool(t['metrics']) for t in trials)} trials finished"


def test_variants_by_seeds_run_as_tune_grids_in_two_stages_with_a_hook_after_each_trial(ray_local, demo_dir,
                                                                                        tmp_path, capsys):
    """Two learning rates × seeds 0 and 1, one worker per trial, two trials side by side, run in two stages as
    TOnICS reads its threshold from its control: "fast" first (grid lr-fast), then "slow" (grid lr) with a learning
    rate read from fast's finished comparison. Every (variant, seed) trains exactly once with its seed and its
    override on the same shards, each trial runs the ``after`` hook on its finished run, and the report of the last
    stage covers both: the summary is the mean ± sample std of what the trials wrote. `rayvl tune --report` on the
    same directory prints the comparison again with the job's rows, and the job's own `--report` adds its notes."""
    from rayvl import cli

    rows = [("learning rate", "after_lr", ".4f"), ("final training loss", "loss", ".3f")]
    comparison = LearningRates("lr", RECIPE, {"fast": ["train.lr=0.003"], "slow": []}, rows,
                               after="test_compare:trained_with", after_metrics=("after_lr",))
    overrides = [f"data.train={demo_dir / 'train'}", f"data.eval={demo_dir / 'eval'}", "data.image_size=32",
                 "data.max_text_tokens=16", "train.micro_batch_size=8", "train.max_steps=2",
                 "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=2", "train.num_workers=1",
                 "model.alignment_layers=1", "model.embed_dim=64", "eval.tasks=[]",
                 f"tune.storage_path={tmp_path}", "train.report_to=[]"]
    read_from = []

    def tenth_of_first(first_dir: str) -> list[str]:  # what the second stage learns from the first one's report
        read_from.append(first_dir)
        with open(f"{first_dir}/comparison.csv") as f:
            lrs = {float(t["after_lr"]) for t in csv.DictReader(f)}
        return [f"train.lr={lrs.pop() / 10}"]

    sweep_dir = comparison.run(overrides, 2, "lr", stages=Stages(["fast"], tenth_of_first))
    assert sweep_dir == str(tmp_path / "lr") and read_from == [str(tmp_path / "lr-fast")]
    table, files = write_report(sweep_dir)  # the rows come from the comparison's file, the trials from both stages

    with open(tmp_path / "lr" / "comparison.csv") as f:
        trials = list(csv.DictReader(f))
    assert [(t["variant"], int(t["seed"])) for t in trials] == [("fast", 0), ("fast", 1), ("slow", 0), ("slow", 1)]
    assert all(t["status"] == "TERMINATED" for t in trials)
    for t in trials:
        stage = tmp_path / {"fast": "lr-fast", "slow": "lr"}[t["variant"]]
        record = json.loads((stage / "runs" / f"trial-{t['trial']}" / "final_metrics.json").read_text())
        assert record["variant"] == t["variant"] and record["values"] == {"train.seed": int(t["seed"])}
        assert record["metrics"]["after_seed"] == int(t["seed"])  # the seed the trial trained with
        assert float(t["after_lr"]) == pytest.approx({"fast": 0.003, "slow": 0.0003}[t["variant"]], rel=1e-12)
        assert record["metrics"]["after_data"] == str(demo_dir / "train")  # the same shards for every trial
        trained = json.loads((stage / "runs" / f"trial-{t['trial']}" / "run.json").read_text())["config"]["train"]
        assert (trained["seed"], trained["lr"]) == (int(t["seed"]), float(t["after_lr"]))  # what train() was given
    seeded_by_the_trials_seed(trials, tmp_path)
    summary = json.loads((tmp_path / "lr" / "comparison.json").read_text())["summary"]
    for variant in ("fast", "slow"):
        values = np.array([float(t["loss"]) for t in trials if t["variant"] == variant], dtype=np.float64)
        assert summary[variant]["loss"]["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert summary[variant]["loss"]["std"] == pytest.approx(values.std(ddof=1), rel=1e-12)
        assert summary[variant]["after_lr"]["std"] == 0.0
    assert "±" in table and "learning rate" in table
    assert {"comparison.png", "curves_loss.png", "comparison.csv", "comparison.json"} <= set(files)

    capsys.readouterr()
    assert cli.main(["tune", "--report", sweep_dir]) == 0
    printed = capsys.readouterr().out
    assert "== variants: mean ± std over train.seed ==" in printed and "learning rate" in printed
    assert printed.count("±") >= 4  # both variants' rows, the first stage's included
    assert comparison.main(["--report", sweep_dir]) == 0
    assert capsys.readouterr().out.rstrip().endswith("notes: 4 trials finished")


def _job(name: str):
    """A comparison job's module (jobs/<name>.py)."""
    import importlib
    import sys

    sys.path.insert(0, str(REPO / "jobs"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "jobs"))


def test_a_set_key_that_a_variant_sets_wins_over_it_unless_two_variants_become_one():
    """The documented GPU command for the ViT arms: --set model.vision gives both arms that tower (the variants'
    own ViT-tiny would win otherwise: a variant comes after --set), each keeping its own patch dropout."""
    from rayvl.sweeps.spaces import trial_config

    job = _job("open_clip_options").COMPARISON
    parse = job.parser().parse_args
    comparison, overrides = job.configured(parse(["--variants", "vit,vit_patch_dropout", "--data", "s3://b/t/",
                                                  "--eval-data", "s3://b/e/", "--set", "train.lr=0.01",
                                                  "--set", "model.vision=vit_small_patch16_224"]))
    grid = comparison.sweep(overrides, seeds=1)
    arms = {n: trial_config(grid.recipe, grid.fixed, {}, v).model for n, v in grid.variants.items()}
    assert {n: (m.vision, m.patch_dropout) for n, m in arms.items()} == {
        "vit": ("vit_small_patch16_224", 0.0), "vit_patch_dropout": ("vit_small_patch16_224", 0.5)}
    comparison, overrides = job.configured(parse(["--variants", "clip,siglip", "--set", "loss.kind=siglip"]))
    with pytest.raises(SweepError, match=r"--set loss\.kind: variants 'clip' and 'siglip' would be the same"):
        comparison.sweep(overrides, seeds=1)


# the jobs whose table has rows training reports only when it evaluates on held-out shards (data.eval)
EVALUATED_ROWS = {"tonics_align": "t2i_R@1", "bow_pretrain": "zeroshot_top1", "paraphrase_strategies": "zeroshot_top1",
                  "pseudo_label": "zeroshot_top1", "open_clip_options": "zeroshot_top1"}
# what a job's command line needs besides the defaults for its variants to name their data
ARGUMENTS = {"unicl_coverage": ["--covered", "s3://b/with/", "--uncovered", "s3://b/without/"]}


@pytest.mark.parametrize("job", ["tonics_align", "unicl", "unicl_coverage", "bow_pretrain", "paraphrase_strategies",
                                 "pseudo_label", "open_clip_options"])
def test_every_comparison_job_validates_on_the_demo_and_on_real_data(job, demo_dir, tmp_path):
    """Each job's variants × 3 seeds, with its demo budget and defaults (the session's small demo) and with real
    data, checked against the config tree (the whole grid builds before Ray starts); the after hook and the rows'
    metrics are names a trial can report. With training shards but no held-out ones, a job whose rows are
    evaluation metrics is refused naming the metric and data.eval (its table would be all "-"); the others' rows
    come from their after hook and need none."""
    import importlib

    from rayvl.config import ConfigError

    c = _job(job).COMPARISON
    parser = c.parser()
    sets = [f"data.demo_dir={demo_dir}", "data.demo_samples=384", "data.demo_eval_samples=64",
            f"train.storage_path={tmp_path}"]
    args = parser.parse_args(ARGUMENTS.get(job, []) + ["--name", "t", *(x for s in sets for x in ("--set", s))])
    c = c.bind(args)  # the data paths the variants name, from the job's options
    assert not any("{" in o for overrides in c.variants.values() for o in overrides)
    if job == "unicl_coverage":
        with pytest.raises(ConfigError, match="--data"):  # the arms' pairs are --covered / --uncovered
            c.bind(parser.parse_args(ARGUMENTS[job] + ["--data", "s3://b/shards/"]))
    shards = ["data.train=s3://bucket/shards/{00000..00009}.tar"]
    for demo, overrides in ((True, c.demo + c.defaults(args)),
                            (False, shards + ["data.eval=s3://bucket/held-out/00000.tar"])):
        sweep = c.chosen("", demo).sweep(overrides, seeds=3)
        assert sweep.space == {"train.seed": {"grid": [0, 1, 2]}} and len(sweep.variants) >= 2
        assert list(sweep.variants) == list(c.demo_variants or c.variants) if demo else list(c.variants)
    if job in EVALUATED_ROWS:
        with pytest.raises(SweepError, match=rf"row '.*': '{EVALUATED_ROWS[job]}' is an evaluation metric, but "
                                             rf"data\.train is given without data\.eval( \(variant \w+\))?: "):
            c.chosen("", False).sweep(shards, seeds=3)
    else:
        c.chosen("", False).sweep(shards, seeds=3)  # its rows come from its after hook
    if c.after:
        module_name, function = c.after.split(":")
        assert callable(getattr(importlib.import_module(module_name), function))
        assert set(c.after_metrics) <= {key for _, key, _ in c.rows}
