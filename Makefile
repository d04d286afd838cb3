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
# Test processes: most tests keep one core busy, so the suite runs on two (a CI machine's cores);
# idle workers take queued tests from busy ones (--dist worksteal). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: setup setup-test comparator llama-bins run lint test clean

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

# The pinned llama.cpp's own binaries for the CPU comparisons (`muser bench spec --against llama.cpp
# --llama-spec`, `muser bench serve --against llama-server --llama-server`), built from the vendor
# tree of the same llama-cpp-python 0.3.36 source distribution the comparator package is built from.
LLAMA_BINS := build/llama-cpu
$(LLAMA_BINS)/.stamp: $(VENV)/.stamp-runtime
	$(BIN)/python -m pip install -q cmake
	rm -rf $(LLAMA_BINS) && mkdir -p $(LLAMA_BINS)
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_BINS) llama-cpp-python==0.3.36
	tar xzf $(LLAMA_BINS)/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_BINS)
	$(BIN)/cmake -S $(LLAMA_BINS)/llama_cpp_python-0.3.36/vendor/llama.cpp -B $(LLAMA_BINS)/build \
	  -DCMAKE_BUILD_TYPE=Release $(LLAMA_CMAKE_ARGS) -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
	  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >$(LLAMA_BINS)/cmake.log
	$(BIN)/cmake --build $(LLAMA_BINS)/build -j2 --target llama-speculative-simple llama-server >$(LLAMA_BINS)/build.log
	touch $@

llama-bins: $(LLAMA_BINS)/.stamp

setup: $(VENV)/.stamp-runtime

setup-test: $(VENV)/.stamp-test

comparator: $(VENV)/.stamp-comparator

run: setup
	$(BIN)/muser generate

lint: setup-test
	$(BIN)/ruff check src tests tools
	$(BIN)/python -m mypy

test: setup-test comparator lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
