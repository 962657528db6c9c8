"""rayvl from any checkout, started any way: a checkout and an install made under ``umask 002`` (group-writable
folders, which nltk refuses to read), and a process without the venv's ``bin/`` on PATH and with a fresh extensions
cache (which compiled DeepSpeed's CPU communication op, or waited on its lock)."""
import os
import stat
import subprocess
import sys

import pytest

from conftest import REPO

# the job test starts a Ray of its own (a job's working directory is a driver's runtime_env): after the session's
pytestmark = pytest.mark.usefixtures("no_session_ray")

GROUP_WRITABLE = """
import nltk, sys
sys.path.insert(0, {package!r})
nltk.data.path.insert(0, {resources!r})
try:
    nltk.corpus.stopwords.words("english")
except LookupError:
    print("nltk refuses it")
"""
READ = """
from rayvl.data.text import stopwords
from rayvl.data.wordnet import wordnet
print(len(stopwords()), wordnet().synsets("puppy")[0].name())
"""


def _under_umask_002(command: str) -> None:
    subprocess.run(["sh", "-c", f"umask 002 && {command}"], check=True, capture_output=True, timeout=300)


def test_a_checkout_and_install_under_umask_002_read_stopwords_and_wordnet_through_private_copies(tmp_path):
    """A `git clone` and an install (the install's own copy: new files, as `rayvl assets fetch` writes them) under
    umask 002: folders 775, files 664, which nltk refuses — and rayvl reads through owner-only copies."""
    from rayvl import assets

    checkout, installed, cache = tmp_path / "checkout", tmp_path / "assets", tmp_path / "cache"
    _under_umask_002(f"git clone -q {REPO} {checkout}")
    _under_umask_002(f"{sys.executable} -c \"import shutil; shutil.copytree('{assets.require_wordnet()}', "
                     f"'{installed / 'nltk_data'}', copy_function=shutil.copyfile)\"")
    assert (checkout / "rayvl" / "resources" / "nltk_data").stat().st_mode & stat.S_IWGRP  # as a user's clone is
    env = {**os.environ, "PYTHONPATH": str(checkout), "RAYVL_ASSETS": str(installed), "XDG_CACHE_HOME": str(cache)}
    resources = checkout / "rayvl" / "resources" / "nltk_data"
    refused = subprocess.run([sys.executable, "-c", GROUP_WRITABLE.format(package=str(checkout),
                                                                          resources=str(resources))],
                             env=env, capture_output=True, text=True, timeout=120)
    assert refused.stdout.strip() == "nltk refuses it", refused.stderr[-2000:]  # what a user of such a checkout met
    for _ in range(2):  # the copies are made once, then read as they are
        read = subprocess.run([sys.executable, "-c", READ], env=env, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert read.returncode == 0, read.stderr[-3000:]
        assert read.stdout.split() == ["179", "puppy.n.01"]
    copies = [p for p in (cache / "rayvl" / "private").iterdir() if p.is_dir()]
    assert sorted(p.name.rsplit("-", 1)[0] for p in copies) == ["nltk_data", "nltk_data"]  # nothing staged left
    for path in [*copies, *(x for p in copies for x in p.rglob("*"))]:
        assert not path.lstat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), path


def test_a_run_without_the_venv_on_path_and_with_a_fresh_extensions_cache_compiles_nothing(tmp_path):
    """rayvl's engine (build_engine, what every training worker builds) and a step, in a process whose PATH has no
    venv and whose torch extensions cache is empty: it trains, and the cache stays empty."""
    extensions = tmp_path / "torch_extensions"
    env = {**os.environ, "PATH": "/usr/bin:/bin", "TORCH_EXTENSIONS_DIR": str(extensions)}
    code = ("import rayvl.checks.census as sc; "
            "step, engine = sc.rayvl_step(sc.config(0, 'fp32')); step(); step(); print('trained', engine.global_steps)")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained 2" in run.stdout and "built successfully" not in run.stdout + run.stderr
    assert not extensions.exists() or not any(extensions.rglob("*"))


JOB = """
import os, ray
ray.init(address="local", num_cpus=1, include_dashboard=False,
         runtime_env={{"working_dir": {checkout!r}, "env_vars": {{"XDG_CACHE_HOME": {cache!r}}}}})

@ray.remote
def read():
    import rayvl
    from rayvl.data.text import stopwords
    return rayvl.__file__, len(stopwords())

print(*ray.get(read.remote()))
"""


def test_a_jobs_working_directory_unpacked_by_ray_reads_the_stopwords(tmp_path):
    """What `ray job submit --working-dir .` does with a checkout made under umask 002: Ray zips it, unpacks it on
    the node, and its tasks import rayvl from there — which reads the stopwords (through a private copy where the
    unpacked folders are not private)."""
    checkout, cache = tmp_path / "checkout", tmp_path / "cache"
    _under_umask_002(f"git clone -q {REPO} {checkout}")
    run = subprocess.run([sys.executable, "-c", JOB.format(checkout=str(checkout), cache=str(cache))],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})  # a Ray of its own
    assert run.returncode == 0, run.stderr[-3000:]
    imported, words = run.stdout.split()[-2:]
    assert "runtime_resources/working_dir_files" in imported and words == "179"
