# Muser: two entry points on a fresh machine.
#   make run   -> sets up .venv with the runtime dependencies only and runs `muser generate`
#                 on the embedded default model
#   make test  -> adds the test extra (+ the pinned llama.cpp comparator), lints (ruff, mypy),
#                 runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Portable CPU build of the pinned comparator: the native build crashes in ggml's AMX path here.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
PYTEST_ARGS ?=

.PHONY: setup setup-test comparator run lint test clean

# Runtime only: [project] dependencies (no pytest, no triton).
$(VENV)/.stamp-runtime: pyproject.toml setup.py src/muser/engine/kernels/cpu.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-runtime
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

$(VENV)/.stamp-comparator: $(VENV)/.stamp-test
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q --no-binary llama-cpp-python llama-cpp-python==0.3.36
	touch $@

setup: $(VENV)/.stamp-runtime

setup-test: $(VENV)/.stamp-test

comparator: $(VENV)/.stamp-comparator

run: setup
	$(BIN)/muser generate

lint: setup-test
	$(BIN)/ruff check src tests tools
	$(BIN)/python -m mypy

test: setup-test comparator lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
