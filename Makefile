# Two commands do everything on a fresh machine (see README):
#   make demo   the main job: FSDP2 training on 2 CPU processes through the tide backend
#   make test   bootstrap, build, ctest, the sanitizer build's ctest, and pytest: the whole
#               suite on the default (newest) torch, and the Python suites of the backend,
#               FSDP2 and the install on the oldest supported torch too ($(COMPAT_TORCH))
#
# TIDE_TORCH=<version> make ... uses another torch: each version has its own environment
# (scripts/bootstrap) and its own build directory, build/torch-<version> (scripts/env).
SHELL := /bin/bash
ASAN_BUILD ?= build/asan
JOBS ?= $(shell nproc)
ENV := scripts/env
COMPAT_TORCH ?= 2.11.0
# The Python suites that must hold on every supported torch (the FSDP2 seams move; real
# model code, checkpoints and compile go through them; the demo and tide.bench.step read FSDP2's
# profiler ranges; the GPU machine runs tide.bench.step on torch 2.11).
COMPAT_SUITES := tests/python/test_backend_ops.py tests/python/test_backend_failures.py \
	tests/python/test_fsdp_zero_copy.py tests/python/test_fsdp_install.py tests/python/test_fsdp_seams.py \
	tests/python/test_pseudo_nodes.py tests/python/test_hosts.py tests/python/test_demo.py \
	tests/python/test_real_models.py tests/python/test_checkpoint.py tests/python/test_fsdp_features.py \
	tests/python/test_fsdp_shapes.py tests/python/test_imports.py tests/python/test_examples.py \
	tests/python/test_bench_step.py
CONFIGURE := cmake -S . -B $$TIDE_BUILD -G Ninja -DTIDE_NCCL_HINT="$$TIDE_NCCL_HINT" -DPython3_EXECUTABLE=$$(command -v python) \
	-DTIDE_CORE_LIBRARY="$${TIDE_CORE_LIBRARY:-}" >/dev/null

.PHONY: all build build-asan test test-cpp test-asan test-python test-compat demo bench clean
all: build

build:
	@$(ENV) bash -c '$(CONFIGURE) && cmake --build $$TIDE_BUILD -j $(JOBS)'

build-asan:
	@$(ENV) bash -c 'cmake -S . -B $(ASAN_BUILD) -G Ninja -DTIDE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null && cmake --build $(ASAN_BUILD) -j $(JOBS)'

test-cpp: build
	@$(ENV) bash -c 'ctest --test-dir $$TIDE_BUILD --output-on-failure -j $(JOBS)'

test-asan: build-asan
	@$(ENV) bash -c 'ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir $(ASAN_BUILD) --output-on-failure -j $(JOBS)'

# The slowest tests are listed at the end: the suite's time on 2 cores is a budget (README).
test-python: build
	@$(ENV) python -m pytest -q --durations=15 tests/python

# The compat torch builds only what differs per torch (tide._C and tide_cuda, whose NCCL header
# is the one that torch ships) and links the default torch's tide_core, then runs COMPAT_SUITES
# less the cases marked one_torch (pyproject.toml: more sizes of the same C++; pytest counts
# them as deselected).
test-compat: build
	@export TIDE_CORE_LIBRARY=$$($(ENV) bash -c 'echo $$TIDE_BUILD')/libtide_core.a; \
	TIDE_TORCH=$(COMPAT_TORCH) $(ENV) bash -c '$(CONFIGURE) && cmake --build $$TIDE_BUILD -j $(JOBS) --target tide_C && echo "== torch $$(python -c "import torch; print(torch.__version__)")" && python -m pytest -q -m "not one_torch" $(COMPAT_SUITES)'

# Runs every suite even when one fails, and fails if any did. On a fresh machine the compat
# torch's environment (several GB from the package index) is made in the background once the
# default one is ready, while the default torch's suites build and run; test-compat then waits
# on scripts/bootstrap's lock (and makes it itself, with its errors, if the background one failed).
test:
	@rc=0; \
	$(ENV) true || rc=1; \
	mkdir -p build; TIDE_TORCH=$(COMPAT_TORCH) scripts/bootstrap >build/compat-env.log 2>&1 & \
	$(MAKE) --no-print-directory test-cpp || rc=1; \
	$(MAKE) --no-print-directory test-asan || rc=1; \
	$(MAKE) --no-print-directory test-python || rc=1; \
	$(MAKE) --no-print-directory test-compat || rc=1; \
	exit $$rc

# The demo builds quietly (no progress lines, only errors) and writes its PNG to DEMO_PLOT.
DEMO_PLOT ?= build/tide_demo.png
demo:
	@echo "building tide (a few minutes the first time)"
	@$(ENV) bash -c '$(CONFIGURE) && cmake --build $$TIDE_BUILD -j $(JOBS) -- --quiet'
	@$(ENV) python -m tide.demo --plot $(DEMO_PLOT)

bench: build
	@$(ENV) python benchmarks/collectives.py --plot build/collectives.png

clean:
	rm -rf build python/tide/_C*.so
