# Two commands a newcomer needs (see README): `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# llama-cpp-python compiles llama.cpp on first install (about 10 minutes on 2 cores), into a wheelhouse keyed by
# these CMake arguments (scripts/install-llama-cpp.sh). The default build is portable: GGML_NATIVE=OFF compiles for
# an instruction-set baseline (x86-64: AVX2/FMA/F16C/BMI2), not for whatever CPU happens to run the build.
# docs/build.md says what a device image builder should pass instead. GGML_RPC=ON lets kvpoold use rpc workers.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CMAKE_ARGS ?= $(if $(CMAKE_ARGS),$(CMAKE_ARGS),-DGGML_NATIVE=OFF -DGGML_RPC=ON)
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)
EXTRAS := model,test,gateway,remote,chat,examples
# What goes into the wheel: a change to any of these rebuilds it and reinstalls it into .venv.
PACKAGE_SOURCES := pyproject.toml setup.py MANIFEST.in README.md $(shell find protocol client gateway daemon -type d -not -name __pycache__) \
	$(shell find protocol client gateway daemon -type f \( -name '*.py' -o -name '*.jinja' -o -name '*.html' -o -name '*.json' \))

.PHONY: setup system-packages demo test test-fast lint bench clean FORCE

setup: $(VENV)/.installed

# Rewritten only when the arguments change, so that a change of LLAMA_CMAKE_ARGS reinstalls llama-cpp-python.
$(VENV)/.llama-cmake-args: FORCE
	@mkdir -p $(VENV)
	@echo '$(LLAMA_CMAKE_ARGS)' | cmp -s - $@ || echo '$(LLAMA_CMAKE_ARGS)' >$@

$(VENV)/.base: $(VENV)/.llama-cmake-args scripts/install-llama-cpp.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip build 'setuptools>=77' wheel
	bash scripts/install-llama-cpp.sh $(PY) $(LLAMA_CPP_VERSION) '$(LLAMA_CMAKE_ARGS)'
	touch $@

# The suite runs what users deploy: the wheel, built from the sdist and installed (not editable) into .venv.
$(VENV)/.installed: $(VENV)/.base $(PACKAGE_SOURCES)
	bash scripts/build-dist.sh $(PY) dist
	$(PY) -m pip install --quiet --force-reinstall --no-deps dist/kvpool-*.whl
	$(PY) -m pip install --quiet "$$(ls dist/kvpool-*.whl)[$(EXTRAS)]"
	touch $@

# Debian packages some tests need (redis-server, chromium, chromedriver, systemd-analyze): installed when this
# user may (root with apt-get), else named; their tests are then skipped and the run ends naming them.
system-packages:
	@bash scripts/system-packages.sh

demo: setup
	$(PY) examples/demo.py

test: setup system-packages
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=15

test-fast: setup
	$(PY) -m pytest -q -m 'not gemma'

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) -m pip install --quiet "$$(ls dist/kvpool-*.whl)[bench]"
	$(PY) bench/throughput.py
	$(PY) bench/resume.py
	$(PY) bench/latency.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
