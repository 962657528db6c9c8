"""Who uses which GPU, checked on CPU: faiss's per-process choice of GPUs (one per Ray Train rank, none on CPU), the
embedding actors' GPU requests — on a local Ray with logical GPUs, where an actor given one finds no CUDA in this
CPU build of torch and says so in one line — and `rayvl eval --gpus` refused before any embedding on a Ray that has
no GPUs. This module runs Rays of its own (the session's is shut down meanwhile: one Ray per driver)."""
import logging

import numpy as np
import pytest
import torch

from conftest import untrained_checkpoint, worker_env
from rayvl.eval import knn
from rayvl.eval.embed import NoCudaError, actor_device, check_gpus, gpu_shortfall, no_cuda_cause, pool_options

pytestmark = pytest.mark.usefixtures("no_session_ray")


@pytest.fixture
def faiss_choice():
    yield
    knn.use_gpus(None)  # the process default again


def test_a_rank_searches_on_its_own_gpu_and_a_cpu_rank_on_cpu(faiss_choice):
    import faiss

    assert knn.device_gpus(torch.device("cuda:3")) == [3] and knn.device_gpus(torch.device("cpu")) == []
    # a Ray Train worker sees all 8 GPUs of its node: its index goes to its own, never to all 8
    assert knn.target_gpus(None, 8) == list(range(8))  # a process that owns the node: every GPU
    assert knn.target_gpus([3], 8) == [3] and knn.target_gpus([], 8) == []
    assert knn.target_gpus([3], 0) == []  # faiss-cpu: CPU whatever the choice
    with pytest.raises(ValueError, match=r"faiss GPUs \[9\] requested, but this process sees 8 GPU"):
        knn.target_gpus([9], 8)
    index = knn.build_index(np.eye(4, dtype=np.float32), "flat")
    knn.use_gpus([])
    assert knn.on_device(index) is index and isinstance(index, faiss.IndexFlatIP)
    scores, ids = knn.top_k(np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32)[[2]], 1)
    assert ids.tolist() == [[2]] and scores.tolist() == [[1.0]]


def test_the_embedding_pool_asks_for_the_gpus_given_and_needs_gpus_the_cluster_can_have():
    assert pool_options(2, 0.5, 1.0) == {"concurrency": 2, "num_cpus": 0.5, "num_gpus": 1.0}
    assert pool_options(3, 1.0) == {"concurrency": 3, "num_cpus": 1.0, "num_gpus": 0.0}
    assert gpu_shortfall(0.0, [], {}, False) == ""  # CPU actors
    assert gpu_shortfall(1.0, [0.0], {"GPU": 8.0}, True) == ""  # the autoscaler adds GPU nodes
    assert gpu_shortfall(0.5, [0.0, 1.0], {"GPU": 1.0}, False) == ""
    assert gpu_shortfall(1.0, [0.0], {"CPU": 4.0}, False) == "the cluster has no GPUs"
    assert gpu_shortfall(1.0, [0.0], {"GPU": 0.0}, True) == "the cluster can grow to 0 GPUs (its autoscaler config)"
    check_gpus(0.0, "--gpus 0", "--gpus 0", fixed_size=True)  # CPU actors: nothing to check, no Ray asked


def test_rayvl_eval_gpus_on_a_ray_without_gpus_fails_in_one_line_before_embedding(demo_dir, tmp_path, capsys,
                                                                                  caplog):
    import ray

    from rayvl.cli import main
    from rayvl.config import ConfigError, load_config
    from rayvl.methods.bow.pseudo_label import check_cluster

    ckpt = untrained_checkpoint(demo_dir, tmp_path)
    capsys.readouterr()
    assert not ray.is_initialized()
    try:
        # no Ray running: the command starts a local one (no GPUs on this machine), whose size is final
        assert main(["eval", str(ckpt), "--gpus", "1", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("rayvl: error: --gpus 1: each actor asks for 1 GPU(s), but the cluster has no GPUs, so they "
                       "would wait forever; run on CPU (--gpus 0) or on a cluster with GPU nodes")
        assert ray.is_initialized() and not (tmp_path / "out").exists()  # nothing read, embedded or written
        cfg = load_config(None, ["pseudo_label.gpus_per_actor=0.5"])
        with pytest.raises(ConfigError, match=r"^pseudo_label.gpus_per_actor=0.5: each actor asks for 0.5 GPU"):
            check_cluster(cfg, True, [2.0])  # before the job: a Ray started by `rayvl pseudo-label` is final
        with caplog.at_level(logging.WARNING, logger="rayvl"):
            check_cluster(cfg, False, [2.0])  # a joined cluster without an autoscaler config here: a warning
        assert "no autoscaler config on this node" in caplog.text
        assert main(["eval", str(ckpt), "--gpus", "2"]) == 2
        assert "from 0 to 1 (more GPUs: more --actors)" in capsys.readouterr().err
    finally:
        ray.shutdown()


def test_an_actor_given_a_gpu_without_cuda_names_the_fix(demo_dir, tmp_path, capsys):
    """A Ray with 2 logical GPUs on this CPU machine: actors get GPU ids (and CUDA_VISIBLE_DEVICES) from Ray, and
    this torch is a CPU build — as on a GPU node where the CPU wheel was installed."""
    import ray

    from rayvl.cli import main
    from rayvl.eval.runner import pool_size
    from rayvl.methods.bow.pseudo_label import Labeler

    ckpt = untrained_checkpoint(demo_dir, tmp_path)
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             runtime_env={"env_vars": worker_env()})
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        assert pool_size(0, 1.0, 0.5) == 2 and pool_size(0, 0.5, 0.5) == 2  # 2 GPUs; 2 CPUs less 1 for reads
        assert pool_size(0, 0.0, 0.5) == 1 and pool_size(3, 1.0, 0.5) == 3
        # `rayvl pseudo-label`'s labellers the same way: pseudo_label.actors=0 (the default) sized on the Ray
        from rayvl.config import load_config
        from rayvl.methods.bow.pseudo_label import sized

        labellers = [sized(load_config(None, [f"pseudo_label.{k}" for k in given])).pseudo_label.actors
                     for given in (["gpus_per_actor=1", "cpus_per_actor=0.5"], ["cpus_per_actor=0.5"],
                                   ["gpus_per_actor=1", "actors=3"])]
        assert labellers == [2, 1, 3]
        # the same 2 CPUs as nodes of 1.5 and 0.5: the second labeller would leave no node a read task's CPU
        two_nodes = load_config(None, ["pseudo_label.gpus_per_actor=1", "pseudo_label.cpus_per_actor=0.5"])
        assert sized(two_nodes, node_cpus=[1.5, 0.5]).pseudo_label.actors == 1
        on = ray.remote(num_cpus=0)(actor_device)
        assert ray.get(on.remote()) == torch.device("cpu")  # no GPU asked: CPU, whatever CUDA the node has
        # the labelling actor, as `rayvl pseudo-label` starts it with pseudo_label.gpus_per_actor=1
        labeler = ray.remote(num_cpus=0, num_gpus=1)(Labeler).remote(str(ckpt), str(tmp_path), {}, {}, "")
        with pytest.raises(ray.exceptions.ActorDiedError) as died:
            ray.get(labeler.__ray_ready__.remote())
        assert "install a CUDA build of torch" in no_cuda_cause(died.value)
        assert no_cuda_cause(died.value).endswith("(pseudo_label.gpus_per_actor=0)")
        assert no_cuda_cause(NoCudaError("x")) == "x" and no_cuda_cause(RuntimeError("other")) is None

        capsys.readouterr()
        # the whole command: 2 actors of 1 GPU (the pool fills the GPUs); each is given one and stops in __init__
        assert main(["eval", str(ckpt), "--gpus", "1", "--tasks", "retrieval",
                     "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("rayvl: error: ")]
        assert len(lines) == 1 and "Traceback" not in lines[0]
        assert "this Ray actor was given GPU " in lines[0] and "is a CPU build: install a CUDA build of torch on the " \
            "GPU nodes" in lines[0] and lines[0].endswith("(rayvl eval --gpus 0)")
    finally:
        ray.shutdown()
