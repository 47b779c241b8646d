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

}  // namespace tide::cuda
