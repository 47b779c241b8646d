#!/usr/bin/env bash
# TIDE's GPU checks in ONE device command, sized for the one-H200 lease: 15 minutes of device
# time in all (the machine's start included), at most 10 per command, 64 MiB of carried build
# outputs. Nothing is compiled on the device. tests/gpu/README.md says how; in short:
#   here (CPU):  tests/gpu/prepare              builds and strips build/gpu-carry (tide._C too)
#                tests/gpu/run.sh --dry-run     the plan: every step, its limit, the sum, the carry
#   device:      tests/gpu/run.sh               carry ["build/gpu-carry"], timeout_s 480
#
# Steps, most valuable first (a lease that ends early still returns the first ones): the
# doctor (does the carried tide._C load, what the device offers), the FSDP2-on-CUDA pytest
# (TIDE vs stock FSDP2, ranks sharing the GPU), the CUDA scenarios, the GoogleTest probe and
# kernel tests, the benchmarks, the paper's experiment shrunk to one GPU. Each runs under its own time limit, reports PASS / FAIL / SKIP
# with the reason and never stops the steps after it (no set -e). Strict by default
# (TIDE_GPU_STRICT=1): on a GPU machine a check that could not run fails, naming itself and
# why; the scenarios must also take the modes an H200 offers (device flags, batched copies,
# vmm memory). The exit status is the number of steps that did not pass.
#
# Results as they come, so a kill at any moment still returns what finished ($OUT, the device
# tool's folder that comes back, else build/gpu-run; at most 8 files come back):
#   run.log        everything printed
#   results.jsonl  one JSON line per result (pytest test, scenario, benchmark figure, step), flushed
#   summary.txt    the steps' verdicts
#   cuda_<gpu>.json  the benchmark's figures (docs/model.md's --calibrate keys)
#   bench_step_ws2.json, bench_step_ws1.json, calibration.json  tide.bench.step's reports
#
# TIDE_DEBUG=1 during the run (every path choice and mode is logged), group timeouts shorter
# than the kill of their step (a hang reports each rank's flags instead of dying silently).
# CUDA_DEVICE_MAX_CONNECTIONS=32: TIDE's streams wait on peers' flags (cuStreamWaitValue32);
# with fewer hardware queues than busy streams, a waiting stream shares a queue with other
# streams and holds back whatever is queued behind it there: false dependencies that stall a
# test or, across ranks, deadlock it.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
if [ $# -gt 0 ]; then echo "tests/gpu/run.sh: unexpected argument '$1' (one command: no parts)" >&2; exit 2; fi
strict=${TIDE_GPU_STRICT:-1}
carry=build/gpu-carry
out=${OUT:-build/gpu-run}
mkdir -p "$out"
results="$out/results.jsonl"
device_timeout=480  # the device tool's timeout_s for this command
grace=5             # seconds a step gets after its limit to end before it is killed
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export PYTHONUNBUFFERED=1 TIDE_DEBUG=${TIDE_DEBUG:-1} USE_LIBUV=0
export TIDE_BUILD="$root/$carry/torch" PYTHONPATH="$root/python" TIDE_RESULTS_JSONL="$results"
# cuBLAS for the benchmark: the toolkit's, else the one torch's wheels bring.
cublas=$(python3 -c "import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64${cublas:+:$cublas}

# One JSON line: json_line key value ... (values are strings).
json_line() {
  python3 -c 'import json, sys; a = sys.argv[1:]; print(json.dumps(dict(zip(a[::2], a[1::2]))))' "$@" >> "$results"
}

names=(); verdicts=(); planned=0
# step NAME LIMIT_S COMMAND...: runs COMMAND (a shell function or program) with a time limit,
# its output to the console and run.log, and records PASS / FAIL / SKIP.
step() {
  local name=$1 limit=$2; shift 2
  planned=$(( planned + limit + grace ))
  if [ "$dry" = 1 ]; then
    printf '  %-24s %4d s   %s\n' "$name" "$limit" "$*"
    return
  fi
  echo "== $name (limit ${limit} s): $*"
  local log="$out/.step.log" start rc verdict
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
  local seconds=$(( $(date +%s) - start ))
  echo "== $name: $verdict in $seconds s"
  json_line step "$name" verdict "$verdict" seconds "$seconds" limit "$limit"
  names+=("$name"); verdicts+=("$verdict")
  rm -f "$log"
}

need() {  # need PATH: exit 77 (skip) naming what is missing
  [ -e "$1" ] || { echo "missing $1 (run tests/gpu/prepare here and carry build/gpu-carry)"; return 77; }
}
doctor() {
  need "$TIDE_BUILD/python/tide" || return
  local want have
  want=$(cat "$TIDE_BUILD/torch-version")
  have=$(python3 -c "import torch; print(torch.__version__.split('+')[0])") || return
  [ "$want" = "$have" ] || { echo "FAIL: tide._C was built for torch $want, this machine runs $have"; return 1; }
  python3 -m tide.doctor
}
gpu_pytest() {
  local extra=()
  python3 -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 150)
  # Tests in parallel where pytest-xdist is installed: each test's ranks are processes on the
  # one GPU, and most of a test's time is starting them.
  python3 -c "import xdist" 2>/dev/null && extra+=(-n 4)
  # With them, that this python reads torch's FSDP2 as the adapter expects (3.12 tokenizes
  # f-strings apart: the fingerprints must not change with it).
  TIDE_STRICT_SKIPS="$strict" python3 -m pytest -q -rs -p no:cacheprovider "${extra[@]}" \
    tests/python/test_cuda_backend.py tests/python/test_fsdp_cuda.py \
    tests/python/test_fsdp_install.py::test_this_torch_gets_the_adapter_written_for_it \
    tests/python/test_fsdp_install.py::test_fingerprints_read_fstrings_as_their_source_text
}
# The scenarios: ws 1, 2, 4 with the default (vmm) symmetric memory, then ws 2 over cudaIpc
# memory. Batched: all scenarios of a world size in one set of rank processes (a process's
# CUDA context costs about a second there: a process per scenario did not fit the step),
# the three world sizes at once; each scenario's groups time out after 12 s.
selftest() {
  need "$carry/bin/tide_cuda_selftest" || return
  local strict_flag=()
  [ "$strict" = 1 ] && strict_flag=(--strict)
  "$carry/bin/tide_cuda_selftest" "${strict_flag[@]}" --batch --jobs 3 --limit 24 --jsonl "$results" \
    --expect flags=device,copies=batched,memory=vmm 1 2 4 &&
    TIDE_CUDA_SYMMETRIC=ipc "$carry/bin/tide_cuda_selftest" "${strict_flag[@]}" --batch --limit 24 \
      --jsonl "$results" --expect flags=device,copies=batched,memory=ipc --only symmetric,flags,ag_bf16,rs_bf16_sum 2
}
gtests() {
  need "$carry/bin/tide_cuda_tests" || return
  "$carry/bin/tide_cuda_tests"
}
bench() {
  need "$carry/bin/tide_bench_cuda" || return
  local gpu
  gpu=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_-')
  "$carry/bin/tide_bench_cuda" "$out/cuda_${gpu:-gpu}.json" "$results"
}
# The paper's experiment (python -m tide.bench.step) on the one GPU, two steps: TIDE and TIDE +
# Slot-Reuse at ws 2 (two ranks share the GPU; NCCL refuses that, so no NCCL variant there),
# then stock FSDP2 on NCCL, TIDE and the bound (no communication) at ws 1 with --calibrate (the
# model's constants measured here). Group timeouts (40 s) under the steps' limits.
# No TIDE_DEBUG: its lines would be timed.
bench_step() {  # bench_step NPROC VARIANT... [--calibrate FILE] --json FILE
  need "$TIDE_BUILD/python/tide" || return
  local nproc=$1; shift
  TIDE_DEBUG=0 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m tide.bench.step \
    --model llama3.1-70b --layers 2 --hidden-divisor 8 --tokens-per-gpu 2048 --seq-len 2048 \
    --steps 3 --warmup 1 --timeout 40 --variants "$@"
}
export -f need doctor gpu_pytest selftest gtests bench bench_step json_line
export carry out strict results

if [ "$dry" = 1 ]; then
  echo "tests/gpu/run.sh: the plan (nothing runs). Strict: $strict. CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
  if [ -d "$carry" ]; then
    echo "carry: $carry, $(( $(du -sb "$carry" | cut -f1) / 1024 )) KiB (lease limit 64 MiB), built from $(cat "$carry/commit" 2>/dev/null)"
  else
    echo "carry: $carry is missing: run tests/gpu/prepare first"
  fi
  echo "one command: tests/gpu/run.sh  (device tool: carry [\"$carry\"], timeout_s $device_timeout)"
else
  exec > >(tee -a "$out/run.log") 2>&1  # everything printed, also past the reply's tail
  echo "== tests/gpu/run.sh on $(hostname) at $(date -u +%FT%TZ), carry built from $(cat "$carry/commit" 2>/dev/null || echo '?'), strict $strict"
  json_line step start commit "$(cat "$carry/commit" 2>/dev/null || echo '?')" strict "$strict"
fi
# Limits: about twice what each step took on the H200 (2026-12-04: 19, 105, 15, 3, 4 s).
step "doctor" 20 doctor
step "pytest cuda" 170 gpu_pytest
step "cuda scenarios" 60 selftest
step "gtest probe and kernels" 30 gtests
step "benchmarks" 30 bench
step "bench step ws2" 60 bench_step 2 tide tide-slot-reuse --json "$out/bench_step_ws2.json"
step "bench step ws1" 60 bench_step 1 stock tide bound --calibrate "$out/calibration.json" --json "$out/bench_step_ws1.json"
if [ "$dry" = 1 ]; then
  echo "sum of all limits: $planned s (with ${grace} s grace a step; the command's timeout_s is $device_timeout; 15 min of device time in all)"
  exit 0
fi

echo "== summary (strict: $strict; results in $out)"
for i in "${!names[@]}"; do
  printf '  %-24s %s\n' "${names[$i]}" "${verdicts[$i]}"
done | tee "$out/summary.txt"
exit "$(grep -vc ' PASS$' "$out/summary.txt" || true)"
