// TIDE-RS phase 2: reduce staged gradient slices (bf16 / f16 / f32) into an fp32 shard with
// a few short-lived CTAs. The copy engines brought the slices into staging (phase 1); this
// kernel only reads them once and writes the shard once, so it is bandwidth-bound.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../src/core/env.hpp"
#include "tide/cuda/kernels.hpp"

namespace tide::cuda {
void detail_count_launch();  // kernels/cast.cu
namespace {

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

// Thread t handles groups of V = kVec<T> consecutive elements. Source s is read with one
// 16-byte load per group when bit s of `vector_sources` is set (it is 16-byte aligned),
// else element by element; the sum order is the same either way. `vector_dst`: the
// destination is 16-byte aligned (float4 stores).
template <typename T>
__global__ void accumulate_kernel(float* __restrict__ dst, AccumulateSources srcs, size_t count, float scale,
                                  bool accumulate, unsigned vector_sources, bool vector_dst) {
  constexpr int V = kVec<T>;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t groups = count / V;
  for (size_t g = size_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    for (int s = 0; s < srcs.count; ++s) {  // fixed source order: reproducible sums
      const T* src = static_cast<const T*>(srcs.ptr[s]) + g * V;
      alignas(16) T e[V];
      if (vector_sources >> s & 1u) {
        *reinterpret_cast<uint4*>(e) = *reinterpret_cast<const uint4*>(src);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) e[j] = src[j];
      }
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = __fadd_rn(acc[j], to_f32(e[j]));
    }
    float* out = dst + g * V;
    if (vector_dst) {
#pragma unroll
      for (int j = 0; j < V; j += 4) {
        float4 o = accumulate ? *reinterpret_cast<const float4*>(out + j) : make_float4(0.f, 0.f, 0.f, 0.f);
        o.x = finish(o.x, acc[j], scale, accumulate);
        o.y = finish(o.y, acc[j + 1], scale, accumulate);
        o.z = finish(o.z, acc[j + 2], scale, accumulate);
        o.w = finish(o.w, acc[j + 3], scale, accumulate);
        *reinterpret_cast<float4*>(out + j) = o;
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = finish(out[j], acc[j], scale, accumulate);
    }
  }
  for (size_t i = groups * V + size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = 0.f;
    for (int s = 0; s < srcs.count; ++s) acc = __fadd_rn(acc, to_f32(static_cast<const T*>(srcs.ptr[s])[i]));
    dst[i] = finish(dst[i], acc, scale, accumulate);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

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

int accumulate_threads() { return 512; }

int accumulate_ctas() {
  // A malformed TIDE_RS_CTAS throws; an out-of-range one is the caller's to refuse
  // (CudaGroup: 1..1024), not silently mended here.
  if (const int64_t v = env::get_int("TIDE_RS_CTAS", -1); v != -1) return static_cast<int>(v);
  return std::max(4, device_sms() / 8);
}

AccumulateReads accumulate_reads() { return {vector_read_bytes.load(), scalar_read_bytes.load()}; }

cudaError_t launch_accumulate_f32(float* dst, const AccumulateSources& srcs, DType src_dtype,
                                  size_t count, float scale, bool accumulate, int num_ctas,
                                  cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (srcs.count < 1 || srcs.count > kMaxAccumulateSources) return cudaErrorInvalidValue;
  const size_t es = src_dtype == DType::f32 ? 4 : 2;
  unsigned vector_sources = 0;
  for (int s = 0; s < srcs.count; ++s) {
    const bool v = aligned16(srcs.ptr[s]);
    vector_sources |= static_cast<unsigned>(v) << s;
    const size_t vector_elems = v ? count / (16 / es) * (16 / es) : 0;
    vector_read_bytes += vector_elems * es;
    scalar_read_bytes += (count - vector_elems) * es;
  }
  const bool vector_dst = aligned16(dst);
  const int ctas = num_ctas > 0 ? num_ctas : accumulate_ctas();
  const int threads = accumulate_threads();
  detail_count_launch();
  switch (src_dtype) {
    case DType::bf16:
      accumulate_kernel<__nv_bfloat16><<<ctas, threads, 0, stream>>>(dst, srcs, count, scale, accumulate,
                                                                     vector_sources, vector_dst);
      break;
    case DType::f16:
      accumulate_kernel<__half><<<ctas, threads, 0, stream>>>(dst, srcs, count, scale, accumulate, vector_sources,
                                                              vector_dst);
      break;
    case DType::f32:
      accumulate_kernel<float><<<ctas, threads, 0, stream>>>(dst, srcs, count, scale, accumulate, vector_sources,
                                                             vector_dst);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tide::cuda
