# Two commands do everything on a fresh machine (see README):
#   make demo   the main job: FSDP2 training on 2 CPU processes through the tide backend
#   make test   bootstrap, build, ctest, the sanitizer build's ctest, and pytest
SHELL := /bin/bash
BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc)
ENV := scripts/env

.PHONY: all build build-asan test test-cpp test-asan test-python demo bench clean
all: build

build:
	@$(ENV) bash -c 'cmake -S . -B $(BUILD) -G Ninja -DTIDE_NCCL_HINT="$$TIDE_NCCL_HINT" -DPython3_EXECUTABLE=$$(command -v python) >/dev/null && cmake --build $(BUILD) -j $(JOBS)'

build-asan:
	@$(ENV) bash -c 'cmake -S . -B $(ASAN_BUILD) -G Ninja -DTIDE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null && cmake --build $(ASAN_BUILD) -j $(JOBS)'

test-cpp: build
	@$(ENV) ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

test-asan: build-asan
	@$(ENV) bash -c 'ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir $(ASAN_BUILD) --output-on-failure -j $(JOBS)'

test-python: build
	@$(ENV) python -m pytest -q tests/python

# Runs every suite even when one fails, and fails if any did.
test:
	@rc=0; \
	$(MAKE) --no-print-directory test-cpp || rc=1; \
	$(MAKE) --no-print-directory test-asan || rc=1; \
	$(MAKE) --no-print-directory test-python || rc=1; \
	exit $$rc

demo: build
	@$(ENV) python -m tide.demo

bench: build
	@$(ENV) python benchmarks/collectives.py

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) python/tide/_C*.so
