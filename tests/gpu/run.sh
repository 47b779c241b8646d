#!/usr/bin/env bash
# TIDE's GPU checks in one script, for the single-H200 machine (torch + CUDA 13 + cmake +
# ninja, no GoogleTest, no network). Whole run well under 8 minutes:
#   1. configure + build tide_core/tide_cuda (sm_90, no torch; GoogleTest tests only if found)
#   2. build the GoogleTest-free selftest (tests/gpu/selftest_main.cpp) against them
#   3. run the CUDA scenarios (symmetric memory, TIDE-AG, TIDE-RS, errors) at ws 1, 2, 4,
#      every rank a process on GPU 0 (and ws 2 again with cudaIpc symmetric memory instead
#      of cuMemCreate); then tide_cuda_tests if GoogleTest was found
#   4. build benchmarks/gpu/bench_cuda.cu with nvcc and run it: JSON with docs/model.md's
#      --calibrate keys in benchmarks/results/cuda_<gpu>.json (and $OUT when set)
#   5. build tide._C (with its CUDA path) against the machine's torch and run the CUDA
#      pytest: standard ops through the NCCL delegate; TIDE-AG / TIDE-RS called directly
#      (ws 1 2 4 8, bitwise against CPU references, bf16 storages, side streams), the
#      profiler seeing no kernel on TIDE-AG, mismatched calls, a dead and a hung peer; FSDP2
#      on CUDA against stock FSDP2 on gloo (fp32, Shard(1), bf16, Slot-Reuse), no copies
# Usage: tests/gpu/run.sh [build dir, default build-gpu]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
build=${1:-build-gpu}
cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc=$cuda/bin/nvcc
jobs=$(nproc 2>/dev/null || echo 4)
run() { echo "+ $*" >&2; "$@"; }
start=$(date +%s)

echo "== devices" >&2
command -v nvidia-smi >/dev/null && run nvidia-smi -L || echo "(no nvidia-smi)" >&2

# NCCL is linked by the CMake target; tide_cuda only dlopens it (probe). Prefer torch's.
nccl_hint=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null || true)
tests=OFF
for f in /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/cmake/GTest /usr/local/lib/cmake/GTest /usr/lib64/cmake/GTest; do
  [ -d "$f" ] && tests=ON
done
echo "== GoogleTest tests: $tests" >&2

echo "== 1. build" >&2
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
run cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TORCH=OFF -DTIDE_BUILD_TESTS=$tests \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 ${nccl_hint:+-DTIDE_NCCL_HINT="$nccl_hint"}
targets=(tide_core tide_cuda)
[ "$tests" = ON ] && targets+=(tide_cuda_tests)
run cmake --build "$build" -j"$jobs" --target "${targets[@]}"

echo "== 2. selftest" >&2
run g++ -std=c++20 -O2 -Iinclude -I"$cuda/include" tests/gpu/selftest_main.cpp \
  "$build/libtide_cuda.a" "$build/libtide_core.a" -L"$cuda/lib64" -lcudart -ldl -lpthread -lrt \
  -Wl,-rpath,"$cuda/lib64" -o "$build/tide_cuda_selftest"

echo "== 3. GPU tests (ws 1 2 4)" >&2
status=0
TIDE_DEBUG=1 run timeout 60 "$build/tide_cuda_selftest" probe || status=$?
run timeout 300 "$build/tide_cuda_selftest" 1 2 4 || status=$?  # vmm symmetric memory where supported
TIDE_CUDA_SYMMETRIC=ipc run timeout 120 "$build/tide_cuda_selftest" 2 || status=$?
if [ "$tests" = ON ]; then
  run timeout 300 "$build/tide_cuda_tests" || status=$?
fi

echo "== 4. benchmarks" >&2
run "$nvcc" -O3 -std=c++20 -arch=sm_90 -Iinclude benchmarks/gpu/bench_cuda.cu kernels/accumulate.cu kernels/cast.cu \
  -lcublas -o "$build/bench_cuda"
mkdir -p benchmarks/results
gpu=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_-')
result=benchmarks/results/cuda_${gpu:-gpu}.json
run timeout 180 "$build/bench_cuda" "$result" || status=$?
if [ -n "${OUT:-}" ] && [ -f "$result" ]; then cp "$result" "$OUT/"; fi

echo "== 5. torch: tide._C and the CUDA pytest" >&2
if python3 -c "import torch, pybind11" 2>/dev/null; then
  run cmake -S . -B "$build" -DTIDE_BUILD_TORCH=ON -DPython3_EXECUTABLE="$(command -v python3)"
  run cmake --build "$build" -j"$jobs" --target tide_C || status=$?
  TIDE_BUILD="$(cd "$build" && pwd)" PYTHONPATH="$root/python" USE_LIBUV=0 run timeout 420 python3 -m pytest -q -rs \
    tests/python/test_cuda_backend.py tests/python/test_fsdp_cuda.py || status=$?
else
  echo "(python3 has no torch/pybind11: skipped)" >&2
fi

echo "== done in $(( $(date +%s) - start )) s, status $status" >&2
exit $status
