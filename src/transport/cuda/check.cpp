// Error formatting for TIDE_CUDA_CHECK / TIDE_CU_CHECK.
#include "tide/cuda/check.hpp"

#include <atomic>
#include <cstring>

namespace tide::cuda {
namespace {
std::atomic<int> g_rank{-1};
}

void set_error_rank(int rank) { g_rank.store(rank, std::memory_order_relaxed); }
int error_rank() { return g_rank.load(std::memory_order_relaxed); }

void throw_cuda_error(const char* call, int code, const char* what, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  const int rank = error_rank();
  throw Error(detail::concat("tide: cuda: ", call, " failed on rank ",
                             rank >= 0 ? std::to_string(rank) : std::string("?"), ": ", what, " (",
                             code, ") at ", base ? base + 1 : file, ":", line));
}

namespace {
bool poll_answer(cudaError_t e, const char* call, int line) {
  if (e == cudaSuccess) return true;
  (void)cudaGetLastError();  // the answer is handled here, not left for the next check
  if (e == cudaErrorNotReady) return false;
  throw_cuda_error(call, static_cast<int>(e), cudaGetErrorString(e), __FILE__, line);
}
}  // namespace

bool event_done(cudaEvent_t event) { return poll_answer(cudaEventQuery(event), "cudaEventQuery", __LINE__); }
bool stream_done(cudaStream_t stream) { return poll_answer(cudaStreamQuery(stream), "cudaStreamQuery", __LINE__); }

}  // namespace tide::cuda

// ---- run-time resolved driver entry points (tide/cuda/driver.hpp) ------------------------
#include <mutex>

#include "tide/cuda/driver.hpp"

namespace tide::cuda {
namespace {

bool resolve(const char* name, void** fn, unsigned int version) {
  cudaDriverEntryPointQueryResult q{};
  *fn = nullptr;
  if (cudaGetDriverEntryPointByVersion(name, fn, version, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    *fn = nullptr;
    return false;
  }
  return *fn != nullptr;
}

}  // namespace

const Driver* try_driver() {
  static Driver d;
  static bool ok = false;
  static std::once_flag once;
  std::call_once(once, [] {
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess || v == 0) {
      (void)cudaGetLastError();
      return;
    }
#define TIDE_RESOLVE(name, version) resolve(#name, reinterpret_cast<void**>(&d.name), version)
    ok = TIDE_RESOLVE(cuGetErrorString, 12000) && TIDE_RESOLVE(cuInit, 12000) && TIDE_RESOLVE(cuDeviceGet, 12000) &&
         TIDE_RESOLVE(cuDeviceGetAttribute, 12000);
    if (!ok) return;
    TIDE_RESOLVE(cuStreamWriteValue32, 12000);
    TIDE_RESOLVE(cuStreamWaitValue32, 12000);
    TIDE_RESOLVE(cuMemCreate, 12000);
    TIDE_RESOLVE(cuMemGetAllocationGranularity, 12000);
    TIDE_RESOLVE(cuMemRelease, 12000);
    TIDE_RESOLVE(cuMemMap, 12000);
    TIDE_RESOLVE(cuMemUnmap, 12000);
    TIDE_RESOLVE(cuMemSetAccess, 12000);
    TIDE_RESOLVE(cuMemAddressReserve, 12000);
    TIDE_RESOLVE(cuMemAddressFree, 12000);
    TIDE_RESOLVE(cuMemExportToShareableHandle, 12000);
    TIDE_RESOLVE(cuMemImportFromShareableHandle, 12000);
#undef TIDE_RESOLVE
  });
  return ok ? &d : nullptr;
}

const Driver& driver() {
  const Driver* d = try_driver();
  if (!d)
    throw Error(detail::concat("tide: cuda: no CUDA driver entry points on rank ", error_rank(),
                               " (cudaGetDriverEntryPointByVersion failed)"));
  return *d;
}

const char* driver_error_string(int result) {
  const Driver* d = try_driver();
  const char* s = nullptr;
  if (!d || d->cuGetErrorString(static_cast<CUresult>(result), &s) != CUDA_SUCCESS || !s) return "unknown";
  return s;
}

}  // namespace tide::cuda
