"""Sweeps: search spaces checked against the config tree before Ray starts; a real ASHA sweep over the real trainer
that stops trials early and gives every placement group back; the sweep report; `cluster.yaml` against Ray's
schema and rayvl's security rule."""
import csv
import time

import pytest
import yaml

from conftest import REPO
from rayvl.tune import SweepError, load_sweep

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


def test_asha_sweep_stops_trials_early_and_gives_resources_back(ray_local, demo_dir, tmp_path, capsys):
    """4 trials of the real trainer (2 workers each; one at a time, since a trial needs 2.1 of the session's 4
    CPUs). ASHA judges them at steps 2 and 4 on the reported learning rate, which makes its decisions
    deterministic: the grid runs from the largest lr down, so every later trial is below the rung's median and is
    stopped at step 2. Every trial's placement group is removed afterwards (Ray issue #54305: an early-stopped
    Train V2 trial once leaked its placement group)."""
    from ray.util import placement_group_table

    from rayvl.tune import sweep_and_report

    space = tmp_path / "lr.yaml"
    space.write_text(yaml.safe_dump({
        "recipe": str(REPO / "configs" / "laion_adapt.yaml"), "metric": "lr", "mode": "max",
        "space": {"train.lr": {"grid": [3e-3, 1e-3, 3e-4, 1e-4]}},
        "scheduler": {"kind": "asha", "grace_period": 2, "reduction_factor": 2, "max_t": 6},
        "set": {"train.max_steps": 6, "eval.every_steps": 2, "eval.tasks": ["retrieval"],
                "train.checkpoint_every": 2}}))
    overrides = [f"data.train={demo_dir / 'train'}", f"data.eval={demo_dir / 'eval'}", "data.image_size=32",
                 "data.max_text_tokens=16", "train.micro_batch_size=8", "train.warmup_steps=1",
                 "model.alignment_layers=1", "model.embed_dim=64", "eval.batch_size=32",
                 f"tune.storage_path={tmp_path / 'sweeps'}"]
    before = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    sweep_dir = sweep_and_report(load_sweep(space, overrides))
    printed = capsys.readouterr().out

    with open(sweep_dir / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {float(r["train.lr"]) for r in rows} == {1e-4, 3e-4, 1e-3, 3e-3}
    by_lr = {float(r["train.lr"]): r for r in rows}
    assert by_lr[3e-3]["status"] == "TERMINATED" and int(by_lr[3e-3]["steps"]) == 6
    assert all(by_lr[lr]["status"] == "STOPPED EARLY" and int(by_lr[lr]["steps"]) == 2 for lr in (1e-3, 3e-4, 1e-4))
    finals = [float(r["final"]) for r in rows]
    assert finals == sorted(finals, reverse=True)  # best final value first (mode max)
    assert "final lr" in printed and "STOPPED EARLY" in printed
    assert {p.name for p in sweep_dir.glob("*.png")} == {"lr_vs_train.lr.png", "learning_curves.png"}
    best = yaml.safe_load((sweep_dir / "best_config.yaml").read_text())
    assert best["train"]["lr"] == float(rows[0]["train.lr"]) and best["train"]["max_steps"] == 6
    stopped = next(r for r in rows if r["status"] == "STOPPED EARLY")
    from rayvl.checkpoints import latest_checkpoint_dir, read_meta

    newest = latest_checkpoint_dir(sweep_dir / "runs" / f"trial-{stopped['trial']}")
    assert newest is None or read_meta(newest)["step"] < 6  # its Train run did not go on after Tune stopped it

    deadline = time.time() + 60
    while True:  # placement groups are removed asynchronously once the trials' actors are gone
        left = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"} - before
        if not left or time.time() > deadline:
            break
        time.sleep(1)
    assert not left, f"placement groups left behind: {left}"

    # the report again from the directory alone, in a process of its own: `rayvl tune --report DIR`
    import subprocess
    import sys

    (sweep_dir / "trials.csv").unlink()
    r = subprocess.run([sys.executable, "-m", "rayvl.cli", "tune", "--report", str(sweep_dir)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(row["trial"] in r.stdout for row in rows) and (sweep_dir / "trials.csv").is_file()


def test_cluster_yaml_passes_rays_schema_and_keeps_the_dashboard_private():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    config = prepare_config(raw)
    validate_config(config)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["CPU"] == 0  # the head trains nothing
    gpu = [t for name, t in types.items() if "gpu" in name]
    assert gpu and all(t["min_workers"] == 0 for t in gpu)  # GPU workers come and go with demand
    assert config["docker"]["image"].startswith("rayproject/ray:2.60") and "-gpu" in config["docker"]["image"]
    starts = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in starts and "0.0.0.0" not in starts
    ports = [(p["FromPort"], p["ToPort"]) for p in raw["provider"]["security_group"]["IpPermissions"]]
    assert ports == [(22, 22)]  # SSH is the only way in
    assert any("rayvl[gpu]" in c for c in config["setup_commands"])


def test_local_storage_on_several_nodes_is_refused_naming_the_key():
    from rayvl.config import ConfigError, load_config
    from rayvl.session import check_storage

    cfg = load_config(None, ["train.storage_path=/tmp/runs"])
    check_storage(cfg, nodes=1)
    with pytest.raises(ConfigError, match=r"train\.storage_path: '/tmp/runs' is a local path, but the cluster has 3"):
        check_storage(cfg, nodes=3)
    check_storage(load_config(None, ["train.storage_path=s3://bucket/runs", "tune.storage_path=gs://b/s"]), nodes=3)
    check_storage(load_config(None, ["train.shared_storage=true"]), nodes=3)  # a mount every node shares
