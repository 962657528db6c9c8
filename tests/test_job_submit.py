"""`ray job submit --working-dir . -- python jobs/laion_adapt.py` against a `ray start --head` node on loopback."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

# ports apart from the session's local Ray (which uses Ray's defaults)
PORTS = dict(port=6391, dashboard=8377, agent_listen=52401, agent_grpc=52402, runtime_env=52403, metrics=52404,
             node_manager=52405, object_manager=52406, client=10301)


@pytest.fixture
def head_node(tmp_path):
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    p = PORTS
    cmd = [str(bin_dir / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={p['port']}", "--dashboard-host=127.0.0.1", f"--dashboard-port={p['dashboard']}",
           f"--dashboard-agent-listen-port={p['agent_listen']}", f"--dashboard-agent-grpc-port={p['agent_grpc']}",
           f"--runtime-env-agent-port={p['runtime_env']}", f"--metrics-export-port={p['metrics']}",
           f"--node-manager-port={p['node_manager']}", f"--object-manager-port={p['object_manager']}",
           f"--ray-client-server-port={p['client']}", "--min-worker-port=12000", "--max-worker-port=12999",
           "--num-cpus=3", "--disable-usage-stats"]
    # --block keeps the head in the foreground: SIGTERM stops this cluster only (`ray stop` would stop every
    # Ray on the machine, the test session's own included)
    head = subprocess.Popen(cmd, env=env, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"http://127.0.0.1:{p['dashboard']}"
    deadline = time.time() + 120
    while time.time() < deadline:  # the job agent comes up a few seconds after the dashboard
        r = subprocess.run([str(bin_dir / "ray"), "job", "list", "--address", address], env=env,
                           capture_output=True, text=True)
        if r.returncode == 0:
            break
        time.sleep(2)
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    head.wait(timeout=60)


def test_ray_job_submit_runs_laion_adapt(head_node, demo_dir, tmp_path):
    address, env = head_node
    ray_bin = str(Path(sys.executable).parent / "ray")
    job = ["python", "jobs/laion_adapt.py", "--data", str(demo_dir / "train"),
           "--eval-data", str(demo_dir / "eval"), "--set", f"data.classes={demo_dir / 'classes.json'}",
           "--set", "data.image_size=32", "--set", "data.max_text_tokens=16", "--set", "train.micro_batch_size=8",
           "--set", "train.max_steps=2", "--set", "train.warmup_steps=1", "--set", "model.embed_dim=64",
           "--set", "model.alignment_layers=1", "--set", f"train.storage_path={tmp_path / 'runs'}",
           "--set", "train.run_name=submitted"]
    for attempt in range(3):  # "No available agent" right after start-up is transient
        r = subprocess.run([ray_bin, "job", "submit", "--address", address, "--working-dir", str(REPO), "--", *job],
                           env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        if "No available agent" not in r.stdout + r.stderr:
            break
        time.sleep(5)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "succeeded" in out and "zero-shot top-1" in out and "run directory:" in out
    run = tmp_path / "runs" / "submitted"
    assert json.loads((run / "eval.json").read_text())["eval_images"] == 64
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == 2
