# `make demo` and `make test` work on a fresh machine: they create .venv/ and install everything first.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
# Every pip call is constrained to torch 2.13.0, so no later install can swap the CPU build for a CUDA one.
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pip warns once per package about this machine's unused local index folders; keep the log readable
# (grep exits 1 when it prints nothing; pip's own failure still fails the recipe through pipefail)
QUIET := { grep -v "is ignored: it is neither a file nor a directory" || true; }
TORCHVISION := torchvision==0.28.0

.PHONY: install demo test benchmark clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 2>&1 | $(QUIET)
	$(PY) -m pip install -q -e ".[dev]" 2>&1 | $(QUIET)
	# timm needs torchvision; the registry's 0.28.0 is a CUDA build: take it without its deps (it would pull
	# CUDA torch) — rayvl/compat.py makes it importable over CPU torch. See README "Install".
	$(PY) -m pip install -q --no-deps $(TORCHVISION) 2>&1 | $(QUIET)
	$(PY) -m rayvl.cli assets fetch
	$(PY) -m rayvl.cli assets check
	touch $@

demo: install
	$(PY) jobs/laion_adapt.py

# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass
test: install
	$(PY) -m pytest -q -ra --durations=15 tests || { rc=$$?; [ $$rc -eq 5 ] && echo "make test: no tests ran" >&2; exit $$rc; }

benchmark: install
	$(PY) -m pip install -q -e ".[bench]" 2>&1 | $(QUIET)
	$(PY) benchmarks/data_pipeline.py --photo
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/bow.py
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/bookkeeping_scale.py

clean:
	rm -rf $(VENV)
