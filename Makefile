# `make demo` and `make test` work on a fresh machine: they create .venv/ and install everything first.
# On a machine with an NVIDIA GPU, `make install GPU=1` (and `make demo GPU=1`) installs torch's CUDA 12 build and
# faiss for it instead; `make gpu-check GPU=1` then says whether torch and faiss use the GPU.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
GPU ?= 0
TORCH := torch==2.13.0
TORCHVISION := torchvision==0.28.0
# torch 2.13's only CUDA 12 build (its others are CUDA 13): faiss-gpu-cu12 is built for CUDA 12, and the two load
# the same nvidia-*-cu12 libraries. constraints-cuda.txt pins the same build (+cu126).
TORCH_CUDA_INDEX := https://download.pytorch.org/whl/cu126
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# every recipe runs as in an activated venv: `python`, `ray` and `ninja` are the venv's
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# pip warns once per package about this machine's unused local index folders; keep the log readable
# (grep exits 1 when it prints nothing; pip's own failure still fails the recipe through pipefail)
QUIET := { grep -v "is ignored: it is neither a file nor a directory" || true; }

ifeq ($(GPU),1)
# faiss-gpu-cu12 has GPU kernels for compute capability 7.0–8.9 only (Volta to Ada); on any other GPU (H100 is 9.0)
# its searches fail, so faiss-cpu is taken there, and where nvidia-smi cannot tell. FAISS=gpu or FAISS=cpu decides.
ifeq ($(origin FAISS),undefined)
FAISS := $(shell { nvidia-smi --query-gpu=compute_cap --format=csv,noheader || true; } 2>/dev/null \
           | awk 'BEGIN {ok = 1} {n++; ok = ok && $$1 >= 7.0 && $$1 < 9.0} END {print (n && ok) ? "gpu" : "cpu"}')
endif
# every pip call is constrained to the CUDA build, so no later install can swap it for PyPI's torch
export PIP_CONSTRAINT := $(CURDIR)/constraints-cuda.txt
STAMP := $(VENV)/.installed-cuda-faiss-$(FAISS)
DEMO_ARGS := --set train.use_gpu=true \
             --set train.num_workers=$$($(PY) -c 'import torch; print(torch.cuda.device_count())')
else
# every pip call is constrained to torch 2.13.0, so no later install can swap the CPU build for a CUDA one
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
STAMP := $(VENV)/.installed
DEMO_ARGS :=
endif
# a venv holds one torch build and one faiss (faiss-cpu and faiss-gpu-cu12 are the same package `faiss`): installing
# another build over it would leave both, so that is refused
OTHER_BUILD := $(notdir $(filter-out $(STAMP),$(wildcard $(VENV)/.installed*)))
REFUSED := $(VENV)/ holds another build ($(OTHER_BUILD)): give the GPU= and FAISS= it was installed with, or run \
	make clean first

.PHONY: install demo test test-fast gpu-check benchmark clean

install: $(STAMP)

$(STAMP): pyproject.toml $(PIP_CONSTRAINT)
	$(if $(OTHER_BUILD),@echo "$(REFUSED)" >&2; exit 2)
	python3 -m venv $(VENV)
ifeq ($(GPU),1)
	@echo "make install GPU=1: torch CUDA 12.6 build from $(TORCH_CUDA_INDEX), faiss-$(FAISS)"
	$(PY) -m pip install -q --index-url $(TORCH_CUDA_INDEX) $(TORCH) $(TORCHVISION) 2>&1 | $(QUIET)
	$(PY) -m pip install -q -e ".[$(FAISS),dev]" 2>&1 | $(QUIET)
else
	$(PY) -m pip install -q $(TORCH) 2>&1 | $(QUIET)
	$(PY) -m pip install -q -e ".[cpu,dev]" 2>&1 | $(QUIET)
	# timm needs torchvision; the registry's 0.28.0 is a CUDA build: take it without its deps (it would pull
	# CUDA torch) — rayvl/compat.py makes it importable over CPU torch. See README "Install".
	$(PY) -m pip install -q --no-deps $(TORCHVISION) 2>&1 | $(QUIET)
endif
	$(PY) -m rayvl.cli assets fetch
	$(PY) -m rayvl.cli assets check
	touch $@

# GPU=1: one Ray Train worker per GPU
demo: install
	$(PY) jobs/laion_adapt.py $(DEMO_ARGS)

# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass
test: install
	$(PY) -m pytest -q -ra --durations=15 tests || { rc=$$?; [ $$rc -eq 5 ] && echo "make test: no tests ran" >&2; exit $$rc; }

# the unit layer alone (no Ray, nothing slow: tests/conftest.py LAYERS), a few minutes; LAYER='ray' or 'multinode'
# runs another layer
LAYER ?= unit
test-fast: install
	$(PY) -m pytest -q -ra --durations=10 -m "$(LAYER)" tests || { rc=$$?; [ $$rc -eq 5 ] && echo "make test-fast: no test in layer '$(LAYER)' (unit, ray, multinode, slow)" >&2; exit $$rc; }

# `rayvl check gpu` (rayvl/checks/gpu.py): exits non-zero, saying why, where torch or faiss cannot use a GPU
# ARGS: the check's options, e.g. make gpu-check GPU=1 ARGS='--batches 256,1024,max --profile zero0'
gpu-check: install
	$(PY) -m rayvl.cli check gpu $(ARGS)

benchmark: install
	$(PY) -m pip install -q -e ".[bench]" 2>&1 | $(QUIET)
	$(PY) benchmarks/data_pipeline.py --photo
	$(PY) benchmarks/train_step.py
	$(PY) -m rayvl.cli check census --batch-path
	$(PY) benchmarks/bow.py
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/bookkeeping_scale.py
	$(PY) benchmarks/host_time.py
	$(PY) benchmarks/eval_throughput.py
	$(PY) benchmarks/pseudo_label_throughput.py

clean:
	rm -rf $(VENV)
