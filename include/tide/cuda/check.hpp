// Checked CUDA calls. Every runtime (cuda*) and driver (cu*) call of the CUDA layer goes
// through TIDE_CUDA_CHECK / TIDE_CU_CHECK, which throw tide::Error naming the call, the
// rank (set once per process by the CUDA group) and CUDA's error string.
#pragma once
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "tide/error.hpp"

namespace tide::cuda {

// The rank named in CUDA error messages (-1: not known yet). One rank per process.
void set_error_rank(int rank);
int error_rank();

[[noreturn]] void throw_cuda_error(const char* call, int code, const char* what, const char* file,
                                   int line);

}  // namespace tide::cuda

#define TIDE_CUDA_CHECK(call)                                                                   \
  do {                                                                                          \
    cudaError_t tide_e_ = (call);                                                               \
    if (tide_e_ != cudaSuccess)                                                                 \
      ::tide::cuda::throw_cuda_error(#call, static_cast<int>(tide_e_), cudaGetErrorString(tide_e_), \
                                     __FILE__, __LINE__);                                       \
  } while (0)

#define TIDE_CU_CHECK(call)                                                                     \
  do {                                                                                          \
    CUresult tide_r_ = (call);                                                                  \
    if (tide_r_ != CUDA_SUCCESS) {                                                              \
      const char* tide_s_ = nullptr;                                                            \
      if (cuGetErrorString(tide_r_, &tide_s_) != CUDA_SUCCESS || !tide_s_) tide_s_ = "unknown"; \
      ::tide::cuda::throw_cuda_error(#call, static_cast<int>(tide_r_), tide_s_, __FILE__, __LINE__); \
    }                                                                                           \
  } while (0)
