"""`make install` and `make install GPU=1` read without installing anything: the commands `make -n` prints for a copy
of the Makefile, the extras they name and the constraint file every pip call gets. Exactly one faiss in either
build (faiss-cpu and faiss-gpu-cu12 are the same package `faiss`, the last one installed wins), torch's CPU build
pinned by constraints.txt, its CUDA 12 build — the CUDA faiss-gpu-cu12 is built for — from PyTorch's index, pinned
by constraints-cuda.txt. Then what the install's Debian assets say when they are missing."""

import re
import shutil
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from conftest import REPO
from rayvl import assets

FILES = ("Makefile", "pyproject.toml", "constraints.txt", "constraints-cuda.txt")
FAISS = {"faiss-cpu", "faiss-gpu-cu12"}  # the distributions that install the package `faiss`


@pytest.fixture
def checkout(tmp_path):
    """The install's files in a fresh folder: no .venv/, so make plans a first install."""
    for name in FILES:
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def fake_command(folder, name: str, script: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{script}\n")
    (folder / name).chmod(0o755)


def make(checkout, *args, path_first=None) -> subprocess.CompletedProcess:
    env = {"PATH": f"{path_first}:/usr/bin:/bin" if path_first else "/usr/bin:/bin", "HOME": str(checkout)}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=60)


def plan(checkout, *args, path_first=None) -> list[str]:
    """The commands a first `make install` runs, printed (-n) and not run; -B: whatever is already there."""
    r = make(checkout, "-n", "-B", "install", *args, path_first=path_first)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if line and not line.startswith("#")]


def pip_constraint(checkout, *args) -> str:
    """PIP_CONSTRAINT as the recipes' shells see it (the Makefile exports it)."""
    r = make(checkout, "--eval", 'pip-env: ; @echo "$$PIP_CONSTRAINT"', "pip-env", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def pip_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if " -m pip install " in c]


def extras_installed(commands: list[str]) -> list[str]:
    found = [m.group(1) for c in pip_installs(commands) for m in [re.search(r'-e "\.\[([^]]*)\]"', c)] if m]
    assert len(found) == 1, commands  # rayvl itself, once
    return found[0].split(",")


def faiss_distributions(extras: list[str]) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {Requirement(r).name for r in requirements} & FAISS


def constraints(name: str) -> dict[str, SpecifierSet]:
    lines = (REPO / name).read_text().splitlines()
    return {(r := Requirement(line)).name: r.specifier for line in lines if line and not line.startswith("#")}


def cuda_label() -> str:
    """The CUDA build constraints-cuda.txt pins, as PyTorch names its index: "cu126"."""
    (torch,) = constraints("constraints-cuda.txt")["torch"]
    return torch.version.split("+")[1]


def test_the_extras_offer_faiss_cpu_and_faiss_gpu_as_alternatives_and_nothing_else_brings_faiss():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert faiss_distributions(["cpu"]) == {"faiss-cpu"} and faiss_distributions(["gpu"]) == {"faiss-gpu-cu12"}
    assert not faiss_distributions([name for name in extras if name not in ("cpu", "gpu")])  # base, dev, bench


def test_the_cpu_install_takes_faiss_cpu_and_cpu_torch_under_constraints_txt(checkout):
    commands = plan(checkout)
    assert faiss_distributions(extras_installed(commands)) == {"faiss-cpu"}
    assert not any("--index-url" in c for c in commands)  # torch comes from the registry, as before
    assert any("--no-deps torchvision==0.28.0" in c for c in commands)  # rayvl/compat.py's case
    # DeepSpeed's CPU communication op is built by nobody (rayvl.train.engine.no_cpu_comm_op): not by the install
    assert not any("build_shm_op" in c for c in commands)
    assert pip_constraint(checkout) == str(checkout / "constraints.txt")
    assert constraints("constraints.txt") == {"torch": SpecifierSet("==2.13.0")}
    assert plan(checkout, "GPU=0", "FAISS=gpu") == commands  # FAISS= only chooses among GPU builds


@pytest.mark.parametrize("faiss", ["gpu", "cpu"])
def test_the_gpu_install_takes_one_faiss_and_torch_built_for_cuda_12_from_pytorchs_index(checkout, faiss):
    commands = plan(checkout, "GPU=1", f"FAISS={faiss}")
    assert faiss_distributions(extras_installed(commands)) == {f"faiss-{faiss}" + ("-cu12" if faiss == "gpu" else "")}
    (torch_install,) = [c for c in pip_installs(commands) if "--index-url" in c]
    index = re.search(r"--index-url (\S+)", torch_install).group(1)
    assert index == f"https://download.pytorch.org/whl/{cuda_label()}" and cuda_label().startswith("cu12")
    assert "torch==2.13.0" in torch_install and "torchvision==0.28.0" in torch_install  # with its CUDA deps
    assert pip_installs(commands)[0] == torch_install  # before anything that depends on torch
    assert not any("--no-deps" in c or "build_shm_op" in c for c in commands)  # GPUs reduce through NCCL
    assert pip_constraint(checkout, "GPU=1", f"FAISS={faiss}") == str(checkout / "constraints-cuda.txt")
    pins = constraints("constraints-cuda.txt")
    # the label is what keeps PyPI's torch 2.13.0 (the CUDA 13 build) out; pyproject's torch==2.13.0 still matches
    assert not pins["torch"].contains("2.13.0") and pins["torch"].contains(f"2.13.0+{cuda_label()}")
    assert SpecifierSet("==2.13.0").contains(f"2.13.0+{cuda_label()}")
    assert pins["torchvision"].contains(f"0.28.0+{cuda_label()}")


@pytest.mark.parametrize("capabilities, faiss", [
    (None, "cpu"),            # no nvidia-smi: nothing says faiss-gpu-cu12 has kernels for this GPU
    (["8.6"], "gpu"),         # A10G
    (["7.5", "8.0"], "gpu"),  # T4 and A100 on one machine
    (["9.0"], "cpu"),         # H100: faiss-gpu-cu12 ships kernels for 7.0–8.9 only
    (["8.9", "9.0"], "cpu"),
])
def test_gpu_1_chooses_faiss_from_the_gpus_compute_capability(checkout, capabilities, faiss):
    bin_dir = checkout / "bin"
    if capabilities is not None:
        fake_command(bin_dir, "nvidia-smi", f"printf '%s\\n' {' '.join(capabilities)}")  # one line per GPU
    commands = plan(checkout, "GPU=1", path_first=bin_dir if capabilities is not None else None)
    assert extras_installed(commands) == [faiss, "dev"]


def test_installing_the_other_build_over_a_venv_is_refused_before_anything_runs(checkout):
    (checkout / ".venv").mkdir()
    (checkout / ".venv" / ".installed").touch()  # the CPU build
    bin_dir = checkout / "bin"
    fake_command(bin_dir, "python3", f"touch {checkout}/ran; exit 1")  # nothing may get as far as the venv
    r = make(checkout, "install", "GPU=1", "FAISS=gpu", path_first=bin_dir)
    assert r.returncode == 2 and ".venv/ holds another build (.installed)" in r.stderr and "make clean" in r.stderr
    assert not (checkout / "ran").exists()


def test_a_missing_debian_asset_names_the_command_that_installs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYVL_ASSETS", str(tmp_path))
    with pytest.raises(assets.MissingAssetError, match=r"WordNet 3\.0 is not installed .*`rayvl assets fetch`.*"
                                                       r"FETCH_DEBIAN_ASSETS=1"):
        assets.require_wordnet()
    monkeypatch.setattr(assets, "fashion_mnist_dir", lambda: None)
    with pytest.raises(assets.MissingAssetError, match=r"Fashion-MNIST is not installed .*`rayvl assets fetch`"):
        assets.require_fashion_mnist()


def test_fetching_where_apt_has_no_package_lists_says_to_update_them(tmp_path, monkeypatch, capsys):
    fake_command(tmp_path / "bin", "apt-get", 'echo "E: Unable to locate package $2" >&2; exit 100')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("RAYVL_ASSETS", str(tmp_path / "assets"))
    assert assets.fetch_debian_packages(["wordnet-base"]) == []
    out = capsys.readouterr().out
    assert "could not download wordnet-base: E: Unable to locate package wordnet-base" in out
    assert "run `sudo apt-get update` first" in out
