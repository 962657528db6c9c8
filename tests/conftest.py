"""Shared fixtures: one real local Ray for the whole session (each start costs seconds and a GiB of memory), the
session's S3-compatible server, the demo data set, and the training runs several tests read."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
# as `make test` runs the suite (as in an activated venv: the Makefile puts the venv's bin first), also when pytest is
# called directly: the venv's `python` and `ray` in every process the suite starts
_VENV_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def worker_env() -> dict:
    """Every worker's environment: rayvl's, the test object store's settings (as a user sets S3's), and this folder
    on PYTHONPATH (workers unpickle train functions defined in test modules, so they must be able to import them)."""
    from rayvl.session import WORKER_ENV

    tests = os.path.dirname(os.path.abspath(__file__))
    return {**WORKER_ENV, **object_store_server().env,
            "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}


_store = None


def object_store_server():
    """The session's S3-compatible server (moto, with its fault injector; tests/object_store.py), started on first
    use — before any Ray of the session, whose workers reach it through the environment."""
    global _store
    if _store is None:
        import object_store

        _store = object_store.start()
    return _store


@pytest.fixture
def s3():
    """The object store, its faults cleared before and after the test."""
    store = object_store_server()
    store.faults.clear()
    yield store
    store.faults.clear()


# Ray Train's controller polls its workers every 2 s by default (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), and a worker's
# report waits until its previous one is polled: a toy run's steps would wait on the polls, not on the training.
# rayvl's own fits poll sooner (rayvl.session.report_polls); the session's Ray gives the fits a test makes itself
# the same (rayvl.session.REPORT_POLL). A test whose point is timing (a node lost mid-run, a sweep stopped mid-trial)
# sets Ray's 2 s for its run.
# a cluster's 0-CPU head (its drivers') starts two worker processes at a time: Ray gives a raylet min(cores, CPUs), at
# least 1 (ray/_private/services.py), and the raylet reads this setting over it; its raylets inherit it
HEAD_STARTS_TWO = {"RAY_worker_maximum_startup_concurrency": "2"}


def start_session_ray():
    import ray

    from rayvl.session import LOCAL_RAY_ENV, REPORT_POLL, local_worker_env

    # 4 logical CPUs on 2 cores: 2 train workers × 0.5 CPU leave room for Ray Data tasks (DESIGN: starvation);
    # the workers' environment as rayvl gives a local Ray its own (no runtime_env: workers start sooner)
    with local_worker_env({**worker_env(), **dict([REPORT_POLL]), **LOCAL_RAY_ENV}):
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


@pytest.fixture(scope="session")
def ray_local():
    import ray

    yield ray if ray.is_initialized() else start_session_ray()
    ray.shutdown()


# the suite's layers (`pytest -m unit` is `make test-fast`); ray and multinode are told from the fixtures a test
# uses, a test that starts Ray in a process of its own says so with @pytest.mark.ray, a slow one with slow
LAYERS = {"unit": "no Ray, nothing slow: the fast layer (make test-fast)",
          "ray": "uses the session's local Ray, or starts a Ray (in a process it runs)",
          "multinode": "runs Ray clusters of its own: several raylets, an autoscaler",
          "slow": "a unit test of more than about 5 s on 2 cores (a fresh process, a model compiled or at real size)"}


def pytest_configure(config):
    for name, what in LAYERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(items):
    """Each test's layer (LAYERS). Modules that run Ray clusters of their own (no_session_ray) run after the others:
    the session's Ray is then shut down once, instead of being started again — and its worker processes warmed up
    again by the next test that reads data — after each of them."""
    for item in items:
        if "no_session_ray" in item.fixturenames:
            item.add_marker(pytest.mark.multinode)
        elif "ray_local" in item.fixturenames:
            item.add_marker(pytest.mark.ray)
        if not any(item.get_closest_marker(m) for m in ("ray", "multinode", "slow")):
            item.add_marker(pytest.mark.unit)
    own = {item.module for item in items if "no_session_ray" in item.fixturenames}
    items[:] = [i for i in items if i.module not in own] + [i for i in items if i.module in own]


@pytest.fixture(autouse=True)
def _a_unit_test_starts_no_ray(request):
    """The unit layer stays without Ray: a unit test that leaves a Ray started in this process fails, naming the
    marker it needs (checked where Ray was not up before it: always under `make test-fast`)."""
    if request.node.get_closest_marker("unit") is None or "ray" in sys.modules and _ray_up():
        yield
        return
    yield
    if "ray" in sys.modules and _ray_up():
        import ray

        ray.shutdown()  # so that the tests after it are checked too
        pytest.fail(f"{request.node.nodeid} starts Ray: mark it @pytest.mark.ray (tests/conftest.py, LAYERS)")


@pytest.fixture(autouse=True)
def _actors_end_with_their_test():
    """The actors a test started itself end with it, as a run's end with the run (rayvl.train.trainer): its data
    reports (rayvl.data.report.create_report), and the controller of a TorchTrainer it fit itself, which Ray Train's
    Ctrl-C handler would hold until the next fit. An idle actor left on the session's Ray costs every later test
    some CPU."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)
    report = sys.modules.get("rayvl.data.report")
    if report is not None and _ray_up():
        report.release_reports()


def _ray_up() -> bool:
    import ray

    return ray.is_initialized()


@pytest.fixture(scope="module")
def no_session_ray(request):
    """For a module that runs clusters of its own: the session's Ray is shut down before and started again after
    (a driver connects to one Ray at a time) — if a later test uses it."""
    import ray

    was_running = ray.is_initialized()
    ray.shutdown()
    yield
    ray.shutdown()
    items = request.session.items
    last = max(i for i, item in enumerate(items) if item.module is request.module)
    if was_running and any("ray_local" in item.fixturenames and "no_session_ray" not in item.fixturenames
                           for item in items[last + 1:]):
        start_session_ray()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    from rayvl.data.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("demo"), samples=384, eval_samples=64, seed=0, shard_size=128)


def cli(capsys, *argv) -> tuple[int, str, str]:
    """`rayvl ARGV` in this process: (exit code, stdout, stderr)."""
    from rayvl.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def small_config(demo_dir, tmp_path, *overrides):
    """A laion_adapt config that trains 2 workers for a few steps on the small demo set."""
    from rayvl.config import load_config

    base = [
        f"data.train={demo_dir / 'train'}", f"data.eval={demo_dir / 'eval'}",
        f"data.classes={demo_dir / 'classes.json'}", f"data.paraphrases={demo_dir / 'paraphrases.jsonl'}",
        f"data.sts={demo_dir / 'sts.tsv'}", "data.image_size=32", "data.max_text_tokens=16",
        "train.micro_batch_size=8", "train.max_steps=3", "train.warmup_steps=1", "train.log_every=1",
        "train.checkpoint_every=2", f"train.storage_path={tmp_path}", "train.run_name=run",
        "model.alignment_layers=1", "model.embed_dim=64", "eval.batch_size=32", "train.report_to=[tensorboard]",
    ]
    return load_config(REPO / "configs" / "laion_adapt.yaml", base + list(overrides))


# [UniCL] App. B.2 at toy size: every micro-batch half image-label rows (Fashion-MNIST prompts of 4 training
# classes), against a memory bank of 32 keys in bf16 (at ZeRO-0 on CPU: torch autocast over fp32 weights, the layout
# a GPU user gets first); deterministic, so that its seed fixes its loss curve
UNICL_MIXED = ["image_label.data=fashion-mnist", "image_label.train_classes=[0, 2, 4, 6]", "image_label.limit=1000",
               "loss.kind=unicl", "image_label.weight=0.5", "memory_bank.size=32", "train.precision=bf16",
               "eval.tasks=[retrieval]", "data.deterministic=true", "train.checkpoint_every=100"]


def tonics_shapes(*more: str) -> list[str]:
    """TOnICS on the demo's shapes (its classes; each holds ≥ 9 % of the demo's rows, so min_instances 20 keeps every
    one), then ``more`` overrides."""
    import json

    from rayvl.data.demo import SHAPES

    return ["tonics.enabled=true", f"tonics.classes={json.dumps(SHAPES)}", "tonics.min_instances=20", *more]


@pytest.fixture(scope="session")
def unicl_mixed_run(ray_local, demo_dir, tmp_path_factory):
    """The RunResult of one UNICL_MIXED run of seed 0 (3 steps), read by test_unicl (what the mixed batches
    trained on) and trained again by test_seeds (the same seed, the same loss curve)."""
    from rayvl.train.trainer import train

    cfg = small_config(demo_dir, tmp_path_factory.mktemp("unicl"), *UNICL_MIXED, "train.seed=0")
    return train(cfg, verbose=False)


@pytest.fixture(scope="session")
def tonics_counts_path(tmp_path_factory) -> str:
    """tonics.counts_path for the session's TOnICS runs on the demo's shapes: the first of them counts the rows
    per shape (a Ray Data pass), the others reuse that artifact (test_tonics checks the counting and the reuse)."""
    return str(tmp_path_factory.mktemp("tonics") / "tonics_counts.json")


def untrained_checkpoint(demo_dir, tmp_path, seed: int = 0, name: str = "model") -> Path:
    """The run directory ``tmp_path/name`` holding one checkpoint (consolidated weights + config) of an untrained
    small_config model of ``seed``: a model to load, label with or init a run from."""
    import json

    import torch

    from rayvl.checkpoints import META_FILE, MODEL_FILE
    from rayvl.models.dual_encoder import build_model

    d = tmp_path / name / "checkpoint_000000"
    d.mkdir(parents=True)
    cfg = small_config(demo_dir, tmp_path)
    torch.save(build_model(cfg.model, seed=seed).state_dict(), d / MODEL_FILE)
    (d / META_FILE).write_text(json.dumps({"step": 0, "config": cfg.to_dict(), "final": True}))
    return d.parent


def fit_in_task(config: dict, env: dict | None = None, **options):
    """fit() in a CPU-less task, as `ray job submit` runs a driver; ``env`` is added to the environment of the
    task and so of the run's controller and workers (e.g. RAYVL_FAIL_AT)."""
    import ray

    runtime_env = {"env_vars": {**worker_env(), **(env or {})}}
    return ray.remote(num_cpus=0, max_retries=0, runtime_env=runtime_env, **options)(_fit).remote(config)


def _fit(config: dict):
    from rayvl.config import from_dict
    from rayvl.train.trainer import train

    return train(from_dict(config))


# Modules whose point is what two ranks compute define two_ranks(out_dir) and read its files through the
# two_rank_checks fixture: the selected modules' checks run in one 2-worker Ray Train fit (each fit starts 7
# processes; a check needs no fit of its own), one after the other.
TWO_RANKS = "two_ranks"


def _run_two_rank_checks(config: dict) -> None:
    import importlib
    import traceback

    import ray.train

    rank = ray.train.get_context().get_world_rank()
    for module in config["modules"]:
        out = Path(config["out"]) / module
        try:
            getattr(importlib.import_module(module), TWO_RANKS)(str(out))
        except Exception:
            (out / f"error{rank}.txt").write_text(traceback.format_exc())
            raise  # the fit ends: the other rank may be waiting in a collective of this check
        (out / f"done{rank}").touch()


@pytest.fixture(scope="session")
def two_rank_checks(request, ray_local, tmp_path_factory):
    """The folder of each module's two_ranks files (``folder / module_name``), from one fit of every selected
    module's check. A failed fit is each test's failure (two_rank_files), not the fixture's."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    modules = sorted({item.module.__name__ for item in request.session.items
                      if "two_rank_checks" in item.fixturenames})
    out = tmp_path_factory.mktemp("two_ranks")
    for module in modules:
        (out / module).mkdir()
    try:
        TorchTrainer(_run_two_rank_checks, train_loop_config={"modules": modules, "out": str(out)},
                     scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                     run_config=RunConfig(storage_path=str(out / "ray"), name="two_ranks")).fit()
    except Exception as e:  # noqa: BLE001 — said by the tests whose checks it stopped
        (out / "fit_error.txt").write_text(f"{type(e).__name__}: {e}")
    return out


def two_rank_files(folder: Path, module: str) -> Path:
    """A module's two_ranks folder, once its check ran to its end on both ranks."""
    errors = sorted((folder / module).glob("error*.txt"))
    if errors:
        pytest.fail(f"{module}.{TWO_RANKS} raised:\n" + "\n".join(e.read_text() for e in errors))
    if not all((folder / module / f"done{rank}").is_file() for rank in (0, 1)):
        fit = folder / "fit_error.txt"
        pytest.fail(f"{module}.{TWO_RANKS} did not run on both ranks: the fit ended before it: "
                    + (fit.read_text() if fit.is_file() else "no error recorded"))
    return folder / module


def free_port() -> int:
    """A TCP port of 127.0.0.1 no process listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process_group():
    """A real gloo process group of this one process (DeepSpeed and the collectives' callers need one)."""
    import torch.distributed as dist

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    import torch

    # a ZeRO-3 engine built in this process left DeepSpeed's memory-efficient linear in torch ("this will persist
    # unless manually reset"): later modules' models get torch's own again
    torch.nn.functional.linear = torch._C._nn.linear
    if "deepspeed.comm" in sys.modules and sys.modules["deepspeed.comm"].is_initialized():
        # DeepSpeed caches the groups it made from this one (its data-parallel group): destroyed through DeepSpeed,
        # they are forgotten too, and the next module's DeepSpeed does not look them up in a new group
        sys.modules["deepspeed.comm"].destroy_process_group()
    else:
        dist.destroy_process_group()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def run_card_snippet(snippet: str, folder: Path) -> dict:
    """An export card's code run as a user runs it, in ``folder`` with the two photos it opens (cat.jpg, dog.jpg:
    JPEGs of different sizes and aspect ratios, so the crop matters); its namespace."""
    import os

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, (h, w) in (("cat.jpg", (50, 80)), ("dog.jpg", (90, 40))):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    here = os.getcwd()
    os.chdir(folder)
    try:
        namespace: dict = {}
        exec(snippet, namespace)
        return namespace
    finally:
        os.chdir(here)
