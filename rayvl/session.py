"""The Ray session of a driver: join a cluster or start a local Ray, with the environment every worker needs, and
check that the CPUs asked for leave room for Ray Data."""
from __future__ import annotations

import os

import ray

from rayvl import storage
from rayvl.config import ConfigError, RayvlConfig

# no hub at run time, quiet tokenizers and Ray Data (per-operator progress bars flood job logs)
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "TRANSFORMERS_VERBOSITY": "error", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


def connect(address: str = "", num_cpus: int = 0, **init_kwargs) -> bool:
    """Join a cluster (``address``, RAY_ADDRESS, or a `ray job submit` driver's) or start a local Ray; True if this
    call started a local Ray (whose size is then final). Does nothing when Ray is already initialised."""
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS", "")
        if address:
            ray.init(address=address, **{"log_to_driver": True, **init_kwargs})
        else:
            # "local": a fresh Ray even if a `ray start` cluster runs on this machine; joining one is explicit
            ray.init(address="local", num_cpus=num_cpus or None, runtime_env={"env_vars": WORKER_ENV},
                     **init_kwargs)
            _quiet_data()
            return True
    _quiet_data()
    return False


def _quiet_data() -> None:
    ray.data.DataContext.get_current().enable_progress_bars = False


def check_resources(cfg: RayvlConfig, fixed_size: bool) -> None:
    """Ray Train workers must leave CPUs for Ray Data, else the pipeline starves silently. On a Ray we started
    ourselves the size is final, so too few CPUs is an error; a cluster may still autoscale, so a warning."""
    t, d = cfg.train, cfg.data
    total = ray.cluster_resources().get("CPU", 0)
    need = t.num_workers * t.cpus_per_worker + d.read_cpus
    if need > total:
        message = (f"train.num_workers × train.cpus_per_worker + data.read_cpus = {need:g} CPUs, but the cluster "
                   f"has {total:g}: Ray Data would starve. Lower train.cpus_per_worker or data.read_cpus.")
        if fixed_size:
            raise ConfigError(message)
        print(f"rayvl: warning: {message} (waiting for the autoscaler)")
    if t.use_gpu and ray.cluster_resources().get("GPU", 0) < t.num_workers:
        print(f"rayvl: waiting for {t.num_workers} GPUs (cluster has "
              f"{ray.cluster_resources().get('GPU', 0):g}; the autoscaler may add them)")


def check_storage(cfg: RayvlConfig, nodes: int | None = None) -> None:
    """Every node writes its workers' checkpoint shards to ``train.storage_path`` and the driver reads them back:
    on a cluster of several nodes a plain local path would scatter a run over the nodes' own disks."""
    if nodes is None:
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
    for key, path in (("train.storage_path", cfg.train.storage_path), ("tune.storage_path", cfg.tune.storage_path)):
        if nodes > 1 and storage.local_path(path) is not None and not cfg.train.shared_storage:
            raise ConfigError(f"{key}: {path!r} is on this machine's disk, but the cluster has {nodes} nodes: use "
                              f"object storage (s3://..., gs://...) or set train.shared_storage=true if it is a mount "
                              f"every node shares")
