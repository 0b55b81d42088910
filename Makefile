# Every target sets up .venv by itself (fresh machine: `make test` or `make demo` is enough).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fp8kit-installed

.PHONY: setup test test-fast lint demo bench bench-gpu clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check fp8kit tests benchmarks examples
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not multiprocess"

lint: $(STAMP)
	$(PY) -m ruff check fp8kit tests benchmarks examples
	$(PY) -m ruff format --check fp8kit tests benchmarks examples

demo: $(STAMP)
	$(PY) -m fp8kit.demo

bench: $(STAMP)
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 $(PY) -m benchmarks.run_all

# GPU figures (issue 9): prints "no CUDA device" and exits 0 on a machine without one.
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu --out bench-gpu.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
