// TIDE-RS phase 2: reduce staged gradient slices (bf16 / f16 / f32) into an fp32 shard with
// a few short-lived CTAs. The copy engines brought the slices into staging (phase 1); this
// kernel only reads them once and writes the shard once, so it is bandwidth-bound.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tide/cuda/kernels.hpp"

namespace tide::cuda {
void detail_count_launch();  // kernels/cast.cu
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

// Explicit _rn intrinsics: no FMA contraction, so the result is the plain fp32 sum a host
// (or another GPU) computes in the same order.
__device__ __forceinline__ float finish(float old, float acc, float scale, bool accumulate) {
  float v = __fmul_rn(scale, acc);
  return accumulate ? __fadd_rn(old, v) : v;
}

// Elements per 16-byte vector load.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

template <typename T>
__global__ void accumulate_kernel(float* __restrict__ dst, AccumulateSources srcs, size_t count,
                                  float scale, bool accumulate, bool vectorized) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (vectorized) {
    constexpr int V = kVec<T>;
    const size_t nvec = count / V;
    for (size_t v = tid; v < nvec; v += stride) {
      float acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = 0.f;
      for (int s = 0; s < srcs.count; ++s) {  // fixed source order: reproducible sums
        uint4 raw = reinterpret_cast<const uint4*>(srcs.ptr[s])[v];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = __fadd_rn(acc[j], to_f32(e[j]));
      }
      float* out = dst + v * V;
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = finish(out[j], acc[j], scale, accumulate);
    }
    done = nvec * V;
  }
  for (size_t i = done + tid; i < count; i += stride) {
    float acc = 0.f;
    for (int s = 0; s < srcs.count; ++s)
      acc = __fadd_rn(acc, to_f32(static_cast<const T*>(srcs.ptr[s])[i]));
    dst[i] = finish(dst[i], acc, scale, accumulate);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

cudaError_t launch_accumulate_f32(float* dst, const AccumulateSources& srcs, DType src_dtype,
                                  size_t count, float scale, bool accumulate, int num_ctas,
                                  cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (srcs.count < 1 || srcs.count > kMaxAccumulateSources) return cudaErrorInvalidValue;
  bool vectorized = aligned16(dst);
  for (int s = 0; s < srcs.count; ++s) vectorized = vectorized && aligned16(srcs.ptr[s]);
  const int ctas = num_ctas > 0 ? num_ctas : 8;
  detail_count_launch();
  switch (src_dtype) {
    case DType::bf16:
      accumulate_kernel<__nv_bfloat16><<<ctas, kThreads, 0, stream>>>(dst, srcs, count, scale,
                                                                      accumulate, vectorized);
      break;
    case DType::f16:
      accumulate_kernel<__half><<<ctas, kThreads, 0, stream>>>(dst, srcs, count, scale,
                                                               accumulate, vectorized);
      break;
    case DType::f32:
      accumulate_kernel<float><<<ctas, kThreads, 0, stream>>>(dst, srcs, count, scale,
                                                              accumulate, vectorized);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tide::cuda
