"""Training the way a LAION user trains: shards on an S3-compatible store named by a brace range, read through
connections that are reset and stalled in the middle of objects, one object of the range missing, the run and
its checkpoints written to the store and resumed from it."""
import json
import shutil
from pathlib import Path

import pytest

from conftest import cli, object_store_server, small_config
from rayvl import storage
from rayvl.checkpoints import read_train_state
from rayvl.data.report import format_data_report
from rayvl.train.startup import DRIVER_PHASES, WORKER_PHASES
from rayvl.train.run_dir import log_dir
from rayvl.train.trainer import train


@pytest.fixture(scope="module")
def laion(demo_dir):
    """The demo's 3 training shards (with img2dataset's parquet and stats files) as objects 00000, 00001 and 00011
    of ``{00000..00011}``: the check before Ray starts looks at the first and the last name and passes, and the 9
    names between are missing — the run meets them when it reads them. The held-out split beside them."""
    from conftest import object_store_server

    store = object_store_server()
    s3 = store.client()
    for src, dst in ((0, 0), (1, 1), (2, 11)):
        for suffix in (".tar", ".parquet", "_stats.json"):
            s3.put_object(Bucket="rayvl-test", Key=f"laion/{dst:05d}{suffix}",
                          Body=(demo_dir / "train" / f"{src:05d}{suffix}").read_bytes())
    held_out = store.upload_folder(demo_dir / "eval", "coco-val")
    return "s3://rayvl-test/laion/{00000..00011}.tar", held_out


def _faults(s3) -> None:
    """Resets in the middle of two shards, past pyarrow's own ~30 attempts (rayvl's retry resumes the read), a
    1 s stall in the last shard (a slow read waits; it is no error: pyarrow's client waits out longer silences
    too, in one GET, docs/fault-tolerance.md)."""
    for key in ("laion/00000.tar", "laion/00001.tar"):
        s3.faults.add(key, *[("reset", 50_000)] * 40)
    s3.faults.add("laion/00011.tar", ("stall", 50_000, 1))


def test_a_run_on_object_storage_through_faults_trains_every_row_once_and_resumes_from_the_store(
        ray_local, demo_dir, tmp_path, laion, s3):
    from mlflow.tracking import MlflowClient

    spec, held_out = laion
    runs = "s3://rayvl-test/runs"
    # one worker (two ranks' ledgers resume in test_position and test_multinode), 32 rows a step
    args = [f"data.train={spec}", f"data.eval={held_out}", f"train.storage_path={runs}", "train.micro_batch_size=32",
            "train.num_workers=1",
            "train.report_to=[tensorboard, mlflow]",
            "train.max_steps=12", "train.checkpoint_every=6", "train.log_every=3", "eval.tasks=[retrieval]",
            "data.unreadable_shards=skip", "data.io_retry_wait_s=0.2", "data.local_shuffle_buffer=0"]
    _faults(s3)
    first = train(small_config(demo_dir, tmp_path, *args, "train.stop_at_step=6"))
    assert first.uri == f"{runs}/run" and first.checkpoint_dir.startswith(f"{runs}/run/checkpoint_")
    assert first.run_dir is None  # nothing of the run is on this machine's disk
    injected = dict(s3.faults.injected)
    assert injected[("laion/00000.tar", "reset")] == injected[("laion/00001.tar", "reset")] == 40
    assert injected[("laion/00011.tar", "stall")] == 1
    counts = first.data_report["counts"]
    assert counts["io_retries"] >= 1  # a reset burst outlasted pyarrow's retries
    assert "truncated_shards" not in counts  # a reset is not a damaged shard
    assert counts["unreadable_shards"] >= 9 and len(first.data_report["bad_shards"]) == 9
    assert "laion/00005.tar" in " ".join(first.data_report["bad_shards"])
    assert "unreadable_shards" in format_data_report(first.data_report)

    shutil.rmtree(log_dir(runs, "run"))  # resumed on a new head node: its records come from the bucket
    resumed = train(small_config(demo_dir, tmp_path, *args, "train.resume=true"))
    history = [json.loads(x) for x in storage.read_text(f"{resumed.uri}/metrics.jsonl").splitlines()]
    assert [h["step"] for h in history] == [3, 6, 9, 12]
    assert history[2]["resumed_from"] == 6 and history[2]["first_step"] == 7
    # where each start's time before its first step went: the first start from train() on, the resume from its
    # workers' start (its driver's phases are not told apart from a restart's); no other report says it
    for row, phases in ((history[0], DRIVER_PHASES + WORKER_PHASES), (history[2], WORKER_PHASES[1:])):
        spent = {k: v for k, v in row.items() if k.startswith("startup_")}
        assert set(spent) == {f"startup_{p}_s" for p in phases} | {"startup_first_batch_wait_s", "startup_total_s"}
        assert all(v >= 0 for v in spent.values()), spent
        assert sum(row[f"startup_{p}_s"] for p in phases) == pytest.approx(row["startup_total_s"])
        assert row["startup_first_batch_wait_s"] <= row["startup_first_step_s"]
    assert not any(k.startswith("startup_") for row in (history[1], history[3]) for k in row)
    state = read_train_state(resumed.checkpoint_dir)  # downloaded from the store
    assert state["progress"]["resumed_at"] == [6]
    position = state["data_position"]
    # 12 steps × 32 rows = one pass of the 384 samples: every row trained once, across the resume
    assert sum(position["rows_per_pass"].values()) == 384 and position["duplicates"] == 0
    assert history[-1]["data_rows_trained"] == 384 and history[-1]["data_duplicate_rows"] == 0
    record = json.loads(storage.read_text(f"{resumed.uri}/run.json"))  # each start's end, in the bucket
    assert [i["status"] for i in record["invocations"]] == ["stopped", "finished"] and record["status"] == "finished"
    # the shards it reads, which a resume must list again: another list is refused before Ray starts
    assert record["train_shards"]["shards"] == 12
    from rayvl.config import ConfigError
    from rayvl.train.run_plan import plan_run

    # the same 12 shards in another order
    reordered = "s3://rayvl-test/laion/{00001..00011}.tar,s3://rayvl-test/laion/00000.tar"
    other = [a for a in args if not a.startswith("data.train=")] + [f"data.train={reordered}"]
    with pytest.raises(ConfigError, match=r"^data\.train: this resume lists the same number of 12 shards, but not"):
        plan_run(small_config(demo_dir, tmp_path, *other, "train.resume=true"))
    assert json.loads(storage.read_text(f"{resumed.uri}/eval.json"))["step"] == 12
    (tmp_path / "mlflow.db").write_bytes(storage.read_bytes(f"{resumed.uri}/mlruns/mlflow.db"))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # MLflow's store beside the run: one run, both starts
    (run,) = client.search_runs([client.get_experiment_by_name("laion_adapt").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [3, 6, 9, 12]
    assert resumed.data_report["counts"].get("truncated_shards", 0) == 0
    assert "t2i_R@1" in resumed.metrics


WATCHED = """
import sys
from conftest import small_config
from rayvl.train.trainer import train
from pathlib import Path
train(small_config(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]))
"""


def test_a_run_on_object_storage_is_watched_from_the_bucket_and_keeps_its_history_when_its_driver_dies(
        ray_local, demo_dir, tmp_path, s3, capsys):
    """What a run records lands in its run directory while it runs (train.sync_every_s=0: at every report) — its
    metrics, TensorBoard events, dashboard, MLflow store and run.json, read from the bucket with the tools a user
    has (tensorboard's reader, `rayvl plot`) before any checkpoint exists — and stays there when its driver is
    killed (-9: nothing of the run's own ending runs)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run = "s3://rayvl-test/watched/run"
    env = {**os.environ, **object_store_server().env, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen(
        [sys.executable, "-c", WATCHED, str(demo_dir), str(tmp_path), "train.storage_path=s3://rayvl-test/watched",
         "train.num_workers=1", "train.max_steps=400", "train.checkpoint_every=400", "train.sync_every_s=0",
         "eval.tasks=[]",
         "train.report_to=[tensorboard, mlflow]"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        rows = []
        while len(rows) < 3 and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(2)
            rows = storage.read_text(f"{run}/metrics.jsonl").splitlines() if storage.is_file(
                f"{run}/metrics.jsonl") else []
        assert len(rows) >= 3, driver.stderr.read().decode()[-3000:] if driver.poll() is not None else rows
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert not storage.subdirs(run, "checkpoint_")  # all of this came from the syncs, none from a checkpoint
    assert storage.is_file(f"{run}/mlruns/mlflow.db")
    # what `tensorboard --logdir s3://…` reads (its S3 filesystem: boto3, the same AWS_* settings)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{run}/tensorboard")
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")][:3] == [1, 2, 3]
    assert storage.is_file(f"{run}/plots/run.png")
    assert json.loads(storage.read_text(f"{run}/run.json"))["status"] == "running"  # killed: never ended
    code, out, _ = cli(capsys, "plot", run, "--out", str(tmp_path / "plots"))
    assert code == 0 and (tmp_path / "plots" / "run.png").is_file()


def test_a_missing_object_fails_the_run_naming_it(ray_local, demo_dir, tmp_path, laion, capsys):
    """Under the default data.unreadable_shards=fail, the first missing object the run reads ends it with one line
    naming the object and the cause (not a truncated shard, not "an epoch produced no full batch")."""
    from rayvl.cli.recipes import run_recipe

    spec, held_out = laion
    config = small_config(demo_dir, tmp_path)  # for its paths; the command line below is what a user types
    code = run_recipe("configs/laion_adapt.yaml", [
        "--data", spec, "--eval-data", held_out, "--set", f"train.storage_path={tmp_path}",
        "--set", "train.max_failures=0", "--set", "data.shuffle_files=false", "--set", "eval.tasks=[retrieval]",
        "--set", "train.num_workers=1", "--set", "train.micro_batch_size=8", "--set", "data.image_size=32",
        "--set", "train.max_steps=40",
        "--set", "model.alignment_layers=1", "--set", f"data.paraphrases={config.data.paraphrases}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("rayvl: error: shard s3://rayvl-test/laion/000")  # one of the 9 missing names
    assert "cannot be read: it does not exist" in err[-1]
    assert "data.unreadable_shards=skip" in err[-1]


def test_dry_run_of_the_laion_recipe_at_laion_scale(s3, demo_dir, tmp_path, capsys, monkeypatch):
    """The recipe's LAION settings (40 workers × 819, bf16, m = 6) with LAION-400M named as open_clip users name it:
    the dry run checks the first and last of 41,408 objects, reads their first sample and img2dataset's stats,
    and prints the plan — no listing of the bucket, no demo-size check, no Ray."""
    s3_client = s3.client()
    for name in ("00000", "41407"):
        for suffix in (".tar", "_stats.json"):
            s3_client.put_object(Bucket="rayvl-test", Key=f"laion400m/{name}{suffix}",
                                 Body=(demo_dir / "train" / f"00000{suffix}").read_bytes())
    held_out = s3.upload_folder(demo_dir / "eval", "coco-val")
    s3.faults.clear()
    laion = ["--set", "model.alignment_layers=6", "--set", "train.num_workers=40", "--set", "train.use_gpu=true",
             "--set", "train.precision=bf16", "--set", "train.micro_batch_size=819", "--set",
             "train.warmup_steps=10000", "--set", "train.max_steps=40000", "--set", "train.lr=1e-3",
             "--set", "train.storage_path=s3://rayvl-test/rayvl-runs"]
    spec = "s3://rayvl-test/laion400m/{00000..41407}.tar"
    from rayvl.train import layout

    monkeypatch.setattr(layout, "local_gpu_gib", lambda: None)  # as on a machine without a GPU of its own
    code, out, err = cli(capsys, "train", "--dry-run", "--data", spec, "--eval-data", held_out, *laion)
    assert code == 0, err
    assert "data.train: 41408 shards; 41408 object names made from the spec, 2 of them checked" in out
    assert "5,300,224 samples a pass (from the _stats.json of 2 of 41408 remote shards, extrapolated)" in out
    assert "laion400m/41407.tar: 000000000: 112×112 jpg, '" in out
    assert "40 workers × 819 per micro-batch × 1 accumulated = 32,760 samples a step" in out
    assert "162 steps a pass; train.max_steps=40,000 is 247.23 passes" in out
    assert "40 Ray Train workers of {CPU: 0.5, GPU: 1} (train.placement_strategy=PACK), bf16" in out
    # no GPU here: the layout waits for the cluster's GPU type (test_layout has the choice itself)
    assert "engine: DeepSpeed ZeRO stage auto — chosen when the run joins its cluster" in out
    assert "run directory s3://rayvl-test/rayvl-runs/laion_adapt-" in out
    assert not [q for _, _, q in s3.faults.requests if "list-type" in q and "laion400m" in q]  # no listing

    # what a user mistypes is one line naming the key or the file
    for argv, message in ((["--set", "train.betas=[0.9"], "train.betas (override 'train.betas=[0.9'): not valid YAML"),
                          (["--config", str(tmp_path / "missing.yaml")], "--config: cannot read"),
                          (["--data", "s3://rayvl-test/laion400m/{00000..41408}.tar"], "41408.tar' does not exist")):
        code, out, err = cli(capsys, "train", "--dry-run", *argv)
        assert code == 2 and err.startswith("rayvl: error: ") and message in err and len(err.splitlines()) == 1

    code, out, err = cli(capsys, "data", "check", f"{held_out}/{{00000..00000}}.tar", "-n", "5")
    assert code == 0, err
    assert f"{held_out}/{{00000..00000}}.tar: 1 shard; 1 object names made from the spec, 1 of them checked" in out
    assert "64 samples a pass (from the _stats.json of 1 of 1 remote shards)" in out
    assert "first 5 samples of s3://rayvl-test/coco-val/00000.tar:" in out and out.rstrip().endswith("kept: 5")
    # open_clip's sizes.json: beside img2dataset's _stats.json it is not read (their exact count wins); beside a
    # shard with none, it is the pass's size (one read)
    storage.write_text(f"{held_out}/sizes.json", json.dumps({"00000.tar": 60}))
    code, out, err = cli(capsys, "data", "check", f"{held_out}/{{00000..00000}}.tar", "-n", "5")
    assert code == 0 and "64 samples a pass (from the _stats.json of 1 of 1 remote shards)" in out, err
    storage.write_bytes("s3://rayvl-test/wds/00000.tar", storage.read_bytes(f"{held_out}/00000.tar"))
    storage.write_text("s3://rayvl-test/wds/sizes.json", json.dumps({"00000.tar": 60}))
    code, out, err = cli(capsys, "data", "check", "s3://rayvl-test/wds/{00000..00000}.tar", "-n", "5")
    assert code == 0 and "60 samples a pass (the shards' folder's sizes.json (open_clip's))" in out, err


@pytest.mark.slow
def test_dry_runs_of_a_sweep_a_comparison_and_a_labelling_job(demo_dir, tmp_path, capsys):
    """--dry-run on `rayvl tune`, a comparison job and `rayvl pseudo-label`: the plan, nothing started."""
    import subprocess
    import sys

    from conftest import REPO, untrained_checkpoint

    data = ["--set", f"data.train={demo_dir}/train", "--set", f"data.eval={demo_dir}/eval", "--set",
            "eval.every_steps=10"]
    code, out, err = cli(capsys, "tune", "--dry-run", str(REPO / "tune_spaces" / "alignment_depth.yaml"), *data)
    assert code == 0, err
    assert "5 trials over model.alignment_layers" in out and "data.train: 3 shards; 3 found by listing" in out
    job = subprocess.run([sys.executable, str(REPO / "jobs" / "unicl.py"), "--dry-run"], capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 0 and "9 trials over train.seed × variants ce, unicl_labels, unicl" in job.stdout
    ckpt = untrained_checkpoint(demo_dir, tmp_path)
    code, out, err = cli(capsys, "pseudo-label", "--dry-run", str(ckpt), "--aligned",
                          f"{demo_dir}/train/{{00000..00001}}.tar", "--unaligned", f"{demo_dir}/train/00002.tar",
                          "--out", str(tmp_path / "pseudo"))
    assert code == 0, err
    assert "pseudo_label.aligned: 2 shards; 2 local files named and found" in out
    assert "pseudo_label.unaligned: 1 units (1 shards)" in out and "0 of 1 units finished before" in out
    assert not (tmp_path / "pseudo").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_rayvl_eval_without_ray_reads_the_held_out_shards_from_the_store_through_faults(demo_dir, tmp_path, laion,
                                                                                        s3):
    """`rayvl eval` on one machine (no Ray) over held-out shards on object storage: its loader's workers start from a
    fresh process (not a fork of one that used the store's client), each shard is fetched by one of them, and a
    connection reset past pyarrow's own retries is resumed — the same rows, embeddings and counts as the same
    shards read from files (the retries counted besides)."""
    import subprocess
    import sys

    import numpy as np

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import eval_throughput as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    checkpoint = bench.tiny_checkpoint(tmp_path)
    s3.faults.add("coco-val/00000.tar", *[("reset", 20_000)] * 40)
    outs = {}
    for name, data in (("store", laion[1]), ("files", str(demo_dir / "eval"))):
        outs[name] = tmp_path / name
        run = subprocess.run(bench.rayvl_command(checkpoint, data, outs[name]), env=bench.child_env(),
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == 0 and "no Ray" in run.stderr, run.stderr[-3000:]
    store, files = (json.loads((outs[n] / "eval.json").read_text()) for n in ("store", "files"))
    assert store.pop("embedding")["images"] == files.pop("embedding")["images"] == 64  # and each run's timings
    assert store["data"].pop("io_retries") >= 1 and store == {**files, "checkpoint": store["checkpoint"]}
    assert files["data"]["samples_kept"] == 64
    for name in ("keys.json", "image_embeddings.npy", "caption_embeddings.npy"):
        a, b = (outs[n] / name for n in ("store", "files"))
        assert (a.read_text() == b.read_text()) if name.endswith(".json") else np.array_equal(np.load(a), np.load(b))
