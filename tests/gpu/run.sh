#!/usr/bin/env bash
# TIDE's GPU checks, sized for the one-H200 lease: 15 minutes of device time in all (the
# machine's start included), at most 10 per command, 64 MiB of carried build outputs.
# tests/gpu/README.md says how to run them; in short:
#   here (CPU):  tests/gpu/prepare                      builds and strips build/gpu-carry
#                tests/gpu/run.sh --dry-run             the plan: steps, limits, their sums, carried size
#   device:      tests/gpu/run.sh 1   (carry build/gpu-carry, timeout_s 480)   C++ checks, benchmarks
#                tests/gpu/run.sh 2   (timeout_s 480)                            tide._C, doctor, pytest
#
# Every step runs under its own time limit, reports PASS / FAIL / SKIP with the reason, and
# never stops the steps after it (no set -e); tests run before benchmarks. Strict by default
# (TIDE_GPU_STRICT=1): on a GPU machine a check that could not run is a failure, so a skip
# fails, naming the check and why (TIDE_GPU_STRICT=0 only to try the script elsewhere). The
# exit status is the number of steps that did not pass. Logs and results go to $OUT (the
# device tool's folder that comes back) or build/gpu-run.
#
# CUDA_DEVICE_MAX_CONNECTIONS=32: TIDE's streams wait on peers' flags (cuStreamWaitValue32);
# with fewer hardware queues than busy streams, a waiting stream shares a queue with other
# streams and holds back whatever is queued behind it there (compute, NCCL): false
# dependencies that stall a test or, across ranks, deadlock it.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
part=${1:-all}
case "$part" in 1 | 2 | all) ;; *) echo "tests/gpu/run.sh: unknown part '$part' (1, 2 or all)" >&2; exit 2 ;; esac
strict=${TIDE_GPU_STRICT:-1}
carry=build/gpu-carry
torch_build=build/gpu-torch
out=${OUT:-build/gpu-run}
mkdir -p "$out"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export PYTHONUNBUFFERED=1
strict_flag=(); [ "$strict" = 1 ] && strict_flag=(--strict)
# cuBLAS for the benchmark: the toolkit's, else the one torch's wheels bring.
cublas=$(python3 -c "import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64${cublas:+:$cublas}

names=(); verdicts=(); planned=0
grace=10  # seconds a step gets after its limit to end before it is killed
# step NAME LIMIT_S COMMAND...: runs COMMAND (a shell function or program) with a time limit,
# its output to the console and to $out/<NAME>.log, and records PASS / FAIL / SKIP.
step() {
  local name=$1 limit=$2; shift 2
  planned=$(( planned + limit + grace ))
  if [ "$dry" = 1 ]; then
    printf '  %-30s %4d s   %s\n' "$name" "$limit" "$*"
    return
  fi
  echo "== $name (limit ${limit} s): $*"
  local log="$out/${name// /_}.log" start rc verdict
  start=$(date +%s)
  # A new bash runs the step, so shell functions work under timeout (they are exported);
  # the pipe ends only when tee has written the whole log, which the verdict reads.
  timeout -k "$grace" "$limit" bash -c '"$@"' step "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  verdict=PASS
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then verdict="FAIL (killed at its ${limit} s limit)"
  elif [ "$rc" = 77 ]; then verdict="SKIP ($(tail -n 1 "$log"))"
  elif [ "$rc" != 0 ]; then verdict="FAIL (exit $rc: $( (grep -m1 '^FAIL' "$log" || tail -n 1 "$log") | cut -c1-160))"
  elif grep -q '^\[  SKIPPED \]' "$log"; then verdict="SKIP ($(grep -c '^\[  SKIPPED \]' "$log") GoogleTest tests skipped)"
  elif grep -Eq '^[0-9]+ (passed|failed).*[0-9]+ skipped|^[0-9]+ skipped' "$log"; then
    verdict="SKIP (pytest: $(grep -E '[0-9]+ skipped' "$log" | tail -n 1))"
  fi
  if [ "$strict" = 1 ] && [ "${verdict#SKIP}" != "$verdict" ]; then verdict="FAIL (strict: $verdict)"; fi
  echo "== $name: $verdict in $(( $(date +%s) - start )) s"
  names+=("$name"); verdicts+=("$verdict")
}

need() {  # need PATH: exit 77 (skip) naming what is missing
  [ -e "$1" ] || { echo "missing $1 (run tests/gpu/prepare here and carry build/gpu-carry)"; return 77; }
}
selftest() { need "$carry/bin/tide_cuda_selftest" || return; "$carry/bin/tide_cuda_selftest" "$@"; }
ipc_selftest() { TIDE_CUDA_SYMMETRIC=ipc selftest "$@"; }
gtests() { need "$carry/bin/tide_cuda_tests" || return; "$carry/bin/tide_cuda_tests" "$@"; }
bench() {
  need "$carry/bin/tide_bench_cuda" || return
  local gpu
  gpu=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_-')
  "$carry/bin/tide_bench_cuda" "$out/cuda_${gpu:-gpu}.json"
}
build_torch_extension() {
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || return
  cmake -S . -B "$torch_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DPython3_EXECUTABLE="$(command -v python3)" > "$out/cmake.log" 2>&1 ||
    { tail -n 30 "$out/cmake.log"; return 1; }
  cmake --build "$torch_build" -j "$(nproc)" --target tide_C
}
doctor() { TIDE_BUILD="$torch_build" PYTHONPATH=python python3 -m tide.doctor; }
gpu_pytest() {
  local extra=()
  python3 -c "import pytest_timeout" 2>/dev/null && extra=(--timeout 90)
  TIDE_BUILD="$torch_build" PYTHONPATH=python TIDE_STRICT_SKIPS="$strict" USE_LIBUV=0 \
    python3 -m pytest -q -rs -p no:cacheprovider "${extra[@]}" tests/python/test_cuda_backend.py tests/python/test_fsdp_cuda.py
}

export -f need selftest ipc_selftest gtests bench build_torch_extension doctor gpu_pytest
export carry torch_build out strict grace

if [ "$dry" = 1 ]; then
  echo "tests/gpu/run.sh: the plan (nothing runs). Strict: $strict. CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
  if [ -d "$carry" ]; then
    echo "carry: $carry, $(( $(du -sb "$carry" | cut -f1) / 1024 )) KiB (lease limit 64 MiB), built from $(cat "$carry/commit" 2>/dev/null)"
  else
    echo "carry: $carry is missing: run tests/gpu/prepare first"
  fi
fi
if [ "$part" = 1 ] || [ "$part" = all ]; then
  [ "$dry" = 1 ] && echo "command 1: tests/gpu/run.sh 1  (device tool: carry [\"$carry\"], timeout_s 480)"
  before=$planned
  step "cuda scenarios ws 1 2 4" 180 selftest "${strict_flag[@]}" --limit 30 1 2 4
  step "cuda scenarios ipc ws 2" 50 ipc_selftest "${strict_flag[@]}" --limit 30 2
  step "gtest probe and kernels" 50 gtests --gtest_filter=-All/CudaCollectives.*
  step "benchmarks" 110 bench
  [ "$dry" = 1 ] && echo "  sum of limits, command 1: $(( planned - before )) s (with ${grace} s grace a step)"
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
  [ "$dry" = 1 ] && echo "command 2: tests/gpu/run.sh 2  (device tool: timeout_s 480; tide._C is built there)"
  before=$planned
  step "build tide._C" 170 build_torch_extension
  step "doctor" 20 doctor
  step "pytest cuda" 200 gpu_pytest
  [ "$dry" = 1 ] && echo "  sum of limits, command 2: $(( planned - before )) s (with ${grace} s grace a step)"
fi
if [ "$dry" = 1 ]; then
  echo "sum of all limits: $planned s (each command under its 480 s device timeout; 15 min of device time in all)"
  exit 0
fi

echo "== summary (strict: $strict; logs in $out)"
for i in "${!names[@]}"; do
  printf '  %-30s %s\n' "${names[$i]}" "${verdicts[$i]}"
done | tee "$out/summary.txt"
exit "$(grep -vc ' PASS$' "$out/summary.txt" || true)"
