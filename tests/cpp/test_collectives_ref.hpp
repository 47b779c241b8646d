// Independent references for the collective tests: random non-zero data per (seed, rank,
// tag), and element-wise reductions computed here, not with tide's kernels.
//  - f32/f64 and integers: the same arithmetic in rank order, compared bitwise;
//  - bf16/f16 (and bf16/f16 -> f32): float64 reference with a stated tolerance.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tide/comm.hpp"
#include "tide/dtype.hpp"

namespace tide::test {

inline const DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i8,
                                   DType::u8,  DType::i16, DType::i32,  DType::i64, DType::boolean};
inline const ReduceOp kAllOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max,
                                   ReduceOp::min, ReduceOp::product, ReduceOp::premul_sum};

inline bool op_defined(DType dt, ReduceOp op) {
  return !(dt == DType::boolean && (op == ReduceOp::avg || op == ReduceOp::premul_sum));
}
// premul factor: inexact for floats, an integer for integer types.
inline double premul_factor(DType dt) { return is_floating(dt) ? 0.37 : 3.0; }

inline uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  return x * 0xbf58476d1ce4e5b9ull;
}

// Encodes an exactly representable value (tests only generate such values for bf16/f16).
inline uint16_t to_bf16_exact(double v) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(v)) >> 16); }
inline uint16_t to_f16_exact(double v) {
  _Float16 h = static_cast<_Float16>(static_cast<float>(v));
  return std::bit_cast<uint16_t>(h);
}
inline double from_f16(uint16_t b) { return static_cast<double>(std::bit_cast<_Float16>(b)); }
inline double from_bf16(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

inline double value_at(DType dt, const void* p, size_t i) {
  auto b = static_cast<const uint8_t*>(p);
  switch (dt) {
    case DType::f32: { float v; std::memcpy(&v, b + 4 * i, 4); return v; }
    case DType::f64: { double v; std::memcpy(&v, b + 8 * i, 8); return v; }
    case DType::bf16: { uint16_t v; std::memcpy(&v, b + 2 * i, 2); return from_bf16(v); }
    case DType::f16: { uint16_t v; std::memcpy(&v, b + 2 * i, 2); return from_f16(v); }
    case DType::i8: return static_cast<int8_t>(b[i]);
    case DType::u8: case DType::boolean: return b[i];
    case DType::i16: { int16_t v; std::memcpy(&v, b + 2 * i, 2); return v; }
    case DType::i32: { int32_t v; std::memcpy(&v, b + 4 * i, 4); return v; }
    case DType::i64: { int64_t v; std::memcpy(&v, b + 8 * i, 8); return static_cast<double>(v); }
  }
  return 0;
}

// `count` random non-zero elements of `dt`. bf16/f16 values are k/64, |k| <= 128, so they
// and their sums are exact in fp32 and double.
inline std::vector<uint8_t> random_elems(DType dt, size_t count, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<uint8_t> out(count * dtype_size(dt));
  auto put = [&](size_t i, auto v) { std::memcpy(out.data() + i * sizeof(v), &v, sizeof(v)); };
  std::uniform_int_distribution<int> k(1, 128), sign(0, 1);
  for (size_t i = 0; i < count; ++i) {
    switch (dt) {
      case DType::f32: { float v = std::uniform_real_distribution<float>(0.05f, 2.0f)(g); put(i, sign(g) ? -v : v); break; }
      case DType::f64: { double v = std::uniform_real_distribution<double>(0.05, 2.0)(g); put(i, sign(g) ? -v : v); break; }
      case DType::bf16: put(i, to_bf16_exact((sign(g) ? -1 : 1) * k(g) / 64.0)); break;
      case DType::f16: put(i, to_f16_exact((sign(g) ? -1 : 1) * k(g) / 64.0)); break;
      case DType::i8: put(i, static_cast<int8_t>((sign(g) ? -1 : 1) * std::uniform_int_distribution<int>(1, 100)(g))); break;
      case DType::u8: put(i, static_cast<uint8_t>(std::uniform_int_distribution<int>(1, 255)(g))); break;
      case DType::i16: put(i, static_cast<int16_t>((sign(g) ? -1 : 1) * std::uniform_int_distribution<int>(1, 1000)(g))); break;
      case DType::i32: put(i, static_cast<int32_t>((sign(g) ? -1 : 1) * std::uniform_int_distribution<int>(1, 100000)(g))); break;
      case DType::i64: put(i, static_cast<int64_t>((sign(g) ? -1 : 1) * std::uniform_int_distribution<int64_t>(1, int64_t{1} << 40)(g))); break;
      case DType::boolean: put(i, static_cast<uint8_t>(sign(g))); break;  // bool data is 0/1 by nature
    }
  }
  return out;
}

namespace ref_detail {
template <class T, class A>
std::vector<uint8_t> exact(const std::vector<const void*>& srcs, size_t count, ReduceArgs args) {
  std::vector<uint8_t> out(count * sizeof(T));
  const size_t n = srcs.size();
  for (size_t i = 0; i < count; ++i) {
    auto x = [&](size_t r) { T v; std::memcpy(&v, static_cast<const uint8_t*>(srcs[r]) + i * sizeof(T), sizeof(T)); return static_cast<A>(v); };
    A acc{};
    for (size_t r = 0; r < n; ++r) {
      A v = x(r);
      if (args.op == ReduceOp::premul_sum) {
        if constexpr (std::is_floating_point_v<T>) v = static_cast<A>(args.premul_factor) * v;
        else v = static_cast<A>(static_cast<uint64_t>(v) * static_cast<uint64_t>(static_cast<A>(args.premul_factor)));
      }
      if (r == 0) { acc = v; continue; }
      switch (args.op) {
        case ReduceOp::sum: case ReduceOp::avg: case ReduceOp::premul_sum:
          if constexpr (std::is_floating_point_v<T>) acc = acc + v;
          else acc = static_cast<A>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(v));
          break;
        case ReduceOp::max: acc = std::max(acc, v); break;
        case ReduceOp::min: acc = std::min(acc, v); break;
        case ReduceOp::product:
          if constexpr (std::is_floating_point_v<T>) acc = acc * v;
          else acc = static_cast<A>(static_cast<uint64_t>(acc) * static_cast<uint64_t>(v));
          break;
      }
    }
    if (args.op == ReduceOp::avg) acc = acc / static_cast<A>(n);
    T t = static_cast<T>(acc);
    std::memcpy(out.data() + i * sizeof(T), &t, sizeof(T));
  }
  return out;
}
}  // namespace ref_detail

// Checks `got` (count elements of out) against the reduction of `srcs` (rank order).
// Returns "" when it matches, else a description of the first mismatch.
inline std::string check_reduction(const void* got, DType out, const std::vector<const void*>& srcs, DType in,
                                   size_t count, ReduceArgs args) {
  std::vector<uint8_t> want;
  switch (in == out ? in : DType::bf16) {  // exact types; bf16/f16 handled below
    case DType::f32: want = ref_detail::exact<float, float>(srcs, count, args); break;
    case DType::f64: want = ref_detail::exact<double, double>(srcs, count, args); break;
    case DType::i8: want = ref_detail::exact<int8_t, int64_t>(srcs, count, args); break;
    case DType::u8: want = ref_detail::exact<uint8_t, int64_t>(srcs, count, args); break;
    case DType::i16: want = ref_detail::exact<int16_t, int64_t>(srcs, count, args); break;
    case DType::i32: want = ref_detail::exact<int32_t, int64_t>(srcs, count, args); break;
    case DType::i64: want = ref_detail::exact<int64_t, int64_t>(srcs, count, args); break;
    case DType::boolean: {
      want.resize(count);
      bool any = args.op == ReduceOp::sum || args.op == ReduceOp::max;
      for (size_t i = 0; i < count; ++i) {
        bool acc = !any;
        for (auto s : srcs) acc = any ? (acc || static_cast<const uint8_t*>(s)[i]) : (acc && static_cast<const uint8_t*>(s)[i]);
        want[i] = acc;
      }
      break;
    }
    default: break;
  }
  std::ostringstream os;
  os.precision(17);
  if (!want.empty() || count == 0) {
    const size_t es = dtype_size(out);
    for (size_t i = 0; i < count; ++i)
      if (std::memcmp(static_cast<const uint8_t*>(got) + i * es, want.data() + i * es, es) != 0) {
        os << dtype_name(out) << " " << reduce_op_name(args.op) << " element " << i << " of " << count << ": got "
           << value_at(out, got, i) << " want " << value_at(out, want.data(), i) << " (bitwise)";
        return os.str();
      }
    return "";
  }
  // bf16/f16 in; float64 reference. Output rounding: 2^-8 (bf16), 2^-11 (f16), 2^-24 (f32)
  // relative, plus fp32 accumulation error bounded by 2^-22 of the sum of magnitudes.
  // f16 subnormals are spaced 2^-24 apart: half of that is the absolute rounding error.
  const double rel = out == DType::bf16 ? 0x1p-8 : out == DType::f16 ? 0x1p-11 : 0x1p-23;
  const double abs_tol = out == DType::f16 ? 0x1p-25 : 0.0;
  for (size_t i = 0; i < count; ++i) {
    double acc = 0, mag = 0;
    for (size_t r = 0; r < srcs.size(); ++r) {
      double v = value_at(in, srcs[r], i);
      if (args.op == ReduceOp::premul_sum) v *= args.premul_factor;
      mag += std::fabs(v);
      if (r == 0) acc = v;
      else if (args.op == ReduceOp::max) acc = std::max(acc, v);
      else if (args.op == ReduceOp::min) acc = std::min(acc, v);
      else if (args.op == ReduceOp::product) acc *= v;
      else acc += v;
    }
    if (args.op == ReduceOp::avg) acc /= static_cast<double>(srcs.size());
    if (args.op == ReduceOp::product) mag = std::fabs(acc);
    const double g = value_at(out, got, i), tol = rel * std::fabs(acc) + 0x1p-22 * mag + abs_tol;
    if (!(std::fabs(g - acc) <= tol)) {
      os << dtype_name(in) << "->" << dtype_name(out) << " " << reduce_op_name(args.op) << " element " << i << " of "
         << count << ": got " << g << " want " << acc << " (tolerance " << tol << ")";
      return os.str();
    }
  }
  return "";
}

inline uint64_t fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  auto b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

}  // namespace tide::test
