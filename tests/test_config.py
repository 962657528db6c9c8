"""Config errors are caught before Ray starts and name the full key."""
import dataclasses
import subprocess
import sys

import pytest

from conftest import REPO
from rayvl.config import ConfigError, load_config, parse_override, with_overrides

RECIPE = REPO / "configs" / "laion_adapt.yaml"


@pytest.mark.parametrize("override, key", [
    ("train.zero_stagee=3", "train.zero_stagee"),
    ("model.vision_tower=x", "model.vision_tower"),
    ("nosuchsection.x=1", "nosuchsection"),
    ("train.zero_stage=4", "train.zero_stage"),
    ("train.zero_stage=two", "train.zero_stage"),
    ("train.precision=fp16", "train.precision"),
    ("train.precision=fp8", "train.precision"),
    ("model.text_strategy=adapter", "model.text_strategy"),
    ("train.lr=-1", "train.lr"),
    ("train.betas=[0.9]", "train.betas"),
    ("train.use_gpu=yes please", "train.use_gpu"),
    ("eval.tasks=[zeroshot, nope]", "eval.tasks[1]"),
    ("train.warmup_steps=500", "train.warmup_steps"),
    ("data.read_cpus=0", "data.read_cpus"),
    ("train.stop_at_step=500", "train.stop_at_step"),
    ("model.init_logit_bias=-10", "model.init_logit_bias"),  # a bias with a softmax loss
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, [override])
    assert str(err.value).startswith(key), str(err.value)


def test_siglip_gets_the_papers_init_unless_set_and_refuses_what_it_cannot_take():
    """loss.kind=siglip: t = 10 and b = −10 (Zhai et al. 2023 §3) where nothing sets them, a recipe's or --set's
    value where one does; the memory bank's InfoNCE and UniCL's image-label targets are refused before Ray starts."""
    m = load_config(RECIPE, ["loss.kind=siglip"]).model
    assert (m.init_logit_scale, m.init_logit_bias) == (10.0, -10.0)
    m = load_config(RECIPE, ["loss.kind=siglip", "model.init_logit_bias=-5", "model.init_logit_scale=20"]).model
    assert (m.init_logit_scale, m.init_logit_bias) == (20.0, -5.0)
    assert load_config(RECIPE).model.init_logit_bias is None
    with pytest.raises(ConfigError, match="^memory_bank.size: .*SigLIP"):
        load_config(RECIPE, ["loss.kind=siglip", "memory_bank.size=64"])
    with pytest.raises(ConfigError, match="^loss.kind: siglip does not take"):
        load_config(RECIPE, ["loss.kind=siglip", "image_label.data=fashion-mnist"])


def test_numbers_as_users_write_them_and_files_that_are_not_there(tmp_path):
    """YAML 1.1 reads ``1e-3`` as a string; rayvl's loader reads it as the number a user means — in --set and in a
    recipe. A broken value or a missing recipe is a ConfigError naming it, not a parser traceback."""
    assert load_config(RECIPE, ["train.lr=1e-3", "train.eps=1E-8"]).train.lr == 0.001
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 5e-4\n  betas: [0.9, 9.8e-1]\ndata:\n  train: 1e3\n")
    with pytest.raises(ConfigError, match="data.train: expected a string, got 1000.0"):
        load_config(recipe)  # a number where a path belongs is still refused, by its key
    recipe.write_text("train:\n  lr: 5e-4\n  betas: [0.9, 9.8e-1]\n")
    cfg = load_config(recipe)
    assert cfg.train.lr == 5e-4 and cfg.train.betas == (0.9, 0.98)
    assert parse_override("data.train=s3://b/{00000..00009}.tar") == {"data": {"train": "s3://b/{00000..00009}.tar"}}
    with pytest.raises(ConfigError, match=r"^train.betas \(override 'train.betas=\[0.9'\): not valid YAML"):
        load_config(RECIPE, ["train.betas=[0.9"])
    with pytest.raises(ConfigError, match="^--config: cannot read .*nothing.yaml"):
        load_config(tmp_path / "nothing.yaml")
    from rayvl.sweeps.spaces import load_sweep

    space = tmp_path / "space.yaml"
    space.write_text(f"recipe: {RECIPE}\nmetric: loss\nmode: min\nspace:\n  train.lr: {{loguniform: [1e-4, 1e-2]}}\n")
    assert load_sweep(space).space == {"train.lr": {"loguniform": [1e-4, 1e-2]}}
    recipe.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"r.yaml: not valid YAML \(line 2"):
        load_config(recipe)


def test_a_mixed_batch_keeps_an_image_text_row():
    """round(weight × B) image-label rows: 0.95 of 8 would take all 8 and leave the text stream a batch of 0."""
    mixed = ["image_label.data=fashion-mnist", "train.micro_batch_size=8"]
    with pytest.raises(ConfigError, match=r"^image_label.weight: 0.95 of train.micro_batch_size=8 leaves no"):
        load_config(RECIPE, mixed + ["image_label.weight=0.95"])
    assert load_config(RECIPE, mixed + ["image_label.weight=0.875"]).image_label.weight == 0.875


def test_the_demo_size_check_applies_to_the_demo_only():
    """LAION batch sizes with real shards pass; the embedded demo still refuses a batch it cannot fill."""
    laion = ["train.num_workers=40", "train.micro_batch_size=819"]
    assert load_config(RECIPE, laion + ["data.train=s3://b/{00000..41407}.tar"]).train.num_workers == 40
    with pytest.raises(ConfigError, match="^data.demo_samples: 4000 cannot fill one global batch"):
        load_config(RECIPE, laion)


def test_recipe_and_overrides_compose():
    cfg = load_config(RECIPE, ["train.zero_stage=3", "model.alignment_layers=4", "train.betas=[0.9, 0.95]"])
    assert cfg.train.zero_stage == 3 and cfg.model.alignment_layers == 4
    assert cfg.model.text_strategy == "frozen_alignment"  # from the recipe
    assert cfg.train.betas == (0.9, 0.95)
    assert isinstance(cfg.train.lr, float)


def test_half_precisions_by_device():
    assert load_config(RECIPE, ["train.use_gpu=true", "train.precision=fp16"]).train.precision == "fp16"
    assert load_config(RECIPE, ["train.precision=bf16"]).train.precision == "bf16"  # DeepSpeed's CPU accelerator


def test_parse_override_types():
    assert parse_override("a.b=3") == {"a": {"b": 3}}
    assert parse_override("a=true") == {"a": True}
    assert parse_override("a.b=s3://bucket/x.tar") == {"a": {"b": "s3://bucket/x.tar"}}
    with pytest.raises(ConfigError):
        parse_override("novalue")


def test_job_rejects_bad_key_before_starting_ray(tmp_path):
    """The job exits 2 with the key's name, without starting Ray (no session directory is created)."""
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "laion_adapt.py"), "--set", "train.zero_stag=1",
                        "--set", f"train.storage_path={tmp_path}"],
                       capture_output=True, text=True, timeout=120, env={"RAY_TMPDIR": str(tmp_path / "ray"),
                                                                          "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("rayvl: error: train.zero_stag"), r.stderr
    assert not (tmp_path / "ray").exists()


@pytest.mark.slow
def test_job_refuses_to_starve_ray_data_on_a_local_ray(demo_dir, tmp_path):
    """On a Ray it starts itself (fixed size: local_num_cpus), reserving every CPU for training is refused, naming
    the keys, before that Ray starts (its session folder, under RAY_TMPDIR, is never made)."""
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "laion_adapt.py"), "--data", str(demo_dir / "train"),
                        "--set", "local_num_cpus=2", "--set", "train.cpus_per_worker=1",
                        "--set", f"train.storage_path={tmp_path}"],
                       capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin",
                                                                          "HOME": str(tmp_path),
                                                                          "RAY_TMPDIR": str(tmp_path / "ray")})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "train.cpus_per_worker" in r.stderr and "data.read_cpus" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("rayvl: error: "), r.stderr
    assert not (tmp_path / "ray").exists()


@pytest.mark.parametrize("nodes, strategy, worker_cpus, read_cpus, label, ok", [
    ([2.0], "PACK", 0.45, 0.5, False, True),            # the 2-core default: 0.9 for workers, 1.1 left
    ([2.0], "PACK", 0.45, 0.5, True, True),             # + the image-label stream: two read tasks of 0.5
    ([2.0], "PACK", 0.8, 0.5, True, False),             # 0.4 left: the second pipeline could never run
    ([0.0, 2.0, 2.0], "STRICT_SPREAD", 1.5, 0.5, False, True),   # 0.5 free on each worker node
    ([0.0, 2.0, 2.0], "STRICT_SPREAD", 1.5, 1.0, False, False),  # a 1-CPU read task fits no node
    ([0.0, 2.0], "STRICT_SPREAD", 1.0, 0.5, False, False),       # two workers, one node
    ([0.0, 4.0, 1.0], "PACK", 1.0, 1.0, False, True),   # both workers on the 4-CPU node, 2 left there
])
def test_preflight_places_workers_then_ray_data_per_node(nodes, strategy, worker_cpus, read_cpus, label, ok):
    """The resource check places the workers on the nodes as the strategy does and then asks for one read task of
    data.read_cpus per concurrent pipeline in what is left, per node (a cluster-wide sum would pass the 4th and
    5th cases alike); an impossible plan is an error naming the keys, before Ray starts anything."""
    from rayvl.session import check_resources
    overrides = [f"train.placement_strategy={strategy}", f"train.cpus_per_worker={worker_cpus}",
                 f"data.read_cpus={read_cpus}"]
    if label:
        overrides += ["image_label.data=fashion_mnist", "image_label.weight=0.5"]
    cfg = load_config(RECIPE, overrides)
    if ok:
        check_resources(cfg, fixed_size=True, node_cpus=nodes)
        return
    with pytest.raises(ConfigError) as err:
        check_resources(cfg, fixed_size=True, node_cpus=nodes)
    assert "train.cpus_per_worker" in str(err.value) and "train.num_workers" in str(err.value)


def test_a_vit_gets_the_image_size_it_was_built_for():
    """A timm ViT's patch embedding takes one image size: another data.image_size is refused before Ray starts,
    naming the key and the size to set (instead of failing at the first forward in every worker)."""
    from rayvl.train.datasets import check_inputs

    with pytest.raises(ConfigError, match=r"data.image_size: 64 px, but model.vision='vit_base_patch32_224' takes "
                                          r"224×224 px images: set data.image_size=224"):
        check_inputs(load_config(RECIPE, ["model.vision=vit_base_patch32_224"]), "", "")
    check_inputs(load_config(RECIPE, ["model.vision=vit_base_patch32_224", "data.image_size=224"]), "", "")
    check_inputs(load_config(RECIPE, ["model.vision=resnet18"]), "", "")  # a CNN takes any size


def test_the_learning_rate_schedules_are_open_clips_step_for_step():
    """train.lr_schedule cosine / constant / constant_cooldown against open_clip's cosine_lr, const_lr and
    const_lr_cooldown written out here in float64 (open_clip_train/scheduler.py: warm-up base·(step+1)/warmup; cosine
    0.5·(1 + cos(π·e/es))·base; cooldown (1 − e/es)^power·(base − end) + end over the last steps); a cooldown needs its
    schedule and room after the warm-up, and a budget in passes resolves to steps in the plan."""
    import math

    from rayvl.train.engine import schedule

    base, warmup, total = 2e-3, 5, 40

    def theirs(kind, step, cooldown=0, power=1.0, end=0.0):
        if step < warmup:
            return base * (step + 1) / warmup
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) * base
        if kind == "constant" or step < total - cooldown:
            return base
        return (1 - (step - (total - cooldown)) / cooldown) ** power * (base - end) + end

    for kind, extra in (("cosine", {}), ("constant", {}),
                        ("constant_cooldown", {"cooldown": 12, "power": 2.0, "end": 1e-4})):
        sets = [f"train.lr={base}", f"train.warmup_steps={warmup}", f"train.max_steps={total}",
                f"train.lr_schedule={kind}"]
        if extra:
            sets += ["train.cooldown_steps=12", "train.cooldown_power=2", "train.cooldown_end_lr=1e-4"]
        f = schedule(load_config(None, sets).train)
        assert [base * f(s) for s in range(total)] == pytest.approx([theirs(kind, s, **extra) for s in range(total)],
                                                                   rel=1e-12, abs=1e-15), kind
    for sets, key in ((["train.cooldown_steps=3"], "train.cooldown_steps"),
                      (["train.lr_schedule=constant_cooldown", "train.cooldown_steps=500"], "train.cooldown_steps"),
                      (["train.lr_schedule=constant_cooldown", "train.cooldown_steps=5", "train.cooldown_end_lr=1"],
                       "train.cooldown_end_lr"),
                      (["train.max_passes=-1"], "train.max_passes")):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            load_config(None, sets)
    # a budget in passes: the step-bound settings wait for the steps the plan resolves, and are checked there
    budget = load_config(None, ["train.max_passes=1", "train.warmup_steps=500", "train.stop_at_step=300",
                                "train.lr_schedule=constant_cooldown", "train.cooldown_steps=0"])
    from rayvl.train.run_plan import steps_for_passes

    with pytest.raises(ConfigError, match=r"^train.cooldown_steps: .* \(train.max_steps=63: train.max_passes=1 of "
                                          r"4,000 samples\)"):
        steps_for_passes(budget, (), 4000)
    with pytest.raises(ConfigError, match=r"^train.stop_at_step: .* \(train.max_steps=63"):
        steps_for_passes(with_overrides(budget, ["train.cooldown_steps=10", "train.warmup_steps=5"]), (), 4000)
    with pytest.raises(ConfigError, match="^train.max_passes: how many samples a pass holds is unknown"):
        steps_for_passes(budget, (), None)
    fits = with_overrides(budget, ["train.warmup_steps=5", "train.stop_at_step=0", "train.cooldown_steps=10"])
    assert steps_for_passes(fits, (), 4000).train.max_steps == 63  # ⌈4,000 / (2 workers × 32)⌉


def test_a_resume_whose_passes_resolve_to_other_steps_says_so(tmp_path):
    """A run with a budget in passes resumed at another batch size: its passes are other steps; the error names
    train.max_passes, both step counts and the way out, before Ray starts."""
    import json

    from rayvl.train.run_plan import plan_run

    sets = ["train.max_passes=1", "train.warmup_steps=5", f"train.storage_path={tmp_path}", "train.run_name=r"]
    started = plan_run(load_config(None, sets), dry=True).cfg
    checkpoint = tmp_path / "r" / "checkpoint_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rayvl.json").write_text(json.dumps({"step": 10, "config": started.to_dict(), "final": False}))
    assert plan_run(load_config(None, sets + ["train.resume=true"]), dry=True).cfg.train.max_steps == 63
    with pytest.raises(ConfigError, match=r"^train.max_passes: 1 is 125 steps here, the run started with 63 "
                                          r".*--init-from"):
        plan_run(load_config(None, sets + ["train.resume=true", "train.micro_batch_size=16"]), dry=True)


def test_config_show_prints_each_key_under_its_meaning_and_is_itself_a_recipe(tmp_path, capsys):
    """`rayvl config show` (the options of `rayvl train`): YAML with every key's docstring above it, which read back
    as a recipe is the same config; the Python API takes configs as the command line does and refuses before Ray."""
    import rayvl
    from conftest import cli

    code, out, err = cli(capsys, "config", "show", "--config", "tonics", "--set", "train.lr=0.002",
                         "--set", "model.text_strategy=frozen")
    assert code == 0, err
    (tmp_path / "shown.yaml").write_text(out)
    wanted = load_config("tonics", ["train.lr=0.002", "model.text_strategy=frozen"]).to_dict()
    assert load_config(tmp_path / "shown.yaml").to_dict() == wanted
    lines = out.splitlines()
    leaves = [i for i, line in enumerate(lines) if not line.lstrip().startswith("#") and not line.endswith(":")]
    assert len(leaves) > 150 and all(lines[i - 1].lstrip().startswith("#") for i in leaves)
    assert "  # optimizer steps in total (replaced by max_passes when that is set).\n  max_steps: " in out
    assert callable(rayvl.train)
    with pytest.raises(ConfigError, match="^train.warmup_steps: "):
        rayvl.train("laion_adapt", ["train.max_steps=5"])  # warm-up 20 ≥ 5: refused before Ray starts
    with pytest.raises(ConfigError, match="^model.embed_dim: "):
        rayvl.train(load_config(None, []), ["model.embed_dim=0"])
    # a config built by hand is checked as a recipe is, with no override too: it reaches the workers as it is
    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match="^model.embed_dim: "):
        rayvl.train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, embed_dim=0)))


def test_init_from_a_checkpoint_written_before_a_model_key_existed(tmp_path):
    """A checkpoint whose config predates keys added since (model.clip's MLP widths, a model key) is the same model:
    train.init_from takes it; a real difference is still refused naming the key."""
    import json

    from rayvl.train.run_plan import check_init_from

    old = load_config(None, []).to_dict()
    for key in ("vision_mlp", "text_mlp"):
        del old["model"]["clip"][key]
    del old["model"]["pooling"]
    checkpoint = tmp_path / "old" / "checkpoint_000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rayvl.json").write_text(json.dumps({"step": 3, "config": old, "final": True}))
    assert check_init_from(load_config(None, [f"train.init_from={checkpoint}"])).endswith("checkpoint_000003")
    with pytest.raises(ConfigError, match=r"^model.embed_dim: 64 differs from 256 in train.init_from"):
        check_init_from(load_config(None, [f"train.init_from={checkpoint}", "model.embed_dim=64"]))


def test_relative_paths_are_made_absolute_against_the_commands_working_directory(tmp_path, monkeypatch):
    """Ray Train's workers and Tune's trials run in folders of their own, where a relative path names nothing: the
    config holds each relative local path under the command's working directory — every part of a shard spec, a
    file, a path with a folder in it where a field takes a name too — and leaves URLs, pipe: commands, ~ paths and
    bare names (even where a folder of that name exists)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "minilm-l6").mkdir()  # a folder named as the asset: the bare word stays the asset's name
    cfg = load_config(str(REPO / "configs" / "laion_adapt.yaml"), [
        "data.train=shards/{00000..00003}.tar,/abs/a.tar::s3://b/c.tar,more/*.tar",
        "data.eval=pipe:cat held,out.tar", "data.classes=classes.json", "data.sts=~/sts.tsv",
        "model.text=minilm-l6", "train.init_from=runs/old", "train.storage_path=runs",
        "pseudo_label.out=labels", "pseudo_label.checkpoint=latest", "image_label.data=wds/{0..3}.tar"])
    here = str(tmp_path)
    assert cfg.data.train == f"{here}/shards/{{00000..00003}}.tar,/abs/a.tar::s3://b/c.tar,{here}/more/*.tar"
    assert (cfg.data.eval, cfg.data.classes, cfg.data.sts) == ("pipe:cat held,out.tar", f"{here}/classes.json",
                                                                "~/sts.tsv")
    assert (cfg.model.text, cfg.train.init_from, cfg.train.storage_path) == ("minilm-l6", f"{here}/runs/old",
                                                                             f"{here}/runs")
    assert (cfg.pseudo_label.out, cfg.pseudo_label.checkpoint) == (f"{here}/labels", "latest")
    assert cfg.tune.storage_path == "~/rayvl-sweeps" and cfg.data.demo_dir == "~/.cache/rayvl/demo"
    assert cfg.image_label.data == f"{here}/wds/{{0..3}}.tar"
    assert load_config(None, ["image_label.data=fashion-mnist"]).image_label.data == "fashion-mnist"
    # a text model's folder here is written ./name (the bare word is refused before Ray starts, saying so)
    from rayvl.assets import MissingAssetError, text_model_path

    (tmp_path / "mytext").mkdir()
    assert load_config(None, ["model.text=./mytext"]).model.text == f"{here}/mytext"
    with pytest.raises(MissingAssetError, match=r"^model\.text: 'mytext' is not a rayvl asset .* written ./mytext"):
        text_model_path(load_config(None, ["model.text=mytext"]).model.text)
    assert load_config(None, ["train.init_from=runs/a,b"]).train.init_from == f"{here}/runs/a,b"
    elsewhere = load_config(None, ["data.classes=classes.json"], cwd="/where/the/sweep/ran")
    assert elsewhere.data.classes == "/where/the/sweep/ran/classes.json"
