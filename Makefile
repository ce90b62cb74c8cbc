# Two commands a newcomer needs (see README): `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# llama-cpp-python compiles llama.cpp on first install (about 10 minutes on 2 cores; pip caches the wheel).
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup demo test test-fast lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[model,test]'
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m 'not gemma'

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/throughput.py
	$(PY) bench/resume.py
	$(PY) bench/latency.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
