# Two commands do all the set-up on a fresh machine:
#   make train   creates .venv if needed, then runs the default training job (Shakespeare on CPU)
#   make test    creates .venv if needed, then runs the default test suite
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

test: $(VENV)/.installed
	$(PY) -m pytest $(ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -m '' $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
