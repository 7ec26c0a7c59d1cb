# Two commands on a fresh machine:  `make compare` (main job)  and  `make test`.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv test compare sweep bench clean

$(VENV)/.installed: pyproject.toml Makefile flexmoba/__init__.py  # the version lives there
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[train,dev,hf]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

compare: venv
	$(VENV)/bin/flexmoba compare

sweep: venv
	$(VENV)/bin/flexmoba sweep configs/sweep/toy.yaml

bench: venv
	$(VENV)/bin/flexmoba bench mask_build

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
