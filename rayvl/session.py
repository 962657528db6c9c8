"""The Ray session of a driver: join a cluster or start a local Ray, with the environment every worker needs, check
that the CPUs asked for leave room for Ray Data, and read how large the cluster can grow."""
from __future__ import annotations

import contextlib
import logging
import os

import ray

from rayvl import plugins, storage
from rayvl.config import ConfigError, RayvlConfig

# no hub at run time, quiet tokenizers and Ray Data (per-operator progress bars flood job logs)
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "TRANSFORMERS_VERBOSITY": "error", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
# a Ray of this machine alone: no cloud drains its node, so no run starts Ray Train's preemption watcher (an actor
# process of its own a run, at start-up and while it idles)
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# Ray Train's controller takes one report of each worker every time it polls them, every
# RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default: 2 s), and a worker's ray.train.report waits while its previous
# report is unpolled (a queue of one): at Ray's default, a run whose reports come faster than one per 2 s trains
# train.log_every steps per 2 s whatever its step time. rayvl's fits poll at REPORT_POLL's interval unless the
# environment sets one (a user's value wins); docs/benchmarks.md has the measurement.
REPORT_POLL = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


def connect(address: str = "", num_cpus: int = 0, verbose: bool = True, **init_kwargs) -> bool:
    """Join a cluster (``address``, RAY_ADDRESS, or a `ray job submit` driver's) or start a local Ray; True if this
    call started a local Ray (whose size is then final). Does nothing when Ray is already initialised.
    ``verbose=False``: the workers' and Ray's own output stay in Ray's log files (``/tmp/ray/session_latest/logs``)
    — a training job's terminal shows rayvl's progress lines, warnings and errors."""
    if not verbose:
        init_kwargs = {"log_to_driver": False, "logging_level": logging.ERROR, **init_kwargs}
    if not ray.is_initialized():
        address = cluster_address(address)
        if address:
            ray.init(address=address, **{"log_to_driver": True, **init_kwargs})
        else:
            # "local": a fresh Ray even if a `ray start` cluster runs on this machine; joining one is explicit
            with local_worker_env({**WORKER_ENV, **LOCAL_RAY_ENV}):
                ray.init(address="local", num_cpus=num_cpus or None, **init_kwargs)
            _quiet_data()
            return True
    _quiet_data()
    return False


def report_polls():
    """Around a fit(): Ray Train's poll interval (REPORT_POLL) in this process's environment unless it is set there,
    restored after (local_worker_env's set and restore). Ray Train passes the variable from the process that calls
    fit() to the run's controller and workers, on a local Ray and on a cluster alike."""
    key, value = REPORT_POLL
    return local_worker_env({} if key in os.environ else {key: value})


@contextlib.contextmanager
def local_worker_env(env: dict[str, str]):
    """The environment of every worker of a local Ray this block starts: set in this process while ``ray.init``
    starts the raylet, whose worker processes inherit it, and restored after. A job-level ``runtime_env`` would
    give the workers the same variables, but then every worker process starts through Ray's runtime-env setup
    (``setup_worker.py``, a Python process that imports Ray before the worker's own) and none of the workers Ray
    prestarts at ``ray.init`` serves the job: each actor and task process starts later and costs more CPU. A
    cluster's workers get the environment as a runtime_env (`ray job submit`, ``rayvl.checks``)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def planned_local_cpus(cfg: RayvlConfig) -> float | None:
    """The CPUs of the local Ray that ``connect`` will start (``local_num_cpus``), known before it starts; None
    when it joins a running Ray or a cluster, or when Ray will count this machine's CPUs itself."""
    if ray.is_initialized() or cluster_address(cfg.ray_address) or not cfg.local_num_cpus:
        return None
    return float(cfg.local_num_cpus)


def runs_without_ray(actors: int, gpus_per_actor: float, address: str = "") -> bool:
    """Whether a command whose work is one model (`rayvl eval`, `rayvl pseudo-label`) runs on this machine with no
    Ray: no cluster named (``address``, RAY_ADDRESS), no Ray running in this process, and one model — one actor on
    CPU (``actors`` 0 or 1) or, with GPUs (at most one an actor), on a machine where torch sees exactly one GPU.
    Ray would only add processes to start on the CPUs that decode (its raylet, an actor importing torch and the
    model again, Ray Data's read tasks) before the first image; several models, several GPUs (which a process of
    its own would all see: Ray gives each actor its own) or a cluster keep Ray."""
    if cluster_address(address) or ray.is_initialized() or actors > 1 or gpus_per_actor > 1:
        return False
    if not gpus_per_actor:
        return True
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() == 1


def cluster_address(address: str = "") -> str:
    """The Ray ``connect`` joins ('' = it starts a local one): ``address``, else RAY_ADDRESS."""
    return address or os.environ.get("RAY_ADDRESS", "")


def _quiet_data() -> None:
    ray.data.DataContext.get_current().enable_progress_bars = False


def setup_logging(verbose: bool) -> None:
    """rayvl's own lines (logger ``rayvl``) on the terminal; unless ``verbose``, the driver's known-harmless chatter
    off: Ray's start-up notices, Ray Data's per-execution INFO lines, faiss's loader, transformers' and DeepSpeed's
    notices, the libraries' deprecation warnings."""
    import warnings

    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.WARNING)
    logging.getLogger("rayvl").setLevel(logging.INFO)
    if verbose:
        return
    for name in ("ray", "ray.data", "ray.train", "ray.tune", "faiss", "faiss.loader", "transformers", "mlflow",
                 "alembic"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # DeepSpeed sets its logger's level when imported (later): a filter outlives that ("Setting accelerator to CPU")
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def check_resources(cfg: RayvlConfig, fixed_size: bool, node_cpus: list[float] | None = None) -> None:
    """Ray Train workers must leave CPUs for Ray Data on some node, else the pipeline starves silently: the
    workers are placed on the nodes as ``train.placement_strategy`` places them, and every concurrent pipeline
    (the training stream, a method's own streams) needs one read task of ``data.read_cpus`` in what is left. On a Ray we
    started ourselves the size is final, so a pipeline that cannot run is an error before anything starts; a
    cluster may still autoscale, so there it is a warning."""
    t, d = cfg.train, cfg.data
    if node_cpus is None:
        node_cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]]
    free = place_workers(node_cpus, t.num_workers, t.cpus_per_worker, t.placement_strategy)
    pipelines = 1 + plugins.extra_streams(cfg)  # the training stream, and the streams the methods read beside it
    problem = ""
    if free is None:
        problem = (f"train.num_workers={t.num_workers} workers of train.cpus_per_worker={t.cpus_per_worker:g} CPUs "
                   f"do not fit train.placement_strategy={t.placement_strategy} on nodes with {_cpus(node_cpus)} CPUs")
    elif place_workers(free, pipelines, d.read_cpus, "PACK") is None:  # read tasks are bundles of one size too
        problem = (f"after train.num_workers={t.num_workers} × train.cpus_per_worker={t.cpus_per_worker:g} CPUs "
                   f"(train.placement_strategy={t.placement_strategy}) the nodes have {_cpus(free)} CPUs free, but "
                   f"{pipelines} Ray Data pipeline(s) need a read task of data.read_cpus={d.read_cpus:g} each: Ray "
                   f"Data would starve. Lower train.cpus_per_worker or data.read_cpus, or add nodes.")
    if problem:
        if fixed_size:
            raise ConfigError(problem)
        print(f"rayvl: warning: {problem} (waiting for the autoscaler)")


def check_local_gpus(cfg: RayvlConfig) -> None:
    """Before a local Ray starts: ``train.use_gpu`` on a machine whose torch sees fewer GPUs than workers (none at
    all, or a CPU build of torch) is an error here, not a run waiting forever for GPUs no node will bring."""
    t = cfg.train
    if not t.use_gpu or cfg.ray_address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        return  # a cluster's GPUs are on its nodes (check_gpus); a Tune trial's driver holds none itself
    import torch

    seen = torch.cuda.device_count()
    if seen < t.num_workers:
        raise ConfigError(
            f"train.use_gpu: train.num_workers={t.num_workers} GPU workers, but this machine's torch "
            f"{torch.__version__} (CUDA {torch.version.cuda or 'none'}) sees {seen} GPU(s) and no cluster is named "
            f"(ray_address / RAY_ADDRESS): " + ("install the GPU stack (`make install GPU=1`)" if torch.version.cuda
                                                is None else "lower train.num_workers or join a cluster"))


def check_gpus(cfg: RayvlConfig, fixed_size: bool, grown: tuple[dict, bool] | None = None) -> None:
    """``train.use_gpu`` on a Ray that cannot bring the workers' GPUs is an error before any worker starts: a Ray
    started here, a cluster whose autoscaler cannot grow to them, or a cluster with no GPU and no autoscaler
    config on this node — unless ``train.wait_for_gpus`` says an autoscaler rayvl cannot read (KubeRay's) adds
    them. ``grown``: (resources the cluster can grow to, whether an autoscaler config said so), as
    ``largest_cluster`` returns it."""
    t = cfg.train
    if not t.use_gpu:
        return
    largest, autoscaled = grown if grown is not None else largest_cluster()
    have = largest.get("GPU", 0.0)
    if have >= t.num_workers:
        return
    where = ("the local Ray has" if fixed_size else "the cluster can grow to" if autoscaled else "the cluster has")
    problem = f"train.use_gpu: train.num_workers={t.num_workers} workers need a GPU each, {where} {have:g} GPU(s)"
    if fixed_size or autoscaled or (have == 0 and not t.wait_for_gpus):
        raise ConfigError(problem + ("" if fixed_size or autoscaled else "; if an autoscaler rayvl cannot read "
                                     "(KubeRay) adds GPU nodes on demand, set train.wait_for_gpus=true"))
    print(f"rayvl: warning: {problem}; waiting for nodes to join")


def place_workers(node_cpus: list[float], workers: int, cpus: float, strategy: str) -> list[float] | None:
    """CPUs left per node (the largest first) after placing the workers' bundles as Ray would (place_bundles), or
    None when they do not fit."""
    free = place_bundles([{"CPU": c} for c in sorted(node_cpus, reverse=True)], [{"CPU": cpus}] * workers, strategy)
    return None if free is None else [node["CPU"] for node in free]


def place_bundles(nodes: list[dict[str, float]], bundles: list[dict[str, float]],
                  strategy: str, on: int | None = None) -> list[dict[str, float]] | None:
    """What each node has left after placing one placement group's ``bundles`` (every resource: CPU, GPU, custom
    ones) as Ray would — PACK onto the nodes already used first, SPREAD deals them out, STRICT_PACK puts them all
    on one node, STRICT_SPREAD each on a node of its own; a bundle without GPUs kept off GPU nodes where another
    holds it (Ray's scheduler avoids GPU nodes for such work); ``on``: on that node only — or None when they do not
    fit."""
    free = [dict(node) for node in nodes]
    if strategy == "STRICT_PACK" and bundles:
        bundles = [{k: sum(b.get(k, 0.0) for b in bundles) for k in {k for b in bundles for k in b}}]
    spread = strategy.endswith("SPREAD")
    used = [0] * len(free)
    for bundle in bundles:
        avoid_gpus = not bundle.get("GPU")
        order = sorted(range(len(free)), key=lambda i: (
            used[i] if spread else -used[i], avoid_gpus and nodes[i].get("GPU", 0.0) > 0, -_room(free[i], bundle)))
        node = next((i for i in order if all(free[i].get(k, 0.0) >= v - 1e-9 for k, v in bundle.items())
                     and not (strategy == "STRICT_SPREAD" and used[i]) and on in (None, i)), None)
        if node is None:
            return None
        for k, v in bundle.items():
            free[node][k] = free[node].get(k, 0.0) - v
        used[node] += 1
    return free


def _room(node: dict[str, float], bundle: dict[str, float]) -> float:
    """How many such bundles the node still holds."""
    return min((node.get(k, 0.0) / v for k, v in bundle.items() if v > 0), default=float("inf"))


def _cpus(values: list[float]) -> str:
    return "/".join(f"{v:g}" for v in values)


def check_storage(cfg: RayvlConfig, nodes: int | None = None, key: str = "train.storage_path",
                  grows: bool = False) -> None:
    """Every node writes its workers' checkpoint shards to the run's storage and the driver reads them back: on a
    cluster of several nodes — or of one node now whose autoscaler may add more (cluster.yaml's GPU workers start
    from 0; ``grows``, read from the autoscaler's config when ``nodes`` is not given) — a plain local path would
    scatter a run over the nodes' own disks, and Ray Train's workers fail at their first checkpoint. ``key``: the
    storage the command writes — a training run's ``train.storage_path``, a sweep's ``tune.storage_path`` (its
    trials' runs go under it, whatever train.storage_path says)."""
    if nodes is None:
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        config = autoscaler_config() if nodes <= 1 else None
        grows = config is not None and any(most > 0 for _, most in _worker_types(config))
    if nodes <= 1 and not grows or cfg.train.shared_storage:
        return
    where = f"the cluster has {nodes} nodes" if nodes > 1 else \
        "the cluster's autoscaler may add nodes (its config has worker node types)"
    path = cfg.train.storage_path if key == "train.storage_path" else cfg.tune.storage_path
    if storage.local_path(path) is not None:
        raise ConfigError(f"{key}: {path!r} is on this machine's disk, but {where}: use object storage "
                          f"(s3://..., gs://...), or set train.shared_storage=true if it is a mount every node "
                          f"shares")
    # weights every worker reads (rayvl.models.whole_clip.local, rayvl.assets.vision_state_dict)
    for name in ("init_from_clip", "vision_checkpoint"):
        weights = getattr(cfg.model, name)
        if weights and storage.local_path(weights) is not None:
            raise ConfigError(f"model.{name}: {weights!r} is on this machine's disk, but {where} and every "
                              f"worker reads it: give its weights file on object storage (s3://..., gs://...; each "
                              f"node copies it once), or set train.shared_storage=true if the path is on a mount every "
                              f"node shares")


def largest_cluster() -> tuple[dict[str, float], bool]:
    """The resources the cluster can grow to and whether an autoscaler's config said so (largest_nodes' totals)."""
    _, totals, autoscaled = largest_nodes()
    return totals, autoscaled


def largest_nodes() -> tuple[list[dict[str, float]], dict[str, float], bool]:
    """The nodes the cluster can grow to, each with its resources (grown_nodes), their totals (grown_resources,
    within the cluster's max_workers, which the list of nodes leaves out) and whether an autoscaler's config said
    so; without an autoscaler config on this node, the nodes the cluster has now."""
    config = autoscaler_config()
    alive = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if config is None:
        return alive, ray.cluster_resources(), False
    head = next(resources for resources in alive if "node:__internal_head__" in resources)
    return grown_nodes(config, head), grown_resources(config, head), True


def grown_nodes(config: dict, head: dict[str, float]) -> list[dict[str, float]]:
    """The head and every worker type of an autoscaler config at its max_workers, node by node (the cluster's own
    max_workers not applied: which types it leaves out is the autoscaler's choice)."""
    return [dict(head)] + [dict(resources) for resources, most in _worker_types(config) for _ in range(most)]


def grown_resources(config: dict, head: dict[str, float]) -> dict[str, float]:
    """The head's resources plus every worker type of an autoscaler config at its max_workers, within the cluster's
    max_workers: for each resource the types richest in it first (a bound: one resource's best mix of node types
    may not be another's)."""
    total = dict(head)
    workers = _worker_types(config)
    for key in {k for resources, _ in workers for k in resources}:
        nodes_left = config.get("max_workers", sum(most for _, most in workers))
        for resources, most in sorted(workers, key=lambda w: -w[0].get(key, 0)):
            n = min(most, nodes_left)
            total[key] = total.get(key, 0.0) + n * resources.get(key, 0)
            nodes_left -= n
    return total


def _worker_types(config: dict) -> list[tuple[dict[str, float], int]]:
    """(resources, max_workers) of each worker node type of an autoscaler config."""
    return [(t.get("resources") or {}, t.get("max_workers", 0))
            for name, t in config["available_node_types"].items() if name != config["head_node_type"]]


def autoscaler_config() -> dict | None:
    """The cluster config this cluster's autoscaler runs with (on a `ray up` head, ~/ray_bootstrap_config.yaml, its
    node types' resources filled in from the instance types), read where the head's monitor process was told to
    read it; None where this node runs no autoscaler of this cluster (a local Ray, a fixed `ray start` cluster, a
    driver on a worker node). Ray 2.60 gives a driver no public API for it, and its GCS holds none for a `ray up`
    cluster."""
    import psutil
    import yaml

    gcs = f"--gcs-address={ray.get_runtime_context().gcs_address}"
    for process in psutil.process_iter(["cmdline"]):
        args = process.info["cmdline"] or []
        if gcs in args and any(a.endswith("monitor.py") for a in args):
            path = next((a.split("=", 1)[1] for a in args if a.startswith("--autoscaling-config=")), "")
            if path and os.path.isfile(os.path.expanduser(path)):
                with open(os.path.expanduser(path)) as f:
                    return yaml.safe_load(f)
    return None
