# Two commands do all the set-up on a fresh machine:
#   make train   creates .venv if needed, then runs the default training job (Shakespeare on CPU)
#   make test    creates .venv if needed, then runs the default test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: train test test-all bench env clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]" -c constraints-cpu.txt
	touch $@

env: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) -m jaxgpt.train $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest $(ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -m '' $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
