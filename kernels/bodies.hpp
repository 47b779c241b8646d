// The arithmetic of TIDE's CUDA kernels, written once for two compilers. nvcc runs each body
// as a kernel's threads (kernels/*.cu, with DeviceOps below); g++ runs the same body in a grid
// emulated by loops over blocks and threads (tests/cpp/test_kernel_bodies.cpp, with host
// primitives), so the index arithmetic, the vector / scalar split, the launch plan and the
// sum order are tested on every CI run, without a GPU. Only the primitives differ between
// the two: a 16-byte load and store, the dtype conversions, fp32 add and multiply rounded to
// nearest (never contracted into an FMA on either side).
//
// No CUDA header is needed outside nvcc: host code (rs_node.cpp, the tests) includes this.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define TIDE_BODY __device__ __forceinline__
#else
#define TIDE_BODY inline
#endif

namespace tide::cuda {

// Sources reduced by one accumulate launch; more are folded in by further launches
// (accumulate_in_order below).
constexpr int kMaxAccumulateSources = 16;

struct AccumulateSources {
  const void* ptr[kMaxAccumulateSources];
  int count;
};

namespace body {

// Element types, named by their bits; the primitives convert.
struct Bf16 { using Bits = uint16_t; };
struct F16 { using Bits = uint16_t; };
struct F32 { using Bits = float; };

template <class E>
constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Bits));  // elements per 16-byte load

// ---- accumulate: dst[i] = scale * ((carry ? dst[i] : 0) + src_0[i] + src_1[i] + ...) ------
// fp32, added strictly left to right. `carry`: dst holds the running sum of earlier sources
// (a previous launch with scale 1), so a chain of launches sums exactly as one launch would.
constexpr int kAccumulateThreads = 512;
// Memory-level parallelism, one thread: kGroupsPerThread 16-byte groups of every source in a
// batch of kSourceBatch sources are loaded before any of them is added (a loop that loads
// and adds one source at a time has one load in flight and is latency-bound).
constexpr int kGroupsPerThread = 4;  // the benchmark's sweep: +17% over 2 at 16 CTAs on an H200
constexpr int kSourceBatch = 4;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline const void* advance(const void* p, size_t bytes) { return static_cast<const char*>(p) + bytes; }

// The head: how many leading elements are summed element by element so that, from there on,
// as many bytes as possible are read and written 16 at a time (the sources' and the fp32
// destination's, weighed by their bytes; the smallest such head). TIDE-RS's planner stages
// each part at an offset congruent with its place in the output (RsPipelineOptions::
// align_bytes), so one head aligns the staged sources and the destination together, also
// where the output's layout puts a parameter off a 16-byte boundary.
inline size_t accumulate_head(const AccumulateSources& s, size_t elem_bytes, const float* dst, size_t count) {
  const size_t per_vector = 16 / elem_bytes;
  size_t best = 0, best_bytes = 0;
  for (size_t h = 0; h < per_vector && h < count; ++h) {
    size_t bytes = aligned16(dst + h) ? 4 : 0;
    for (int i = 0; i < s.count; ++i) bytes += aligned16(advance(s.ptr[i], h * elem_bytes)) ? elem_bytes : 0;
    if (bytes > best_bytes) best = h, best_bytes = bytes;
  }
  return best;
}

// Bit s set: source s is 16-byte aligned after the head and read with vector loads; the
// others element by element (the sum order is the same either way).
inline unsigned vector_sources(const AccumulateSources& s, size_t head, size_t elem_bytes) {
  unsigned bits = 0;
  for (int i = 0; i < s.count; ++i) bits |= static_cast<unsigned>(aligned16(advance(s.ptr[i], head * elem_bytes))) << i;
  return bits;
}

// Thread `thread` of `threads`. The first `head` elements, and those past the last whole
// group, are summed one per thread, element by element. Group g (elements head + g*V ..
// head + g*V + V-1) belongs to the thread with g % threads == thread; a thread takes G
// (kGroupsPerThread) of its groups at once, `threads` apart, so neighbouring threads read
// neighbouring 16 bytes (coalesced). `vector_dst`: dst + head is 16-byte aligned (read and
// written 16 bytes at a time).
template <class Ops, class E, int G = kGroupsPerThread>
TIDE_BODY void accumulate_thread(size_t thread, size_t threads, float* dst, const AccumulateSources& srcs,
                                 size_t count, float scale, bool carry, size_t head, unsigned vector_sources,
                                 bool vector_dst) {
  using Bits = typename E::Bits;
  constexpr int V = kVec<E>, B = kSourceBatch;
  auto one_element = [&](size_t i) {
    float a = carry ? dst[i] : 0.f;
    for (int s = 0; s < srcs.count; ++s) a = Ops::add(a, Ops::to_f32(E{}, static_cast<const Bits*>(srcs.ptr[s])[i]));
    dst[i] = Ops::mul(scale, a);
  };
  if (head > count) head = count;
  for (size_t i = thread; i < head; i += threads) one_element(i);
  const size_t groups = (count - head) / V;
  for (size_t first = thread; first < groups; first += threads * G) {
    int live = 0;  // groups of this round that exist
    while (live < G && first + static_cast<size_t>(live) * threads < groups) ++live;
    alignas(16) float acc[G][V];
#pragma unroll
    for (int k = 0; k < G; ++k) {
      if (k >= live) break;
      float* out = dst + head + (first + static_cast<size_t>(k) * threads) * V;
#pragma unroll
      for (int j = 0; j < V; j += 4) {
        if (carry && vector_dst) {
          Ops::load16(out + j, *reinterpret_cast<float(*)[4]>(&acc[k][j]));
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[k][j + q] = carry ? out[j + q] : 0.f;
        }
      }
    }
    for (int s0 = 0; s0 < srcs.count; s0 += B) {
      const int batch = srcs.count - s0 < B ? srcs.count - s0 : B;
      alignas(16) Bits e[B][G][V];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        if (b >= batch) break;
        const Bits* src = static_cast<const Bits*>(srcs.ptr[s0 + b]);
        const bool vec = (vector_sources >> (s0 + b)) & 1u;
#pragma unroll
        for (int k = 0; k < G; ++k) {
          if (k >= live) break;
          const Bits* p = src + head + (first + static_cast<size_t>(k) * threads) * V;
          if (vec) {
            Ops::load16(p, e[b][k]);
          } else {
#pragma unroll
            for (int j = 0; j < V; ++j) e[b][k][j] = p[j];
          }
        }
      }
#pragma unroll
      for (int b = 0; b < B; ++b) {  // sources strictly in order: reproducible sums
        if (b >= batch) break;
#pragma unroll
        for (int k = 0; k < G; ++k) {
          if (k >= live) break;
#pragma unroll
          for (int j = 0; j < V; ++j) acc[k][j] = Ops::add(acc[k][j], Ops::to_f32(E{}, e[b][k][j]));
        }
      }
    }
#pragma unroll
    for (int k = 0; k < G; ++k) {
      if (k >= live) break;
      float* out = dst + head + (first + static_cast<size_t>(k) * threads) * V;
#pragma unroll
      for (int j = 0; j < V; j += 4) {
        alignas(16) float o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) o[q] = Ops::mul(scale, acc[k][j + q]);
        if (vector_dst) {
          Ops::store16(out + j, o);
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) out[j + q] = o[q];
        }
      }
    }
  }
  for (size_t i = head + groups * V + thread; i < count; i += threads) one_element(i);
}

// The launches that sum `n` sources in order (TIDE-RS's executors, where a node has more
// ranks than one launch takes): launches of at most kMaxAccumulateSources sources, each
// after the first carrying the running sum in dst, scale 1 but for the last. The result is
// bitwise the one launch's: scale * (((0 + src_0) + src_1) + ... + src_{n-1}).
// accumulate(sources, scale, carry) launches one.
template <class Accumulate>
void accumulate_in_order(const void* const* srcs, int n, float scale, Accumulate&& accumulate) {
  for (int first = 0; first < n; first += kMaxAccumulateSources) {
    AccumulateSources batch{};
    batch.count = std::min(kMaxAccumulateSources, n - first);
    for (int k = 0; k < batch.count; ++k) batch.ptr[k] = srcs[first + k];
    const bool last = first + batch.count == n;
    accumulate(static_cast<const AccumulateSources&>(batch), last ? scale : 1.f, first > 0);
  }
}

// ---- element-wise: cast -------------------------------------------------------
constexpr int kElementwiseThreads = 256;
inline int elementwise_grid(size_t count) {
  const size_t blocks = (count + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<int>(std::clamp<size_t>(blocks, 1, 1024));
}

// dst[i] = convert(src[i]) (to bf16 / f16: round to nearest even).
template <class Ops, class D, class S>
TIDE_BODY void cast_thread(size_t thread, size_t threads, typename D::Bits* dst, const typename S::Bits* src,
                           size_t count) {
  for (size_t i = thread; i < count; i += threads) dst[i] = Ops::from_f32(D{}, Ops::to_f32(S{}, src[i]));
}

#if defined(__CUDACC__)
// The GPU's primitives. Explicit _rn intrinsics: no FMA contraction, so a sum is the plain
// fp32 sum a host computes in the same order.
struct DeviceOps {
  template <class T>
  static __device__ __forceinline__ void load16(const T* p, T (&out)[16 / sizeof(T)]) {
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(p);
  }
  static __device__ __forceinline__ void store16(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
  static __device__ __forceinline__ float to_f32(Bf16, uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
  static __device__ __forceinline__ float to_f32(F16, uint16_t b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ float to_f32(F32, float v) { return v; }
  static __device__ __forceinline__ uint16_t from_f32(Bf16, float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  static __device__ __forceinline__ uint16_t from_f32(F16, float v) { return __half_as_ushort(__float2half_rn(v)); }
  static __device__ __forceinline__ float from_f32(F32, float v) { return v; }
  static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
};
#endif

}  // namespace body
}  // namespace tide::cuda
