// Every CUDA kernel entry point of TIDE, in one header (kernels live in kernels/*.cu).
// Host code includes this without needing nvcc: only the CUDA runtime types appear. The
// kernels run kernels/bodies.hpp, which the CPU tests run too (tests/cpp/test_kernel_bodies.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "tide/dtype.hpp"
// The kernels' arithmetic (also run on the CPU by the tests); AccumulateSources.
#include "../../../kernels/bodies.hpp"

namespace tide::cuda {

// TIDE-RS phase 2, the short-lived CTA kernel:
//   dst[i] = scale * ((carry ? dst[i] : 0) + float(src_0[i]) + float(src_1[i]) + ...)
// in fp32, added left to right (bitwise reproducible); `carry`: dst holds the running sum of
// earlier sources (body::accumulate_in_order chains launches for more than
// kMaxAccumulateSources sources with the same bits as one launch). src dtype bf16, f16 or
// f32; dst fp32. Each source is read with 16-byte vector loads when it is 16-byte aligned
// (the planner aligns staging to kAccumulateAlign), element by element otherwise; the
// destination is read and written 16 bytes at a time when aligned. `num_ctas` bounds the
// SMs taken from concurrent compute (0: accumulate_ctas(), from the device). Like every
// launch_* here, returns this launch's own result, never an error an earlier call left behind.
constexpr int64_t kAccumulateAlign = 16;
cudaError_t launch_accumulate_f32(float* dst, const AccumulateSources& srcs, DType src_dtype,
                                  size_t count, float scale, bool carry, int num_ctas,
                                  cudaStream_t stream);

// The benchmark's sweep (benchmarks/gpu/bench_cuda.cu): the same launch with
// `groups_per_thread` (1, 2 or 4) 16-byte groups of every source in flight per thread, where
// launch_accumulate_f32 uses body::kGroupsPerThread. Same results, bit for bit.
cudaError_t launch_accumulate_f32_groups(int groups_per_thread, float* dst, const AccumulateSources& srcs,
                                         DType src_dtype, size_t count, float scale, bool carry, int num_ctas,
                                         cudaStream_t stream);

// The accumulation's provisioning on the current device: CTAs enough to stream HBM (one
// per 8 SMs, at least 4: 16 on an H200's 132 SMs) of 512 threads, few
// enough to leave the SMs to compute. TIDE_RS_CTAS overrides the CTA count.
int accumulate_ctas();

// Bytes the accumulation launches of this process read from sources with vector loads and
// element by element (the benchmark reports the vectorized fraction).
struct AccumulateReads {
  uint64_t vector_bytes = 0, scalar_bytes = 0;
};
AccumulateReads accumulate_reads();

// dst[i] = convert(src[i]) between f32 / bf16 / f16 (to bf16/f16: round to nearest even,
// like the host reduce kernels). TIDE-AG's mixed-precision step: copy engines cannot convert,
// so a rank casts its own shard once before peers copy it.
cudaError_t launch_cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                        cudaStream_t stream);

// Kernel launches made through the launch_* functions of this header by this process
// (for tests: TIDE-AG with equal dtypes must launch none).
uint64_t kernel_launch_count();

}  // namespace tide::cuda
