# Two commands do all the set-up on a fresh machine:
#   make train   creates .venv if needed, then runs the default training job (Shakespeare on CPU)
#   make test    creates .venv if needed, then runs the default test suite (on 2 pytest-xdist workers:
#                `make test TEST_WORKERS=0` runs it in one process)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: train test test-all bench env gpu-compile clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]" -c constraints-cpu.txt
	touch $@

env: $(VENV)/.installed

# JAX's CUDA plugin at jaxlib's own version (~5 GB of wheels with cuDNN and the PTX compiler): lets
# `python -m jaxgpt.compile` and tests/test_compile.py compile the train step for H100s on a CPU-only machine
gpu-compile: $(VENV)/.installed
	$(PY) -m pip install --quiet "jax-cuda12-plugin[with-cuda]==$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)')"

train: $(VENV)/.installed
	$(PY) -m jaxgpt.train $(ARGS)

# one test file per worker at a time (a file's module fixtures, e.g. its shared training runs, are built once), in
# collection order (parity_tests/ last, as in one process); README "Tests"
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -m '' $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
