# Two entry points (see README): `make demo` and `make test`.
# Each creates ./.venv on first use and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Offline machines (like CI here) read a prepared MNIST copy; online ones may
# leave TFDS_DATA_DIR unset and tfds downloads MNIST itself.
ifeq ($(origin TFDS_DATA_DIR), undefined)
  ifneq ($(wildcard ../shared/data/tfds/mnist),)
    export TFDS_DATA_DIR := $(abspath ../shared/data/tfds)
  endif
endif
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# A fresh run directory each time: rerunning into an old one would resume a finished run.
demo: venv
	$(PY) launch.py --strategy multiworker --workers 2 -- --epochs 1 --model-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
