"""Sweeps: search spaces checked against the config tree before Ray starts; `cluster.yaml` against Ray's schema and
rayvl's security rule. (The real ASHA sweep runs on a simulated multi-node cluster, in test_multinode.py.)"""

import os
import time

import pytest
import yaml

from conftest import REPO
from rayvl.sweeps.spaces import SweepError, load_sweep

SPACES = sorted((REPO / "tune_spaces").glob("*.yaml"))


def test_the_shipped_spaces_load_and_cover_the_three_questions():
    assert {p.stem for p in SPACES} == {"memory_bank", "alignment_depth", "curriculum"}
    keys = {p.stem: set(load_sweep(p).space) for p in SPACES}
    assert keys["memory_bank"] == {"memory_bank.size", "memory_bank.momentum"}
    assert keys["alignment_depth"] == {"model.alignment_layers"}
    assert keys["curriculum"] == {"tonics.alpha", "tonics.beta", "tonics.threshold"}


@pytest.mark.parametrize("recipe, space, extra, match", [
    ("laion_adapt", {"model.alignment_layer": {"grid": [1, 2]}}, {}, r"space\.model\.alignment_layer: .*unknown key"),
    ("laion_adapt", {"memory_bank.size": {"grid": [0, -5]}}, {}, r"space\.memory_bank\.size: .*must be ≥ 0"),
    ("tonics", {"tonics.alpha": {"uniform": [0.5, 1.5]}}, {}, r"space\.tonics\.alpha: tonics\.alpha=1\.5"),
    ("tonics", {"tonics.beta": {"choice": [0.2, 1.2]}}, {}, r"space\.tonics\.beta: tonics\.beta=1\.2"),
    ("laion_adapt", {"train.lr": {"normal": [0, 1]}}, {}, r"space\.train\.lr: expected one of"),
    ("laion_adapt", {"train.max_steps": {"choice": ["many"]}}, {}, r"train\.max_steps: expected an integer"),
    ("laion_adapt", {"train.lr": {"loguniform": [0, 1]}}, {}, r"loguniform needs low > 0"),
    ("laion_adapt", {"train.lr": {"grid": [1e-3]}}, {"spaces": {}}, r"unknown key 'spaces'"),
    ("laion_adapt", {"train.lr": {"grid": [1e-3]}}, {"metric": "t2i_R@3"}, r"metric: 't2i_R@3' is not reported"),
    ("laion_adapt", {"train.lr": {"grid": [1e-3]}}, {"scheduler": {"kind": "asha"}}, r"set eval\.every_steps"),
])
def test_bad_space_is_an_error_naming_file_and_key(tmp_path, recipe, space, extra, match):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"recipe": str(REPO / "configs" / f"{recipe}.yaml"), "metric": "t2i_R@1",
                                    "space": space, **extra}))
    with pytest.raises(SweepError, match=match) as e:
        load_sweep(path)
    assert str(path) in str(e.value)


def test_a_bad_value_on_the_command_line_is_the_command_lines_error(tmp_path):
    """A --set's own mistake is named as the command line's, before the space file's values meet it — a value no
    registered loss kind has too (loss.kind's values are the core's and the methods')."""
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "t2i_R@1",
                                    "space": {"train.lr": {"grid": [1e-3]}}}))
    with pytest.raises(SweepError, match=r"^--set loss\.kind: 'nope' is not one of \['clip', 'siglip', 'unicl', "
                                         r"'ce'\]"):
        load_sweep(path, ["loss.kind=nope"])
    with pytest.raises(SweepError, match=r"^--set train\.lr: expected a number"):
        load_sweep(path, ["train.lr=fast"])


def test_grid_combinations_are_checked_together(tmp_path):
    """Each value is fine alone; together they are impossible (ZeRO-3 partitions what the bank needs)."""
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "loss",
                                    "space": {"memory_bank.size": {"grid": [0, 64]},
                                              "train.zero_stage": {"grid": [2, 3]}}}))
    with pytest.raises(SweepError, match=r"memory_bank\.size=64, train\.zero_stage=3"):
        load_sweep(path)


def test_cli_rejects_a_bad_space_before_ray_starts(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "t2i_R@1",
                                    "space": {"memory_bank.size": {"grid": [-1]}}}))
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "sweep.py"), str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "memory_bank.size" in r.stderr and "Started a local Ray" not in r.stderr


def test_an_evaluation_metric_without_held_out_shards_is_refused_before_ray_starts(tmp_path, capsys):
    """data.train without data.eval switches training's evaluation off (datasets.evaluation_or_off): a sweep ranked
    by t2i_R@1 would never give Tune a result. Refused naming the metric and data.eval — for the recipe's data and
    for a variant's own; accepted with held-out shards, on the demo (its own held-out split), or for the loss."""
    import ray

    from rayvl.cli import main

    space = REPO / "tune_spaces" / "alignment_depth.yaml"
    shards, held_out = "data.train=s3://bucket/laion/{00000..00009}.tar", "data.eval=s3://bucket/coco/00000.tar"
    missing = r"metric: 't2i_R@1' is an evaluation metric, but data\.train is given without data\.eval"
    with pytest.raises(SweepError, match=rf"alignment_depth\.yaml: {missing}: .*--set data\.eval=SHARDS"):
        load_sweep(space, [shards])
    assert load_sweep(space, [shards, held_out, "eval.every_steps=100"]).metric == "t2i_R@1"
    assert not load_sweep(space).base_config().data.train  # the demo
    path = tmp_path / "space.yaml"
    variants = {"with": {"data.train": "s3://b/a/", "data.eval": "s3://b/e/"}, "without": {"data.train": "s3://b/c/"}}
    raw = {"recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "t2i_R@1", "variants": variants,
           "space": {}, "set": {"eval.tasks": ["retrieval"]}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SweepError, match=rf"{missing} \(variant without\)"):
        load_sweep(path)
    path.write_text(yaml.safe_dump({**raw, "metric": "loss"}))  # every report carries it: evaluation may be off
    assert set(load_sweep(path).variants) == {"with", "without"}

    was_running = ray.is_initialized()
    capsys.readouterr()
    assert main(["tune", str(space), "--set", shards]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayvl: error: ") and "'t2i_R@1' is an evaluation metric" in err and "data.eval" in err
    assert "Traceback" not in err and ray.is_initialized() == was_running  # no Ray was started


def test_cluster_yaml_passes_rays_schema_and_keeps_the_dashboard_private(tmp_path):
    """... and installs what `make install GPU=1` installs, on a current host: the pinned Ray's image for the CUDA of
    torch's build (constraints-cuda.txt), that build from PyTorch's index under that file, faiss-gpu-cu12, one host
    AMI for every node type and never `latest_dlami` (an Ubuntu 18.04 AMI in Ray 2.60); the Debian assets (apt) only
    when FETCH_DEBIAN_ASSETS=1 — the setup line is run in bash with `sudo` and `rayvl` faked, both ways."""
    import subprocess

    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config
    from test_install import cuda_label

    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    config = prepare_config(raw)
    validate_config(config)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["CPU"] == 0  # the head trains nothing
    gpu = [t for name, t in types.items() if "gpu" in name]
    assert gpu and all(t["min_workers"] == 0 for t in gpu)  # GPU workers come and go with demand
    assert config["docker"]["image"] == f"rayproject/ray:{ray.__version__}-py311-{cuda_label()}"
    hosts = {t["node_config"]["ImageId"] for t in types.values()}
    assert len(hosts) == 1 and hosts.pop().startswith("ami-")
    starts = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in starts and "0.0.0.0" not in starts
    # every worker type reads S3 with its own role (Ray gives its role to the head only)
    assert all("IamInstanceProfile" in t["node_config"] for name, t in types.items() if name != "head")
    # the working tree goes to every node without .venv/ and the rest .gitignore leaves out, and without .git
    assert config["rsync_filter"] == [".gitignore"] and "**/.git" in config["rsync_exclude"]
    ports = [(p["FromPort"], p["ToPort"]) for p in raw["provider"]["security_group"]["IpPermissions"]]
    assert ports == [(22, 22)]  # SSH is the only way in
    setup = config["setup_commands"]
    pips = [c for c in setup if "pip install" in c]
    assert all(c.startswith("PIP_CONSTRAINT=/home/ray/rayvl/constraints-cuda.txt pip install") for c in pips)
    assert f"--index-url https://download.pytorch.org/whl/{cuda_label()} torch==2.13.0 torchvision==0.28.0" in pips[0]
    assert pips[1].endswith('-e "/home/ray/rayvl[gpu]"') and len(pips) == 2
    (assets_line,) = [c for c in setup if "apt" in c or "assets" in c]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sudo", "rayvl"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho {name} "$@" >> {tmp_path}/ran\n')
        (bin_dir / name).chmod(0o755)
    for line, ran in ((assets_line, ""), (assets_line.replace("FETCH_DEBIAN_ASSETS=0", "FETCH_DEBIAN_ASSETS=1"),
                                          "sudo apt-get update -qq\nrayvl assets fetch\nrayvl assets check\n")):
        (tmp_path / "ran").write_text("")
        subprocess.run(["bash", "-c", line], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, check=True)
        assert (tmp_path / "ran").read_text() == ran


def test_the_docs_cluster_sweep_fits_cluster_yaml(monkeypatch):
    """The docs' cluster sweep against cluster.yaml, on paper: its overrides win over the space file (whose `demo`
    budget is the embedded demo's only), ASHA's first rung is its first evaluation, its trial drivers need only the
    head's `on_demand` (the head has no CPUs and no worker type declares it), and the cluster at its largest holds
    8 such trials at once (8 GPUs each; 16 g5.12xlarge of 4 GPUs, resources as `ray up` fills them in) — without
    its GPU type, the sweep is refused before any trial starts. The same command runs on a fake cloud in
    test_autoscaling.py."""
    from test_autoscaling import cluster_command

    from rayvl import session
    from rayvl.sweeps.capacity import trials_at_once
    from rayvl.sweeps.spaces import grace_period

    command = cluster_command("jobs/sweep.py")
    job = command[command.index("--") + 1:]  # python jobs/sweep.py SPACE --set ...
    sweep = load_sweep(REPO / job[2], [job[i + 1] for i, a in enumerate(job) if a == "--set"])
    cfg = sweep.base_config()
    t = cfg.train
    assert (t.max_steps, t.checkpoint_every, t.warmup_steps, t.micro_batch_size, t.cpus_per_worker, t.precision,
            cfg.data.image_size) == (20000, 2000, 2000, 256, 0.5, "bf16", 224)
    assert load_sweep(REPO / job[2]).base_config().train.checkpoint_every == 10  # the demo's budget, on the demo
    assert grace_period(sweep.scheduler, cfg) == 2000
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    types = config["available_node_types"]
    head = types[config["head_node_type"]]["resources"]
    assert cfg.tune.driver_bundle() == {"on_demand": 1.0} and head["on_demand"] >= 1 and head["CPU"] == 0
    assert not any("on_demand" in (t["resources"] or {}) for t in types.values() if t["resources"] is not head)
    types["gpu_worker"]["resources"], types["cpu_worker"]["resources"] = {"CPU": 48, "GPU": 4}, {"CPU": 32}
    monkeypatch.setattr(session, "largest_nodes", lambda: (session.grown_nodes(config, head),
                                                          session.grown_resources(config, head), True))
    assert trials_at_once(sweep, cfg, fixed_size=False) == 8
    del types["gpu_worker"]
    with pytest.raises(SweepError, match=r"8 × \{CPU 0.5, GPU 1\} for its Train workers .* can grow to: "
                                         r"\{CPU 256, on_demand 1000\}"):
        trials_at_once(sweep, cfg, fixed_size=False)


def test_local_storage_on_several_nodes_is_refused_naming_the_key():
    from rayvl.config import ConfigError, load_config
    from rayvl.session import check_storage

    cfg = load_config(None, ["train.storage_path=/tmp/runs"])
    check_storage(cfg, nodes=1)
    with pytest.raises(ConfigError, match=r"train\.storage_path: '/tmp/runs' is on this machine's disk, but the cluster has 3"):
        check_storage(cfg, nodes=3)
    with pytest.raises(ConfigError, match=r"train\.storage_path: 'file:///tmp/runs'"):  # a URL, still one disk
        check_storage(load_config(None, ["train.storage_path=file:///tmp/runs"]), nodes=3)
    check_storage(load_config(None, ["train.storage_path=s3://bucket/runs", "tune.storage_path=gs://b/s"]), nodes=3)
    check_storage(load_config(None, ["train.shared_storage=true"]), nodes=3)  # a mount every node shares
    # each command checks the storage it writes: a training run its train.storage_path (the README's cluster command
    # sets only that one), a sweep its tune.storage_path (its trials' runs go under it)
    run = load_config(None, ["train.storage_path=s3://bucket/runs"])  # tune.storage_path left local
    check_storage(run, nodes=3)
    with pytest.raises(ConfigError, match=r"^tune\.storage_path: '~/rayvl-sweeps' is on this machine's disk"):
        check_storage(run, nodes=3, key="tune.storage_path")
    check_storage(load_config(None, ["tune.storage_path=s3://bucket/sweeps"]), nodes=3, key="tune.storage_path")
    # one node now, but an autoscaler that may add workers (cluster.yaml's start from 0): refused before Ray starts
    with pytest.raises(ConfigError, match=r"^train\.storage_path: '/tmp/runs' is on this machine's disk, but the "
                                          r"cluster's autoscaler may add nodes"):
        check_storage(cfg, nodes=1, grows=True)


@pytest.mark.ray
def test_an_interrupted_sweep_resumes_and_a_failing_trial_is_recorded(demo_dir, tmp_path):
    """Two trials side by side: `rayvl tune` stopped with Ctrl-C (SIGINT) after the demo trial's first checkpoint;
    `rayvl tune --resume` continues it: the trial resumes from its checkpoint (its train state records the step),
    the other trial — whose shards hold only undecodable images — fails with the data plane's error, which the
    report shows (its shards given relative to the command's folder), and the sweep still finishes with a best
    config. The two data sets are the space's variants, so the
    sweep is also a comparison: its table names the failed variant. Each command runs in its own process and Ray,
    as a user runs them; the sweep (and every trial's Train run) lives at a file:// URL, so the trial's resume finds its
    checkpoint through the URL code path."""
    import csv
    import json
    import signal
    import subprocess
    import sys

    from rayvl.checkpoints import RAY_TRAIN_SNAPSHOT, latest_checkpoint_dir, read_train_state
    from rayvl.data.demo import write_shard

    broken = tmp_path / "broken"  # 8 samples img2dataset calls successes, none of them a decodable image
    broken.mkdir()
    write_shard(broken, 0, [{"key": f"0000000{i}", "caption": f"a picture number {i}", "status": "success",
                             "jpg": b"\xff\xd8 not a jpeg"} for i in range(8)], time.time())
    space = tmp_path / "resume.yaml"
    space.write_text(yaml.safe_dump({
        "recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "loss", "mode": "min", "name": "resume",
        # the broken shards relative to the commands' folder (tmp_path): a trial, run in a folder of its own, reads
        # them there (its error is theirs, not a path that names nothing)
        "variants": {"demo": {"data.train": str(demo_dir / "train")}, "broken": {"data.train": "broken"}},
        "space": {}, "max_concurrent_trials": 2,
        "set": {"train.max_steps": 6, "train.checkpoint_every": 2, "train.log_every": 2, "eval.tasks": [],
                "train.max_failures": 0, "train.micro_batch_size": 8, "train.num_workers": 1}}))
    sets = [f"data.eval={demo_dir / 'eval'}", "data.image_size=32",
            "data.max_text_tokens=16", "train.warmup_steps=1", "model.alignment_layers=1", "model.embed_dim=64",
            f"tune.storage_path=file://{tmp_path / 'sweeps'}", "local_num_cpus=4",  # a URL: resume reads it
            "train.report_to=[]"]  # the trials' loggers are tested elsewhere (test_training, test_autoscaling)
    command = [sys.executable, "-m", "rayvl.cli", "tune", str(space), *(x for s in sets for x in ("--set", s))]
    runs = tmp_path / "sweeps" / "resume" / "runs"
    # the first command at Ray's 2 s polls (set as a user sets them: rayvl keeps them), which hold each report for the
    # next poll: its trial is still running when the signal comes
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                             env={**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"})
    deadline = time.time() + 300
    while not any((d / RAY_TRAIN_SNAPSHOT).is_file() for d in runs.glob("trial-*")):  # a committed checkpoint
        assert first.poll() is None, f"the sweep ended before its first checkpoint:\n{first.stdout.read()[-3000:]}"
        assert time.time() < deadline, "the sweep never checkpointed"
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=180)
    interrupted = next(d for d in runs.glob("trial-*") if (d / RAY_TRAIN_SNAPSHOT).is_file())

    # the resume at rayvl's own polls (rayvl.session.REPORT_POLL): only its end is checked
    second = subprocess.run(command + ["--resume"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert second.returncode == 0, (out + second.stdout + second.stderr)[-3000:]
    with open(tmp_path / "sweeps" / "resume" / "trials.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert rows["demo"]["status"] == "TERMINATED" and int(rows["demo"]["steps"]) == 6
    progress = read_train_state(latest_checkpoint_dir(interrupted))["progress"]
    assert progress["step"] == 6 and len(progress["resumed_at"]) == 1 and 2 <= progress["resumed_at"][0] < 6
    history = [json.loads(x)["step"] for x in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert history == [2, 4, 6]
    assert rows["broken"]["status"] == "ERROR" and "no full batch" in rows["broken"]["error"]
    assert "no full batch" in second.stdout  # in the printed table too
    best = yaml.safe_load((tmp_path / "sweeps" / "resume" / "best_config.yaml").read_text())
    assert best["data"]["train"] == str(demo_dir / "train")  # the best trial's variant, applied
    # a space with variants is a comparison: the resumed trial wrote its final numbers, the failed one is named
    final = json.loads((interrupted / "final_metrics.json").read_text())
    assert final["variant"] == "demo" and final["metrics"]["samples_kept"] > 0
    assert "== variants: mean ± std" in second.stdout and "failed: broken" in second.stdout


def test_a_budget_in_passes_gives_asha_and_the_report_the_steps_it_resolves_to(tmp_path):
    """train.max_passes=2 on the demo's 4,000 samples at 2 × 32 a step is 125 steps: ASHA's last rung and the
    sweep's recorded budget are those, not the recipe's max_steps (200); a first rung beyond them is refused."""
    from rayvl.sweeps.runner import _scheduler, settings

    path = tmp_path / "space.yaml"
    space = {"recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "loss",
             "space": {"train.lr": {"grid": [1e-3, 3e-3]}}, "scheduler": {"kind": "asha"},
             "set": {"train.max_passes": 2, "train.micro_batch_size": 32}}
    path.write_text(yaml.safe_dump(space))
    sweep = load_sweep(path)
    assert settings(sweep)["max_steps"] == 125 and _scheduler(sweep)._max_t == 125
    path.write_text(yaml.safe_dump({**space, "scheduler": {"kind": "asha", "grace_period": 150}}))
    with pytest.raises(SweepError, match=r"grace_period: must be in \[1, max_t=125\]"):
        load_sweep(path)


def test_asha_stops_trials_at_its_rungs_but_never_at_their_runs_last_step():
    """rayvl.sweeps.asha: ASHA's decisions, except at a run's last step (Tune would end the trial's driver while
    the run ends, its records unwritten); a max_t below the budget still stops there. The multinode ASHA sweep
    reads a finished trial's records."""
    from types import SimpleNamespace

    from rayvl.sweeps.asha import FinishingASHA
    from rayvl.sweeps.trials import LAST_STEP

    def decisions(last_steps: dict, max_t: int) -> list[str]:
        asha = FinishingASHA(time_attr="step", max_t=max_t, grace_period=2, reduction_factor=2, metric="lr",
                             mode="max")
        trials = {name: SimpleNamespace(trial_id=name) for name in last_steps}
        for trial in trials.values():
            asha.on_trial_add(None, trial)
        return [asha.on_trial_result(None, trials[name], {"step": step, "lr": lr, LAST_STEP: last_steps[name]})
                for name, step, lr in (("a", 2, 3e-3), ("b", 2, 1e-3), ("a", 4, 3e-3))]

    # b below the rung's cutoff at step 2; a at its run's end goes on (Ray's ASHA stops it at max_t)
    assert decisions({"a": 4, "b": 4}, 4) == ["CONTINUE", "STOP", "CONTINUE"]
    assert decisions({"a": 6, "b": 6}, 4) == ["CONTINUE", "STOP", "STOP"]  # max_t 4 of 6 steps: stopped, as asked
    # each trial's own end: b ends at step 2 (its own max_steps), so the rung's stop is its end and is not taken
    assert decisions({"a": 6, "b": 2}, 4) == ["CONTINUE", "CONTINUE", "STOP"]


def _space(tmp_path, **raw) -> str:
    """A space file of the laion_adapt recipe ranked by the loss (every report carries it), with ``raw``'s keys."""
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "loss",
                                    "mode": "min", "space": {"train.lr": {"grid": [1e-3, 3e-3]}}, **raw}))
    return str(path)


def test_a_start_stopped_by_a_check_writes_no_settings_and_starts_again(tmp_path, monkeypatch):
    """The settings are written after every check (a check after Ray starts may still fail), and a sweep has begun
    only once Tune saved its state (its tuner.pkl): settings without it, as a failed start of an earlier rayvl left
    them, start afresh on a plain run, and --resume there says nothing was started. No Ray starts here."""
    from rayvl import session
    from rayvl.config import ConfigError
    from rayvl.sweeps import directory
    from rayvl.sweeps.runner import check_start, run_sweep, settings

    sweep = load_sweep(_space(tmp_path), [f"tune.storage_path={tmp_path / 'sweeps'}"])
    sweep_dir = directory.sweep_directory(sweep.base_config(), "space")

    def refused(cfg, nodes=None, key="train.storage_path", grows=False):
        raise ConfigError("tune.storage_path: on this machine's disk, but the cluster has 3 nodes")

    monkeypatch.setattr(session, "connect", lambda *args, **kwargs: False)  # a cluster joined, on paper
    monkeypatch.setattr(session, "check_storage", refused)
    with pytest.raises(ConfigError, match="the cluster has 3 nodes"):
        run_sweep(sweep)
    assert not directory.has_settings(sweep_dir)
    directory.save_settings(sweep_dir, settings(sweep))  # where an earlier rayvl left its failed start
    check_start(sweep, sweep_dir, settings(sweep), resume=False)  # starts afresh
    with pytest.raises(SweepError, match=r"space\.yaml: sweep .* its first start stopped before any trial began, so "
                                         r"nothing was started: drop --resume"):
        check_start(sweep, sweep_dir, settings(sweep), resume=True)
    (tmp_path / "sweeps" / "space" / "tuner.pkl").write_bytes(b"")  # Tune's state: Tuner.can_restore
    assert directory.begun(sweep_dir)
    with pytest.raises(SweepError, match=r"exists: pass --resume to continue it, or --name another"):
        check_start(sweep, sweep_dir, settings(sweep), resume=False)
    check_start(sweep, sweep_dir, settings(sweep), resume=True)
    with pytest.raises(SweepError, match=r"has no state to resume: drop --resume"):
        check_start(sweep, str(tmp_path / "sweeps" / "other"), settings(sweep), resume=True)


def test_a_resume_refuses_a_changed_sweep_naming_what_changed(tmp_path):
    """Tune's saved state keeps the space, the metric, the scheduler, the trials' overrides and variants it
    started with: a resume with others would run the old ones (or fail in Tune after Ray started), so it is refused
    before, naming the change. An older settings file (no space, scheduler or num_samples) is compared on the
    fields it has."""
    from rayvl.sweeps import directory
    from rayvl.sweeps.runner import check_start, settings

    storage = f"tune.storage_path={tmp_path / 'sweeps'}"
    every = "eval.every_steps=10"  # ASHA on another metric than the loss needs evaluations
    started = load_sweep(_space(tmp_path, scheduler={"kind": "asha", "grace_period": 10}), [storage, every])
    sweep_dir = directory.sweep_directory(started.base_config(), "space")
    directory.save_settings(sweep_dir, settings(started))
    (tmp_path / "sweeps" / "space" / "tuner.pkl").write_bytes(b"")

    def resumed(overrides=(), **raw):
        sweep = load_sweep(_space(tmp_path, **{"scheduler": {"kind": "asha", "grace_period": 10}, **raw}),
                           [storage, every, *overrides])
        check_start(sweep, sweep_dir, settings(sweep), resume=True)

    resumed()  # as it started
    for raw, overrides, match in [
            ({"space": {"train.lr": {"grid": [1e-3, 1e-2]}}}, [], r"space \(train\.lr: grid: without 0\.003, with "
                                                                  r"0\.01\)"),
            ({"space": {"train.lr": {"grid": [1e-3, 3e-3]}, "train.warmup_steps": {"grid": [0, 5]}}}, [],
             r"space \(train\.warmup_steps: added\)"),
            ({"metric": "lr", "mode": "max"}, [], r"metric \(\"loss\", now \"lr\"\); mode \(\"min\", now \"max\"\)"),
            ({}, ["train.max_steps=50"], r"fixed \(with \"train\.max_steps=50\"\)"),
            ({"scheduler": {"kind": "asha", "grace_period": 20}}, [], r"scheduler \(grace_period: 10, now 20\)"),
            ({"num_samples": 3}, [], r"num_samples \(1, now 3\)"),
            ({"variants": {"warm": {"train.warmup_steps": 5}}}, [], r"variants \(warm: added\)"),
            ({"max_concurrent_trials": 2}, [], r"max_concurrent_trials \(0, now 2\)")]:
        with pytest.raises(SweepError, match=r"space\.yaml: --resume: sweep .* started with another " + match):
            resumed(overrides, **raw)
    resumed(["ray_address=10.0.0.2:6379", "local_num_cpus=4"])  # where it runs, not what its trials do
    older = {k: v for k, v in settings(started).items()
             if k not in ("space", "scheduler", "num_samples", "max_concurrent_trials")}
    directory.save_settings(sweep_dir, older)
    resumed(num_samples=3)  # not in the file: not compared
    with pytest.raises(SweepError, match=r"started with another keys \(with \"train\.warmup_steps\"\)"):
        resumed(space={"train.lr": {"grid": [1e-3]}, "train.warmup_steps": {"grid": [0, 5]}})
    with pytest.raises(SweepError, match=r"started with another max_t \(0, now 100\)"):
        resumed(scheduler={"kind": "asha", "grace_period": 10, "max_t": 100})


def test_trials_are_placed_on_the_nodes_bundle_by_bundle(monkeypatch):
    """A trial is placed node by node with every resource, as Ray places its driver, its Train workers (by
    train.placement_strategy) and Ray Data's CPU: one 10-CPU worker does not fit two 8-CPU nodes (16 CPUs in all),
    3 STRICT_SPREAD workers do not fit 2 nodes, 4 GPU workers STRICT_PACK do not fit two 2-GPU nodes; a trial that
    fits nowhere is refused whatever max_concurrent_trials says (it would wait for ever). On an autoscaling cluster
    whose max_workers is below its types' sum, the totals bound the count too."""
    from rayvl import session
    from rayvl.config import load_config
    from rayvl.sweeps.capacity import concurrent_trials, trials_at_once
    from rayvl.sweeps.spaces import Sweep

    def trials(nodes, *overrides):
        totals = {k: sum(n.get(k, 0) for n in nodes) for n in nodes for k in n}
        return concurrent_trials(load_config(None, list(overrides)), nodes, totals)

    two = [{"CPU": 8.0}, {"CPU": 8.0}]
    assert trials(two, "train.num_workers=1", "train.cpus_per_worker=10") == 0
    assert trials(two, "train.num_workers=1", "train.cpus_per_worker=6") == 2  # a worker a node, Ray Data beside
    # 2 + 1 + 0.1 CPUs a trial: 2 trials a node (6.2 of 8), not the 5 of 16 CPUs in all
    assert trials(two, "train.num_workers=1", "train.cpus_per_worker=2") == 4
    assert trials(two, "train.num_workers=3", "train.cpus_per_worker=1", "train.placement_strategy=STRICT_SPREAD") == 0
    assert trials(two + [{"CPU": 8.0}], "train.num_workers=3", "train.cpus_per_worker=1",
                  "train.placement_strategy=STRICT_SPREAD") == 5  # 5 × 4.1 CPUs of 24, a worker a node
    gpus = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    gpu_workers = ("train.use_gpu=true", "train.num_workers=4", "train.cpus_per_worker=1")
    assert trials(gpus, *gpu_workers) == 1 and trials(gpus, *gpu_workers, "train.placement_strategy=STRICT_PACK") == 0
    on_head = "tune.driver_resources={on_demand: 1}"  # a custom resource only the head has
    assert trials([{"CPU": 8.0}], on_head) == 0 and trials([{"CPU": 0.0, "on_demand": 2.0}, *two], on_head) == 2
    # a GPU node and a CPU node: a worker that needs the GPU node's CPUs whole would wait for ever where Tune's
    # driver lands on it first (a bundle is not kept off GPU nodes), in either order of the nodes — not counted;
    # with the driver held to the CPU node (tune.driver_resources), or a worker that leaves it its share, one trial
    gpu_node, whole = {"CPU": 8.0, "GPU": 1.0}, ("train.use_gpu=true", "train.num_workers=1", "train.cpus_per_worker=8")
    assert trials([gpu_node, {"CPU": 8.0}], *whole) == trials([{"CPU": 8.0}, gpu_node], *whole) == 0
    assert trials([gpu_node, {"CPU": 8.0, "cpu_only": 1.0}], *whole, "tune.driver_resources={cpu_only: 1}") == 1
    share = ("train.use_gpu=true", "train.num_workers=1", "train.cpus_per_worker=7")
    assert trials([gpu_node, {"CPU": 8.0}], *share) == 1
    assert trials([{"CPU": 4.0}, gpu_node, dict(gpu_node)], *share) == 2  # two GPU nodes beside a small head
    # tenths of CPUs summed: 3 trials of 0.1 + 0.2 + 1 CPUs in 3.9 (3.9 // 1.3 is 2 in floating point)
    assert trials([{"CPU": 3.9}], "train.num_workers=1", "train.cpus_per_worker=0.2") == 3

    cfg = load_config(None, ["train.num_workers=1", "train.cpus_per_worker=10"])
    monkeypatch.setattr(session, "largest_nodes", lambda: (two, {"CPU": 16.0}, False))
    capped = Sweep("space.yaml", "", "loss", "min", {}, max_concurrent_trials=2)
    with pytest.raises(SweepError, match=r"1 × \{CPU 10\} for its Train workers \(train\.placement_strategy=PACK\) "
                                         r"and \{CPU 1\} for Ray Data, which do not fit on the nodes the cluster has: "
                                         r"\{CPU 16\} in all, as 2 × \{CPU 8\}"):
        trials_at_once(capped, cfg, fixed_size=True)
    fits = load_config(None, ["train.num_workers=1", "train.cpus_per_worker=3"])
    assert trials_at_once(capped, fits, fixed_size=True) == 2  # the space's limit, below the 3 that fit
    assert trials_at_once(Sweep("space.yaml", "", "loss", "min", {}), fits, fixed_size=True) == 3

    config = {"max_workers": 2, "head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 0}}, "a": {"resources": {"CPU": 8}, "max_workers": 4},
        "b": {"resources": {"CPU": 8}, "max_workers": 4}}}
    head = {"CPU": 0.0}
    assert len(session.grown_nodes(config, head)) == 9 and session.grown_resources(config, head)["CPU"] == 16
    monkeypatch.setattr(session, "largest_nodes", lambda: (session.grown_nodes(config, head),
                                                          session.grown_resources(config, head), True))
    assert trials_at_once(Sweep("space.yaml", "", "loss", "min", {}), fits, fixed_size=False) == 3  # 16 // 4.1
    two_workers = load_config(None, ["train.num_workers=2", "train.cpus_per_worker=6"])  # a type holds one
    config["max_workers"] = 1
    with pytest.raises(SweepError, match=r"more than the cluster's max_workers let it grow to: \{CPU 8\} in all, "
                                         r"though its node types \(1 × \{CPU 0\}, 8 × \{CPU 8\}\) would hold it"):
        trials_at_once(Sweep("space.yaml", "", "loss", "min", {}), two_workers, fixed_size=False)


def test_asha_max_t_is_the_longest_trials_budget(tmp_path):
    """ASHA's default max_t (and the sweep's recorded budget) is the longest trial's: a space's train.max_steps, a
    variant's, and with a budget in passes a swept micro-batch size (2 passes of the demo's 4,000 samples at 2 × 16
    a step: 250 steps, at 2 × 32: 125); a smaller one would stop those trials before their last step."""
    from rayvl.sweeps.runner import _scheduler, settings

    asha = {"kind": "asha"}
    steps = load_sweep(_space(tmp_path, scheduler=asha, space={"train.max_steps": {"grid": [100, 300]}}))
    assert _scheduler(steps)._max_t == settings(steps)["max_steps"] == 300
    variant = load_sweep(_space(tmp_path, scheduler=asha, variants={"long": {"train.max_steps": 400}, "short": {}}))
    assert _scheduler(variant)._max_t == settings(variant)["max_steps"] == 400
    passes = {"scheduler": {"kind": "asha", "grace_period": 200}, "space": {"train.micro_batch_size": {"grid": [16, 32]}},
              "set": {"train.max_passes": 2}}
    sweep = load_sweep(_space(tmp_path, **passes))  # a first rung at 200 is below the longest trial's 250 steps
    assert _scheduler(sweep)._max_t == settings(sweep)["max_steps"] == 250
    assert load_sweep(_space(tmp_path, scheduler={"kind": "asha", "max_t": 120}, space={
        "train.max_steps": {"grid": [100, 300]}})).scheduler["max_t"] == 120  # the space's own max_t is kept


@pytest.mark.parametrize("raw, match", [
    ({"num_samples": "many"}, r"num_samples: a whole number ≥ 1, got 'many'"),
    ({"num_samples": 2.7}, r"num_samples: a whole number ≥ 1, got 2\.7"),
    ({"num_samples": True}, r"num_samples: a whole number ≥ 1, got True"),
    ({"num_samples": 0}, r"num_samples: a whole number ≥ 1, got 0"),
    ({"max_concurrent_trials": "x"}, r"max_concurrent_trials: a whole number ≥ 0, got 'x'"),
    ({"max_concurrent_trials": -1}, r"max_concurrent_trials: a whole number ≥ 0, got -1"),
    ({"scheduler": "asha"}, r"scheduler: a mapping, e\.g\. \{kind: asha, .*got 'asha'"),
    ({"scheduler": {"kind": "asha", "reduction_factor": "two"}}, r"scheduler\.reduction_factor: a number > 1, got 'two'"),
    ({"scheduler": {"kind": "asha", "reduction_factor": 1}}, r"scheduler\.reduction_factor: a number > 1, got 1"),
    ({"scheduler": {"kind": "asha", "grace_period": "ten"}}, r"scheduler\.grace_period: a whole number ≥ 1, got 'ten'"),
    ({"scheduler": {"kind": "asha", "grace_period": 0}}, r"scheduler\.grace_period: a whole number ≥ 1, got 0"),
    ({"scheduler": {"kind": "asha", "max_t": 0}}, r"scheduler\.max_t: a whole number ≥ 1, got 0"),
    ({"set": ["train.lr=0.1"]}, r"set: a mapping, e\.g\. .*got \['train\.lr=0\.1'\]"),
    ({"demo": ["train.max_steps=5"]}, r"demo: a mapping, e\.g\. .*got \['train\.max_steps=5'\]"),
    ({"variants": ["a", "b"]}, r"variants: a mapping of names to config overrides"),
])
def test_a_malformed_field_is_an_error_naming_file_and_key(tmp_path, raw, match):
    path = _space(tmp_path, **raw)
    with pytest.raises(SweepError, match=match) as e:
        load_sweep(path)
    assert str(e.value).startswith(f"{path}: ")


def test_uniform_on_an_integer_key_is_refused_saying_it_draws_floats(tmp_path):
    """Tune's uniform and loguniform draw floats, which an integer key refuses in every trial; its ends are checked
    as floats. A float key takes whole-number ends."""
    with pytest.raises(SweepError, match=r"space\.model\.alignment_layers: model\.alignment_layers=0\.0: .*expected an "
                                         r"integer.* \(uniform and loguniform draw floats; randint or choice gives "
                                         r"whole numbers\)"):
        load_sweep(_space(tmp_path, space={"model.alignment_layers": {"uniform": [0, 6]}}))
    assert load_sweep(_space(tmp_path, space={"train.weight_decay": {"uniform": [0, 1]}})).space


@pytest.mark.parametrize("raw, match", [
    ({"metric": "t2i_R@1", "variants": {"evaluated": {}, "quiet": {"eval.tasks": []}}},
     r"metric: 't2i_R@1' is not reported by this recipe's training in variant quiet \(eval\.tasks \[\]\)"),
    ({"metric": "t2i_R@1", "scheduler": {"kind": "asha"}, "set": {"eval.every_steps": 10},
      "variants": {"evaluated": {}, "never": {"eval.every_steps": 0}}},
     r"scheduler\.kind: ASHA stops trials on 't2i_R@1', .*set eval\.every_steps \(0 in variant never;"),
])
def test_each_variant_is_checked_against_the_metric_and_the_scheduler(tmp_path, raw, match):
    """A variant whose training would never report the metric (its own eval.tasks, or no evaluation under ASHA) is
    refused naming it; every trial of it would report nothing Tune ranks."""
    path = _space(tmp_path, **raw)
    with pytest.raises(SweepError, match=match):
        load_sweep(path)


def test_set_on_a_swept_key_is_refused_and_wins_over_a_variant(tmp_path):
    """--set on a key the space sweeps would be lost under the swept values: refused naming it. On a key a variant
    sets it wins over the variant, as over set and demo (spaces.pinned_variants, which comparisons use too), unless
    two variants become one."""
    from rayvl.sweeps.spaces import trial_config

    with pytest.raises(SweepError, match=r"^--set model\.alignment_layers: .*alignment_depth\.yaml sweeps it "
                                         r"\(space\.model\.alignment_layers\): drop one of them"):
        load_sweep(REPO / "tune_spaces" / "alignment_depth.yaml", ["model.alignment_layers=2"])
    decay = {"train.weight_decay": {"grid": [0.0, 0.1]}}
    path = _space(tmp_path, space=decay, variants={"warm": {"train.warmup_steps": 50, "train.lr": 0.01},
                                                   "cold": {"train.lr": 0.02}})
    sweep = load_sweep(path, ["train.lr=0.005"])
    lrs = {n: trial_config(sweep.recipe, sweep.fixed, {}, v).train for n, v in sweep.variants.items()}
    warmup = sweep.base_config().train.warmup_steps  # the recipe's: cold sets none
    assert {n: (t.lr, t.warmup_steps) for n, t in lrs.items()} == {"warm": (0.005, 50), "cold": (0.005, warmup)}
    path = _space(tmp_path, space=decay, variants={"a": {"train.lr": 0.01}, "b": {"train.lr": 0.02}})
    with pytest.raises(SweepError, match=r"space\.yaml: --set train\.lr: variants 'a' and 'b' would be the same"):
        load_sweep(path, ["train.lr=0.005"])


def test_the_held_out_hint_names_the_callers_own_flags(tmp_path):
    """`rayvl tune` has no --eval-data (a comparison job has): each is told the flags its command line takes."""
    from rayvl.sweeps.comparison import Comparison

    shards = "data.train=s3://bucket/laion/{00000..00009}.tar"
    with pytest.raises(SweepError, match=r"give held-out shards \(--set data\.eval=SHARDS\)$"):
        load_sweep(REPO / "tune_spaces" / "alignment_depth.yaml", [shards])
    comparison = Comparison("t", str(REPO / "configs" / "laion_adapt.yaml"), {"a": [], "b": ["train.lr=0.01"]},
                            [("R@1", "t2i_R@1", ".1f")], fixed=["eval.tasks=[retrieval]"], metric="t2i_R@1", mode="max")
    with pytest.raises(SweepError, match=r"give held-out shards \(--eval-data SHARDS, or --set data\.eval=SHARDS\)$"):
        comparison.sweep([shards], seeds=1)


def test_the_dry_run_prints_the_sweep_directory_it_would_use(tmp_path, capsys, monkeypatch):
    """`rayvl tune --dry-run --name X` names the directory the sweep would run in: X under tune.storage_path (the
    space's name without --name), not a placeholder."""
    from rayvl import dry_run
    from rayvl.cli import main

    monkeypatch.setattr(dry_run, "describe", lambda cfg, given=frozenset(): "(the run's report)")
    space, storage = str(REPO / "tune_spaces" / "alignment_depth.yaml"), f"tune.storage_path={tmp_path}"
    assert main(["tune", "--dry-run", space, "--name", "depth-a", "--set", storage]) == 0
    assert f"sweep directory {tmp_path / 'depth-a'} (each trial's run under runs/)" in capsys.readouterr().out
    assert main(["tune", "--dry-run", space, "--set", storage]) == 0
    assert f"sweep directory {tmp_path / 'alignment_depth'} " in capsys.readouterr().out
