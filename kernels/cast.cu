// Small helper kernels of the CUDA layer: dtype cast (TIDE-AG mixed precision) and fp32
// scaling, plus the process-wide launch counter behind kernel_launch_count().
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>

#include "tide/cuda/kernels.hpp"

namespace tide::cuda {

namespace {
std::atomic<uint64_t> g_launches{0};
constexpr int kThreads = 256;

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float ld(const __half* p, size_t i) { return __half2float(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half* p, size_t i, float v) { p[i] = __float2half_rn(v); }

template <typename D, typename S>
__global__ void cast_kernel(D* __restrict__ dst, const S* __restrict__ src, size_t count) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    st(dst, i, ld(src, i));
}

__global__ void scale_kernel(float* dst, size_t count, float scale) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    dst[i] = __fmul_rn(scale, dst[i]);
}

int grid_for(size_t count) {
  size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1024 ? (blocks ? blocks : 1) : 1024);
}

template <typename D>
cudaError_t cast_from(D* dst, const void* src, DType src_dtype, size_t count, cudaStream_t stream) {
  const int grid = grid_for(count);
  switch (src_dtype) {
    case DType::f32:
      cast_kernel<<<grid, kThreads, 0, stream>>>(dst, static_cast<const float*>(src), count);
      break;
    case DType::bf16:
      cast_kernel<<<grid, kThreads, 0, stream>>>(dst, static_cast<const __nv_bfloat16*>(src), count);
      break;
    case DType::f16:
      cast_kernel<<<grid, kThreads, 0, stream>>>(dst, static_cast<const __half*>(src), count);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
}  // namespace

void detail_count_launch() { g_launches.fetch_add(1, std::memory_order_relaxed); }
uint64_t kernel_launch_count() { return g_launches.load(std::memory_order_relaxed); }

cudaError_t launch_cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                        cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  detail_count_launch();
  switch (dst_dtype) {
    case DType::f32: return cast_from(static_cast<float*>(dst), src, src_dtype, count, stream);
    case DType::bf16: return cast_from(static_cast<__nv_bfloat16*>(dst), src, src_dtype, count, stream);
    case DType::f16: return cast_from(static_cast<__half*>(dst), src, src_dtype, count, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_scale_f32(float* dst, size_t count, float scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  detail_count_launch();
  scale_kernel<<<grid_for(count), kThreads, 0, stream>>>(dst, count, scale);
  return cudaGetLastError();
}

}  // namespace tide::cuda
