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

// cuGetErrorString through the run-time resolved driver ("unknown" without a driver).
const char* driver_error_string(int result);

// Every poll of the CUDA layer goes through these: true when the event's (stream's) work is
// done, false while it runs, any other answer throws. A cudaEventQuery / cudaStreamQuery
// answer of cudaErrorNotReady also stays behind as the thread's last error, which the next
// cudaGetLastError() (torch's kernel-launch checks among them) would report as its own
// failure; these clear it.
bool event_done(cudaEvent_t event);
bool stream_done(cudaStream_t stream);

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

// Driver calls: TIDE_CU_CHECK(driver().cuMemMap(...)) (see tide/cuda/driver.hpp).
#define TIDE_CU_CHECK(call)                                                                     \
  do {                                                                                          \
    CUresult tide_r_ = (call);                                                                  \
    if (tide_r_ != CUDA_SUCCESS)                                                                \
      ::tide::cuda::throw_cuda_error(#call, static_cast<int>(tide_r_),                          \
                                     ::tide::cuda::driver_error_string(static_cast<int>(tide_r_)), \
                                     __FILE__, __LINE__);                                       \
  } while (0)
