// The dtype cast of TIDE-AG's mixed precision, and the process-wide launch counter behind
// kernel_launch_count(). The arithmetic is kernels/bodies.hpp's, which CI also runs on the CPU.
#include <atomic>
#include <cstdint>

#include "bodies.hpp"
#include "launch.cuh"
#include "tide/cuda/kernels.hpp"

namespace tide::cuda {

namespace {
std::atomic<uint64_t> g_launches{0};

template <class D, class S>
__global__ void cast_kernel(typename D::Bits* __restrict__ dst, const typename S::Bits* __restrict__ src, size_t count) {
  body::cast_thread<body::DeviceOps, D, S>(size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                                           size_t(gridDim.x) * blockDim.x, dst, src, count);
}

template <class D>
cudaError_t cast_from(void* dst, const void* src, DType src_dtype, size_t count, cudaStream_t stream) {
  const int grid = body::elementwise_grid(count), threads = body::kElementwiseThreads;
  auto* d = static_cast<typename D::Bits*>(dst);
  switch (src_dtype) {
    case DType::f32:
      return launch_kernel(cast_kernel<D, body::F32>, grid, threads, stream, d, static_cast<const float*>(src), count);
    case DType::bf16:
      return launch_kernel(cast_kernel<D, body::Bf16>, grid, threads, stream, d, static_cast<const uint16_t*>(src),
                           count);
    case DType::f16:
      return launch_kernel(cast_kernel<D, body::F16>, grid, threads, stream, d, static_cast<const uint16_t*>(src),
                           count);
    default:
      return cudaErrorInvalidValue;
  }
}
}  // namespace

void detail_count_launch() { g_launches.fetch_add(1, std::memory_order_relaxed); }
uint64_t kernel_launch_count() { return g_launches.load(std::memory_order_relaxed); }

cudaError_t launch_cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                        cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (dst_dtype) {
    case DType::f32: return cast_from<body::F32>(dst, src, src_dtype, count, stream);
    case DType::bf16: return cast_from<body::Bf16>(dst, src, src_dtype, count, stream);
    case DType::f16: return cast_from<body::F16>(dst, src, src_dtype, count, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace tide::cuda
