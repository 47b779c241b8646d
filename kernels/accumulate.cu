// TIDE-RS phase 2: reduce staged gradient slices (bf16 / f16 / f32) into an fp32 shard with
// a few short-lived CTAs. The copy engines brought the slices into staging (phase 1); this
// kernel only reads them once and writes the shard once, so it is bandwidth-bound. The
// arithmetic is kernels/bodies.hpp's accumulate_thread, which CI also runs on the CPU.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../src/core/env.hpp"
#include "bodies.hpp"
#include "launch.cuh"
#include "tide/cuda/kernels.hpp"

namespace tide::cuda {
namespace {

template <class E, int G>
__global__ void __launch_bounds__(body::kAccumulateThreads)
    accumulate_kernel(float* __restrict__ dst, AccumulateSources srcs, size_t count, float scale, bool carry,
                      size_t head, unsigned vector_sources, bool vector_dst) {
  body::accumulate_thread<body::DeviceOps, E, G>(size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                                                 size_t(gridDim.x) * blockDim.x, dst, srcs, count, scale, carry, head,
                                                 vector_sources, vector_dst);
}

std::atomic<uint64_t> vector_read_bytes{0}, scalar_read_bytes{0};

int device_sms() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return sms;
}

}  // namespace

int accumulate_ctas() {
  // A malformed TIDE_RS_CTAS throws; an out-of-range one is the caller's to refuse
  // (CudaGroup: 1..1024), not silently mended here.
  if (const int64_t v = env::get_int("TIDE_RS_CTAS", -1); v != -1) return static_cast<int>(v);
  return std::max(4, device_sms() / 8);
}

AccumulateReads accumulate_reads() { return {vector_read_bytes.load(), scalar_read_bytes.load()}; }

namespace {
template <int G>
cudaError_t launch_accumulate(float* dst, const AccumulateSources& srcs, DType src_dtype, size_t count, float scale,
                              bool carry, int num_ctas, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (srcs.count < 1 || srcs.count > kMaxAccumulateSources) return cudaErrorInvalidValue;
  if (src_dtype != DType::bf16 && src_dtype != DType::f16 && src_dtype != DType::f32) return cudaErrorInvalidValue;
  const size_t es = dtype_size(src_dtype), per_vector = 16 / es;
  const size_t head = body::accumulate_head(srcs, es, dst, count);
  const unsigned vector_sources = body::vector_sources(srcs, head, es);
  for (int s = 0; s < srcs.count; ++s) {
    const size_t vector_elems = (vector_sources >> s & 1u) ? (count - head) / per_vector * per_vector : 0;
    vector_read_bytes += vector_elems * es;
    scalar_read_bytes += (count - vector_elems) * es;
  }
  const bool vector_dst = body::aligned16(dst + head);
  const int ctas = num_ctas > 0 ? num_ctas : accumulate_ctas();
  const int threads = body::kAccumulateThreads;
  switch (src_dtype) {
    case DType::bf16:
      return launch_kernel(accumulate_kernel<body::Bf16, G>, ctas, threads, stream, dst, srcs, count, scale, carry,
                           head, vector_sources, vector_dst);
    case DType::f16:
      return launch_kernel(accumulate_kernel<body::F16, G>, ctas, threads, stream, dst, srcs, count, scale, carry,
                           head, vector_sources, vector_dst);
    default:
      return launch_kernel(accumulate_kernel<body::F32, G>, ctas, threads, stream, dst, srcs, count, scale, carry,
                           head, vector_sources, vector_dst);
  }
}
}  // namespace

cudaError_t launch_accumulate_f32(float* dst, const AccumulateSources& srcs, DType src_dtype, size_t count,
                                  float scale, bool carry, int num_ctas, cudaStream_t stream) {
  return launch_accumulate<body::kGroupsPerThread>(dst, srcs, src_dtype, count, scale, carry, num_ctas, stream);
}

cudaError_t launch_accumulate_f32_groups(int groups_per_thread, float* dst, const AccumulateSources& srcs,
                                         DType src_dtype, size_t count, float scale, bool carry, int num_ctas,
                                         cudaStream_t stream) {
  switch (groups_per_thread) {
    case 1: return launch_accumulate<1>(dst, srcs, src_dtype, count, scale, carry, num_ctas, stream);
    case 2: return launch_accumulate<2>(dst, srcs, src_dtype, count, scale, carry, num_ctas, stream);
    case 4: return launch_accumulate<4>(dst, srcs, src_dtype, count, scale, carry, num_ctas, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace tide::cuda
