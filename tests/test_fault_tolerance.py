"""A worker killed mid-run: Ray Train restarts the group, which resumes from the latest checkpoint and finishes."""
import json
import os
import signal
import threading
import time
from pathlib import Path

from conftest import small_config
from rayvl.checkpoints import latest_checkpoint_dir
from rayvl.train.trainer import train


def _train_worker_pids() -> list[int]:
    """Ray titles actor processes "ray::<Class>.<method>"; the session's Ray is the only one running."""
    import psutil

    pids = []
    for p in psutil.process_iter(["cmdline"]):
        if any("ray::RayTrainWorker" in part for part in (p.info["cmdline"] or [])):
            pids.append(p.pid)
    return sorted(pids)


def _kill_one_worker_after_first_checkpoint(run_dir: Path, killed: list, stop: threading.Event):
    while not stop.is_set():
        if latest_checkpoint_dir(run_dir) is not None:
            pids = _train_worker_pids()
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                killed.append(pids[-1])
                return
        time.sleep(0.2)


def test_lost_worker_resumes_from_checkpoint(ray_local, demo_dir, tmp_path):
    cfg = small_config(demo_dir, tmp_path, "train.max_steps=40", "train.checkpoint_every=2",
                       "train.log_every=2", "train.max_failures=1", "eval.tasks=[]")
    killed: list = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_one_worker_after_first_checkpoint,
                              args=(tmp_path / "run", killed, stop), daemon=True)
    killer.start()
    try:
        result = train(cfg)
    finally:
        stop.set()
    assert killed, "the worker was never killed: the run finished before its first checkpoint"
    history = [json.loads(x)["step"] for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert history == list(range(2, 41, 2))  # resumed after the restart: no step lost or repeated in the record
    assert json.loads((Path(result.checkpoint_dir) / "rayvl.json").read_text())["step"] == 40
