// Every CUDA kernel entry point of TIDE, in one header (kernels live in kernels/*.cu).
// Host code includes this without needing nvcc: only the CUDA runtime types appear.
#pragma once
#include <cstddef>

#include <cuda_runtime_api.h>

#include "tide/dtype.hpp"

namespace tide::cuda {

// Sources reduced by one launch; more are folded in by further launches (accumulate=true).
constexpr int kMaxAccumulateSources = 16;

struct AccumulateSources {
  const void* ptr[kMaxAccumulateSources];
  int count;
};

// TIDE-RS phase 2, the short-lived CTA kernel:
//   dst[i] = (accumulate ? dst[i] : 0) + scale * sum_{s in order} float(src_s[i])
// in fp32, sources summed in the given order (bitwise reproducible). src dtype bf16, f16 or
// f32; dst fp32. 16-byte vector loads when every pointer is 16-byte aligned. `num_ctas`
// bounds the SMs taken from concurrent compute (0: a default of 8).
cudaError_t launch_accumulate_f32(float* dst, const AccumulateSources& srcs, DType src_dtype,
                                  size_t count, float scale, bool accumulate, int num_ctas,
                                  cudaStream_t stream);

}  // namespace tide::cuda
