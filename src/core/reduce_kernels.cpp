// Reductions for every DType x ReduceOp. Each block of kBlock elements is accumulated in a
// local array, one source at a time in source order: simple loops the compiler vectorises,
// and a fixed summation order for bitwise reproducibility.
#include "tide/reduce_kernels.hpp"

// GCC's -O2 vectoriser uses the "very cheap" cost model, which skips every loop here (their
// trip counts are not known at compile time). These loops are the whole point of the file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("tree-vectorize", "vect-cost-model=dynamic")
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "tide/error.hpp"

namespace tide {
namespace {

inline float bits_to_float(uint32_t u) { return std::bit_cast<float>(u); }
inline uint32_t float_to_bits(float f) { return std::bit_cast<uint32_t>(f); }

[[gnu::always_inline]] inline float bf16_to_float_(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

[[gnu::always_inline]] inline uint16_t float_to_bf16_(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  // NaN stays NaN (quieted); written as a select so loops over it vectorise.
  return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : rounded) >> 16);
}

// f16 conversions without branches (after Maratyszcza's FP16 library), so they vectorise;
// the FPU does the rounding (nearest even) and the subnormal handling.
[[gnu::always_inline]] inline float f16_to_float_(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normal = bits_to_float((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  const float subnormal = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  // Signed compares of halved values: SSE2 has no unsigned 32-bit compare.
  const bool is_sub = static_cast<int32_t>(two_w >> 1) < (1 << 26);
  return bits_to_float(sign | (is_sub ? float_to_bits(subnormal) : float_to_bits(normal)));
}

[[gnu::always_inline]] inline uint16_t float_to_f16_(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  int32_t half_bias = static_cast<int32_t>((shl1_w & 0xff000000u) >> 1);
  half_bias = half_bias < 0x38800000 ? 0x38800000 : half_bias;
  base = bits_to_float(static_cast<uint32_t>(half_bias) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
  const bool nan = static_cast<int32_t>(shl1_w >> 1) > 0x7f800000;
  return static_cast<uint16_t>((sign >> 16) | (nan ? 0x7e00u : nonsign));
}

}  // namespace

float bf16_to_float(uint16_t h) { return bf16_to_float_(h); }
uint16_t float_to_bf16(float f) { return float_to_bf16_(f); }
float f16_to_float(uint16_t h) { return f16_to_float_(h); }
uint16_t float_to_f16(float f) { return float_to_f16_(f); }

namespace {

struct bf16_t { uint16_t v; };
struct f16_t { uint16_t v; };

// Load a stored element into the accumulator type, store it back.
template <class A, class S> inline A load(S x) { return static_cast<A>(x); }
template <> inline float load<float, bf16_t>(bf16_t x) { return bf16_to_float_(x.v); }
template <> inline float load<float, f16_t>(f16_t x) { return f16_to_float_(x.v); }
template <class D, class A> inline D store(A a) { return static_cast<D>(a); }
template <> inline bf16_t store<bf16_t, float>(float a) { return {float_to_bf16_(a)}; }
template <> inline f16_t store<f16_t, float>(float a) { return {float_to_f16_(a)}; }

constexpr size_t kBlock = 1024;

// Accumulators: fp32 for f32/bf16/f16, f64, and int64 for the integers and bool; integer
// sums and products wrap (done in uint64 so there is no UB), then truncate to the type.
template <class A> inline A add(A a, A b) { return a + b; }
template <> inline int64_t add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
template <class A> inline A mul(A a, A b) { return a * b; }
template <> inline int64_t mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

enum class K { sum, max, min, prod, bor, band, bxor };

template <K k, class A> inline A combine(A a, A b) {
  if constexpr (k == K::sum) return add(a, b);
  else if constexpr (k == K::max) return a < b ? b : a;
  else if constexpr (k == K::min) return b < a ? b : a;
  else if constexpr (k == K::prod) return mul(a, b);
  else if constexpr (k == K::bor) return a | b;
  else if constexpr (k == K::band) return a & b;
  else return a ^ b;
}

// pre: 0 none, 1 multiply by factor, 2 bool (x != 0); post: 0 none, 1 divide by n, 2 bool.
template <K k, int pre, int post, class S, class D, class A>
void run(D* dst, const S* const* srcs, size_t n, size_t count, A factor, size_t divisor = 0) {
  A acc[kBlock];
  auto in = [&](S x) -> A {
    A v = load<A, S>(x);
    if constexpr (pre == 1) v = mul(v, factor);
    if constexpr (pre == 2) v = (v != 0);
    return v;
  };
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const S* s0 = srcs[0] + base;
    for (size_t i = 0; i < m; ++i) acc[i] = in(s0[i]);
    for (size_t r = 1; r < n; ++r) {
      const S* s = srcs[r] + base;
      for (size_t i = 0; i < m; ++i) acc[i] = combine<k>(acc[i], in(s[i]));
    }
    D* d = dst + base;
    if constexpr (post == 1) {
      const A div = static_cast<A>(divisor ? divisor : n);
      for (size_t i = 0; i < m; ++i) d[i] = store<D, A>(acc[i] / div);
    } else if constexpr (post == 2) {
      for (size_t i = 0; i < m; ++i) d[i] = static_cast<D>(acc[i] != 0);
    } else {
      for (size_t i = 0; i < m; ++i) d[i] = store<D, A>(acc[i]);
    }
  }
}

template <class S, class D, class A>
void dispatch_op(void* dst, const void* const* srcs, size_t n, size_t count, ReduceArgs args) {
  auto d = static_cast<D*>(dst);
  auto s = reinterpret_cast<const S* const*>(srcs);
  const A f = static_cast<A>(args.premul_factor);
  switch (args.op) {
    case ReduceOp::sum: return run<K::sum, 0, 0, S, D, A>(d, s, n, count, f);
    case ReduceOp::avg: return run<K::sum, 0, 1, S, D, A>(d, s, n, count, f, args.avg_divisor);
    case ReduceOp::max: return run<K::max, 0, 0, S, D, A>(d, s, n, count, f);
    case ReduceOp::min: return run<K::min, 0, 0, S, D, A>(d, s, n, count, f);
    case ReduceOp::product: return run<K::prod, 0, 0, S, D, A>(d, s, n, count, f);
    case ReduceOp::premul_sum: return run<K::sum, 1, 0, S, D, A>(d, s, n, count, f);
    case ReduceOp::band: case ReduceOp::bor: case ReduceOp::bxor:
      // Integers only (check_reduce refuses the rest). Sign-extended int64 accumulators
      // give the same low bits as the narrow type would.
      if constexpr (std::is_integral_v<A>) {
        if (args.op == ReduceOp::band) return run<K::band, 0, 0, S, D, A>(d, s, n, count, f);
        if (args.op == ReduceOp::bor) return run<K::bor, 0, 0, S, D, A>(d, s, n, count, f);
        return run<K::bxor, 0, 0, S, D, A>(d, s, n, count, f);
      }
      break;
  }
}

void dispatch_bool(void* dst, const void* const* srcs, size_t n, size_t count, ReduceOp op) {
  auto d = static_cast<uint8_t*>(dst);
  auto s = reinterpret_cast<const uint8_t* const*>(srcs);
  switch (op) {
    case ReduceOp::sum: case ReduceOp::max:
      return run<K::bor, 2, 2, uint8_t, uint8_t, int64_t>(d, s, n, count, 0);
    case ReduceOp::min: case ReduceOp::product: case ReduceOp::band:
      return run<K::band, 2, 2, uint8_t, uint8_t, int64_t>(d, s, n, count, 0);
    case ReduceOp::bor:
      return run<K::bor, 2, 2, uint8_t, uint8_t, int64_t>(d, s, n, count, 0);
    case ReduceOp::bxor:
      return run<K::bxor, 2, 2, uint8_t, uint8_t, int64_t>(d, s, n, count, 0);
    default: break;
  }
}

}  // namespace

void check_reduce(const char* collective, int rank, DType src, DType dst, ReduceOp op) {
  bool widen = (src == DType::bf16 || src == DType::f16) && dst == DType::f32;
  TIDE_CHECK(src == dst || widen, "tide ", collective, ": rank ", rank, ": cannot reduce ", dtype_name(src), " into ",
             dtype_name(dst), " (only equal types, or bf16/f16 into f32)");
  TIDE_CHECK(!(src == DType::boolean && (op == ReduceOp::avg || op == ReduceOp::premul_sum)), "tide ",
             collective, ": rank ", rank, ": ", reduce_op_name(op), " is not defined for bool");
  const bool bitwise = op == ReduceOp::band || op == ReduceOp::bor || op == ReduceOp::bxor;
  TIDE_CHECK(!(bitwise && is_floating(src)), "tide ", collective, ": rank ", rank, ": ", reduce_op_name(op),
             " is a bitwise reduction, defined for integer and bool tensors, not ", dtype_name(src));
}

void reduce_kernel(void* dst, DType dst_dtype, const void* const* srcs, size_t n, DType src_dtype,
                   size_t count, ReduceArgs args) {
  if (count == 0 || n == 0) return;
  if (src_dtype != dst_dtype) {  // mixed precision: bf16/f16 -> f32
    if (src_dtype == DType::bf16) return dispatch_op<bf16_t, float, float>(dst, srcs, n, count, args);
    if (src_dtype == DType::f16) return dispatch_op<f16_t, float, float>(dst, srcs, n, count, args);
    // fp32 partial sums into bf16/f16 (TIDE-RS across nodes, whose partials are fp32)
    if (dst_dtype == DType::bf16) return dispatch_op<float, bf16_t, float>(dst, srcs, n, count, args);
    return dispatch_op<float, f16_t, float>(dst, srcs, n, count, args);
  }
  switch (src_dtype) {
    case DType::f32: return dispatch_op<float, float, float>(dst, srcs, n, count, args);
    case DType::f64: return dispatch_op<double, double, double>(dst, srcs, n, count, args);
    case DType::bf16: return dispatch_op<bf16_t, bf16_t, float>(dst, srcs, n, count, args);
    case DType::f16: return dispatch_op<f16_t, f16_t, float>(dst, srcs, n, count, args);
    case DType::i8: return dispatch_op<int8_t, int8_t, int64_t>(dst, srcs, n, count, args);
    case DType::u8: return dispatch_op<uint8_t, uint8_t, int64_t>(dst, srcs, n, count, args);
    case DType::i16: return dispatch_op<int16_t, int16_t, int64_t>(dst, srcs, n, count, args);
    case DType::i32: return dispatch_op<int32_t, int32_t, int64_t>(dst, srcs, n, count, args);
    case DType::i64: return dispatch_op<int64_t, int64_t, int64_t>(dst, srcs, n, count, args);
    case DType::boolean: return dispatch_bool(dst, srcs, n, count, args.op);
  }
}

}  // namespace tide

// ---- conversions (src/core/convert.hpp) ---------------------------------------------------
#include "convert.hpp"

namespace tide {
namespace {
template <class S, class D>
void convert_loop(void* dst, const void* src, size_t count) {
  auto d = static_cast<D*>(dst);
  auto s = static_cast<const S*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = store<D, float>(load<float, S>(s[i]));
}
}  // namespace

bool can_convert(DType src, DType dst) {
  if (src == dst) return true;
  const bool half_src = src == DType::bf16 || src == DType::f16, half_dst = dst == DType::bf16 || dst == DType::f16;
  return (src == DType::f32 && half_dst) || (half_src && dst == DType::f32);
}

void convert_kernel(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count) {
  if (count == 0) return;
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, count * dtype_size(src_dtype));
    return;
  }
  if (src_dtype == DType::f32 && dst_dtype == DType::bf16) return convert_loop<float, bf16_t>(dst, src, count);
  if (src_dtype == DType::f32 && dst_dtype == DType::f16) return convert_loop<float, f16_t>(dst, src, count);
  if (src_dtype == DType::bf16 && dst_dtype == DType::f32) return convert_loop<bf16_t, float>(dst, src, count);
  if (src_dtype == DType::f16 && dst_dtype == DType::f32) return convert_loop<f16_t, float>(dst, src, count);
  throw Error(detail::concat("tide: cannot convert ", dtype_name(src_dtype), " to ", dtype_name(dst_dtype),
                             " (only equal types, f32 <-> bf16/f16)"));
}

}  // namespace tide
