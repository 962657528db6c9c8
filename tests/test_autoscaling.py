"""Autoscaling for real: Ray's fake-provider autoscaler (`ray.cluster_utils.AutoscalingCluster`) starts worker
raylets on this machine when pending work asks for them, as a cloud provider would start machines for
`cluster.yaml`. The head has no CPUs, the CPU worker type starts at 0 nodes; a job submitted with `ray job submit`
whose run has one worker per node (STRICT_SPREAD) gets two nodes from the autoscaler and finishes."""
import json
import os
import subprocess
import sys
import time

from conftest import REPO

# the fake provider's cluster config (Ray ships the code but not its example.yaml in the wheel); the node type
# mirrors cluster.yaml's: min 0 workers, scaled up on demand, idle nodes removed after a while
CONFIG = {
    "cluster_name": "rayvl-fake", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 1,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "available_node_types": {
        "ray.head.default": {"resources": {}, "node_config": {}, "max_workers": 0},
        "cpu_worker": {"resources": {"CPU": 2, "object_store_memory": 200 * 1024**2}, "node_config": {},
                       "min_workers": 0, "max_workers": 2}},
    "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
    "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
    "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
    "worker_start_ray_commands": []}


def _autoscaling_cluster():
    from ray.cluster_utils import AutoscalingCluster

    class FakeCloud(AutoscalingCluster):
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
            return CONFIG

    return FakeCloud(head_resources={"CPU": 0, "object_store_memory": 200 * 1024**2}, worker_node_types={})


def test_ray_job_submit_to_an_autoscaling_cluster_gets_its_nodes(no_session_ray, demo_dir, tmp_path,
                                                                monkeypatch):
    """The cluster flow of the README on a fake cloud: a head with no CPUs (token auth on, dashboard on
    loopback), `ray job submit --working-dir . -- python jobs/laion_adapt.py` with one worker per node; the
    autoscaler launches the two CPU nodes the run's placement group asks for, and the job succeeds."""
    import ray

    # AutoscalingCluster drives the `ray` command line: the one installed next to this interpreter
    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    cluster = _autoscaling_cluster()
    cluster.start(override_env={"RAY_AUTH_MODE": "token"})
    try:
        address = "http://127.0.0.1:8265"
        job = ["python", "jobs/laion_adapt.py", "--data", str(demo_dir / "train"),
               "--eval-data", str(demo_dir / "eval"), "--set", f"data.classes={demo_dir / 'classes.json'}",
               "--set", "data.image_size=32", "--set", "data.max_text_tokens=16", "--set", "train.micro_batch_size=8",
               "--set", "train.max_steps=2", "--set", "train.warmup_steps=1", "--set", "train.log_every=1",
               "--set", "model.embed_dim=64",
               "--set", "model.alignment_layers=1", "--set", f"train.storage_path=file://{tmp_path}/runs",
               "--set", "train.shared_storage=true", "--set", "train.placement_strategy=STRICT_SPREAD",
               "--set", "train.run_name=submitted"]
        started = time.time()
        for attempt in range(10):  # the job agent comes up a few seconds after the head
            r = subprocess.run([os.path.join(bin_dir, "ray"), "job", "submit", "--address", address,
                                "--working-dir", str(REPO), "--", *job],
                               env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
            if r.returncode == 0 or not any(m in r.stdout + r.stderr for m in
                                            ("No available agent", "Failed to connect", "Connection refused")):
                break
            time.sleep(3)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        assert "succeeded" in out and "zero-shot top-1" in out and "run directory:" in out
        run = tmp_path / "runs" / "submitted"
        assert json.loads((run / "eval.json").read_text())["eval_images"] == 64
        assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == 2
        # the job's terminal: rayvl's progress lines, not Ray's echo of every report or the workers' output
        assert "step 1/2 (50%)" in out and "step 2/2 (100%)" in out and "ETA" in out, out[-4000:]
        assert "Reporting training result" not in out and "(RayTrainWorker" not in out, out[-4000:]
        assert (run / "plots" / "loss.png").is_file() and list((run / "tensorboard").glob("events.out.tfevents.*"))
        # the recipe's report_to: [tensorboard, mlflow]
        assert (tmp_path / "runs" / "mlruns" / "mlflow.db").is_file() and "report_to" not in out, out[-4000:]

        ray.init(address="auto")
        workers = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        assert len(workers) == 2, f"the autoscaler started {len(workers)} CPU nodes"
        print(f"job on the autoscaled cluster finished in {time.time() - started:.0f} s on {len(workers)} nodes")
    finally:
        ray.shutdown()
        cluster.shutdown()
