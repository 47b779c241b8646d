// TIDE's CUDA kernels run on the CPU: the bodies of kernels/bodies.hpp (the same source
// nvcc compiles into the kernels) in a grid emulated by loops over blocks and threads, with
// host primitives. What a GPU alone could not check here (index arithmetic, the vector /
// scalar split, the sum order, the chained launches past 16 sources, tails that end mid
// vector) is checked against references computed independently: fp32 sums in source order
// (bitwise) and float64 sums (bound), and casts rounded to nearest even from a table of every
// bf16 / f16 value. A 16-byte load or store at an address a GPU would fault on throws here,
// and ASan (the sanitizer build runs this too) sees any read or write past a buffer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#include "../../kernels/bodies.hpp"
#include "tide/reduce_kernels.hpp"

namespace {

namespace body = tide::cuda::body;
using tide::cuda::AccumulateSources;

struct HostOps {
  static inline size_t loads = 0, stores = 0;  // 16-byte ones, counted
  template <class T>
  static void load16(const T* p, T (&out)[16 / sizeof(T)]) {
    if (!body::aligned16(p)) throw std::logic_error("16-byte load from a misaligned address");
    ++loads;
    std::memcpy(out, p, 16);
  }
  static void store16(float* p, const float (&v)[4]) {
    if (!body::aligned16(p)) throw std::logic_error("16-byte store to a misaligned address");
    ++stores;
    std::memcpy(p, v, 16);
  }
  static float to_f32(body::Bf16, uint16_t b) { return tide::bf16_to_float(b); }
  static float to_f32(body::F16, uint16_t b) { return tide::f16_to_float(b); }
  static float to_f32(body::F32, float v) { return v; }
  static uint16_t from_f32(body::Bf16, float v) { return tide::float_to_bf16(v); }
  static uint16_t from_f32(body::F16, float v) { return tide::float_to_f16(v); }
  static float from_f32(body::F32, float v) { return v; }
  // Each result rounded to fp32 on its own (volatile: never contracted into an FMA).
  static float add(float a, float b) {
    volatile float r = a + b;
    return r;
  }
  static float mul(float a, float b) {
    volatile float r = a * b;
    return r;
  }
};

// launch_accumulate_f32's launch (kernels/accumulate.cu) with every thread of the grid run in
// turn: threads write disjoint elements and read only what no thread writes, so the order of
// the threads does not matter.
template <class E>
void emulate_accumulate(float* dst, const AccumulateSources& srcs, size_t count, float scale, bool carry, int ctas,
                        int groups_per_thread) {
  const size_t es = sizeof(typename E::Bits);
  const size_t head = body::accumulate_head(srcs, es, dst, count);
  const unsigned vs = body::vector_sources(srcs, head, es);
  const bool vd = body::aligned16(dst + head);
  const size_t threads = static_cast<size_t>(ctas) * body::kAccumulateThreads;
  for (size_t t = 0; t < threads; ++t) switch (groups_per_thread) {  // launch_accumulate_f32_groups' variants
      case 1: body::accumulate_thread<HostOps, E, 1>(t, threads, dst, srcs, count, scale, carry, head, vs, vd); break;
      case 2: body::accumulate_thread<HostOps, E, 2>(t, threads, dst, srcs, count, scale, carry, head, vs, vd); break;
      case 4: body::accumulate_thread<HostOps, E, 4>(t, threads, dst, srcs, count, scale, carry, head, vs, vd); break;
      default: throw std::logic_error("no such variant");
    }
}

enum class T { bf16, f16, f32 };
const char* name(T t) { return t == T::bf16 ? "bf16" : t == T::f16 ? "f16" : "f32"; }
size_t size_of(T t) { return t == T::f32 ? 4 : 2; }

float value_of(T t, const std::vector<uint8_t>& b, size_t i) {
  if (t == T::f32) {
    float v;
    std::memcpy(&v, &b[i * 4], 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, &b[i * 2], 2);
  // Independent of the code under test's conversions: bf16 is the high half of an fp32; f16
  // by its definition (sign, 5-bit exponent, 10-bit mantissa).
  if (t == T::bf16) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return static_cast<float>((h & 0x8000) ? -v : v);
}

// Fresh random values of dtype t (finite, normal-range for f16), as bytes.
std::vector<uint8_t> random_bytes(T t, size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.f, 3.f);
  std::uniform_int_distribution<int> bits16(0, 0xFFFF);
  std::vector<uint8_t> b(n * size_of(t));
  for (size_t i = 0; i < n; ++i) {
    if (t == T::f32) {
      const float v = dist(rng);
      std::memcpy(&b[i * 4], &v, 4);
      continue;
    }
    uint16_t h;
    do {
      h = static_cast<uint16_t>(bits16(rng));
    } while (t == T::bf16 ? (((h >> 7) & 0xFF) == 0xFF || std::fabs(value_of(t, {uint8_t(h), uint8_t(h >> 8)}, 0)) > 1e30f)
                          : ((h >> 10) & 31) == 31);
    std::memcpy(&b[i * 2], &h, 2);
  }
  return b;
}

struct AccumulateCase {
  T dtype;
  size_t count;
  int sources;
  int ctas;
  bool misaligned_sources;  // every odd source one element past a 16-byte boundary
  bool misaligned_dst;
  bool carry;
  float scale;
  int groups_per_thread = body::kGroupsPerThread;
  int shift_all = 0;  // every source and dst this many elements past a 16-byte boundary (co-aligned)
};

std::string describe(const AccumulateCase& c) {
  return std::string(name(c.dtype)) + " count " + std::to_string(c.count) + " sources " + std::to_string(c.sources) +
         " ctas " + std::to_string(c.ctas) + (c.misaligned_sources ? " misaligned sources" : "") +
         (c.misaligned_dst ? " misaligned dst" : "") + (c.carry ? " carry" : "") + " scale " + std::to_string(c.scale) +
         " groups/thread " + std::to_string(c.groups_per_thread) +
         (c.shift_all ? " all shifted by " + std::to_string(c.shift_all) : "");
}

// Runs the case as TIDE-RS's executors do (body::accumulate_in_order: chained launches past
// kMaxAccumulateSources sources) and checks it element by element.
void run_case(const AccumulateCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(seed);
  const size_t es = size_of(c.dtype);
  // Exact-size buffers (ASan sees one element too far), each 16-byte aligned at its start.
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::unique_ptr<uint8_t[], void (*)(void*)>> bufs;
  std::vector<const void*> srcs;
  for (int s = 0; s < c.sources; ++s) {
    const size_t shift = c.shift_all ? c.shift_all : c.misaligned_sources && s % 2 ? 1 : 0;
    data.push_back(random_bytes(c.dtype, c.count, rng));
    const size_t bytes = (c.count + shift) * es;
    bufs.emplace_back(static_cast<uint8_t*>(std::aligned_alloc(16, std::max<size_t>(16, (bytes + 15) / 16 * 16))),
                      std::free);
    std::memcpy(bufs.back().get() + shift * es, data.back().data(), c.count * es);
    srcs.push_back(bufs.back().get() + shift * es);
  }
  const size_t dshift = c.shift_all ? c.shift_all : c.misaligned_dst ? 1 : 0;
  std::unique_ptr<float[], void (*)(void*)> out(
      static_cast<float*>(std::aligned_alloc(16, std::max<size_t>(16, ((c.count + dshift) * 4 + 15) / 16 * 16))),
      std::free);
  float* dst = out.get() + dshift;
  std::normal_distribution<float> dist;
  std::vector<float> init(c.count);
  for (float& v : init) v = dist(rng);
  std::memcpy(dst, init.data(), c.count * 4);

  int launches = 0;
  HostOps::loads = HostOps::stores = 0;
  body::accumulate_in_order(srcs.data(), c.sources, c.scale, [&](const AccumulateSources& batch, float s, bool carry) {
    ++launches;
    const bool chained = carry || c.carry;  // the case's own carry: dst holds a running sum before the first launch
    switch (c.dtype) {
      case T::bf16: emulate_accumulate<body::Bf16>(dst, batch, c.count, s, chained, c.ctas, c.groups_per_thread); break;
      case T::f16: emulate_accumulate<body::F16>(dst, batch, c.count, s, chained, c.ctas, c.groups_per_thread); break;
      case T::f32: emulate_accumulate<body::F32>(dst, batch, c.count, s, chained, c.ctas, c.groups_per_thread); break;
    }
  });
  EXPECT_EQ(launches, (c.sources + tide::cuda::kMaxAccumulateSources - 1) / tide::cuda::kMaxAccumulateSources);

  double worst = 0;
  for (size_t i = 0; i < c.count; ++i) {
    volatile float acc = c.carry ? init[i] : 0.f;  // fp32, strictly in source order
    double exact = c.carry ? init[i] : 0.0;
    for (int s = 0; s < c.sources; ++s) {
      const float v = value_of(c.dtype, data[static_cast<size_t>(s)], i);
      acc = acc + v;
      exact += v;
    }
    volatile float want = c.scale * acc;
    if (std::memcmp(&dst[i], const_cast<float*>(&want), 4) != 0) {
      FAIL() << "element " << i << ": got " << dst[i] << ", the source-order fp32 sum is " << want;
    }
    double mag = std::fabs(c.carry ? init[i] : 0.0);
    for (int s = 0; s < c.sources; ++s) mag += std::fabs(value_of(c.dtype, data[static_cast<size_t>(s)], i));
    // n additions and a multiply, each rounding by at most 2^-24 of what it carries.
    worst = std::max(worst, std::fabs(double(dst[i]) - c.scale * exact) / (std::fabs(c.scale) * mag + 1e-30));
  }
  EXPECT_LE(worst, (c.sources + 2) * std::ldexp(1.0, -24));
  if (c.shift_all && !c.carry && c.sources <= tide::cuda::kMaxAccumulateSources) {
    // Co-aligned: after a head of fewer than one vector, every byte moves 16 at a time.
    const size_t per_vector = 16 / es, groups = c.count > per_vector ? (c.count - per_vector) / per_vector : 0;
    EXPECT_GE(HostOps::loads, static_cast<size_t>(c.sources) * groups) << "sources read element by element";
    EXPECT_GE(HostOps::stores, groups * per_vector / 4) << "the destination written element by element";
  }
}

TEST(KernelBodies, AccumulateMatchesSourceOrderSums) {
  const int threads = body::kAccumulateThreads;
  uint64_t seed = 1;
  for (T dtype : {T::bf16, T::f16, T::f32}) {
    const size_t V = 16 / size_of(dtype);
    // Lengths: tiny, ending mid-vector, exactly one round of a grid, one group past it, and
    // several rounds with a ragged end.
    for (size_t count : {size_t{1}, V - 1, V, V + 3, size_t(threads) * V * body::kGroupsPerThread,
                         size_t(threads) * V * body::kGroupsPerThread + V, size_t(3) * threads * V + 5, size_t{40009}})
      for (int sources : {1, 3, 4, 5})
        run_case({dtype, count, sources, 2, sources > 1, false, false, 1.f}, seed++);
  }
}

TEST(KernelBodies, AccumulateAlignmentCarryAndScale) {
  uint64_t seed = 100;
  for (T dtype : {T::bf16, T::f16, T::f32})
    for (bool ms : {false, true})
      for (bool md : {false, true})
        for (bool carry : {false, true})
          for (float scale : {1.f, 0.37f, 0.125f})
            run_case({dtype, 5003, 6, 1, ms, md, carry, scale}, seed++);
}

TEST(KernelBodies, AccumulateChainsLaunchesPastSixteenSources) {
  // 17 and 33 sources: 2 and 3 launches with the running sum carried in dst, the scale
  // applied once by the last; bitwise the single source-order sum.
  uint64_t seed = 200;
  for (T dtype : {T::bf16, T::f32})
    for (int sources : {16, 17, 20, 33})
      for (float scale : {1.f, 1.f / 24})
        run_case({dtype, 3001, sources, 1, true, false, false, scale}, seed++);
}

TEST(KernelBodies, AccumulateEveryGroupsPerThreadVariant) {
  // The benchmark's variants (launch_accumulate_f32_groups): 1, 2 and 4 groups in flight.
  uint64_t seed = 400;
  for (int g : {1, 2, 4})
    for (T dtype : {T::bf16, T::f32})
      for (size_t count : {size_t{7}, size_t(body::kAccumulateThreads) * 8 * g + 9, size_t{30011}})
        run_case({dtype, count, 5, 2, true, g == 2, true, 0.5f, g}, seed++);
}

TEST(KernelBodies, AccumulateCoAlignedSourcesAndDestinationShareOneHead) {
  // TIDE-RS's planner stages each part congruent with its place in the output, so a part of a
  // parameter that FSDP2's layout puts off a 16-byte boundary has its staged sources off by
  // the same elements: one head of element-by-element sums aligns all of them.
  uint64_t seed = 500;
  for (T dtype : {T::bf16, T::f16, T::f32})
    for (int k = 1; k < 4; ++k) run_case({dtype, 10007, 6, 2, false, false, false, 0.25f, body::kGroupsPerThread, k}, seed++);
  for (int k = 4; k < 8; ++k) run_case({T::bf16, 10007, 6, 2, false, false, false, 1.f, body::kGroupsPerThread, k}, seed++);
}

TEST(KernelBodies, AccumulateGridShapes) {
  // Grids from one CTA to more threads than groups: every element written exactly once.
  uint64_t seed = 300;
  for (int ctas : {1, 3, 16, 40}) run_case({T::bf16, 77777, 4, ctas, true, false, false, 1.f}, seed++);
}

// ---- cast ------------------------------------------------------------------------------------

// Every finite value of a 16-bit format, by its bits, sorted by value (the reference rounds by
// search, not by the bit arithmetic under test).
std::vector<std::pair<double, uint16_t>> table(T t) {
  std::vector<std::pair<double, uint16_t>> v;
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = value_of(t, {uint8_t(h), uint8_t(h >> 8)}, 0);
    if (std::isfinite(f) && !(f == 0 && (h & 0x8000))) v.push_back({f, static_cast<uint16_t>(h)});
  }
  std::sort(v.begin(), v.end());
  return v;
}

// Round to nearest, ties to the even bit pattern (the format's round-to-nearest-even).
uint16_t round_by_table(const std::vector<std::pair<double, uint16_t>>& tab, float f) {
  auto hi = std::lower_bound(tab.begin(), tab.end(), std::make_pair(double(f), uint16_t(0)));
  if (hi == tab.end()) return tab.back().second;
  if (hi->first == f || hi == tab.begin()) return hi->second;
  auto lo = hi - 1;
  const double dl = f - lo->first, dh = hi->first - f;
  if (dl != dh) return dl < dh ? lo->second : hi->second;
  return (lo->second & 1) == 0 ? lo->second : hi->second;
}

template <class D, class S>
void emulate_cast(typename D::Bits* dst, const typename S::Bits* src, size_t count) {
  const size_t threads = static_cast<size_t>(body::elementwise_grid(count)) * body::kElementwiseThreads;
  for (size_t t = 0; t < threads; ++t) body::cast_thread<HostOps, D, S>(t, threads, dst, src, count);
}

TEST(KernelBodies, CastEveryDtypePair) {
  std::mt19937_64 rng(7);
  const auto bf16 = table(T::bf16), f16 = table(T::f16);
  // Past a grid of 1024 blocks x 256 threads too, so threads take several elements.
  for (size_t count : {size_t{1}, size_t{257}, size_t{1024} * 256 + 3}) {
    std::normal_distribution<float> dist(0.f, 8.f);
    std::vector<float> f32(count);
    for (float& v : f32) v = dist(rng);
    // f32 -> bf16 / f16: against the table's nearest value.
    std::vector<uint16_t> b(count), h(count);
    emulate_cast<body::Bf16, body::F32>(b.data(), f32.data(), count);
    emulate_cast<body::F16, body::F32>(h.data(), f32.data(), count);
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(b[i], round_by_table(bf16, f32[i])) << "f32 -> bf16 element " << i << " of " << count << ": " << f32[i];
      ASSERT_EQ(h[i], round_by_table(f16, f32[i])) << "f32 -> f16 element " << i << " of " << count << ": " << f32[i];
    }
    // bf16 / f16 -> f32: exact.
    std::vector<float> back(count);
    emulate_cast<body::F32, body::Bf16>(back.data(), b.data(), count);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(back[i], value_of(T::bf16, {uint8_t(b[i]), uint8_t(b[i] >> 8)}, 0)) << "bf16 -> f32 element " << i;
    emulate_cast<body::F32, body::F16>(back.data(), h.data(), count);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(back[i], value_of(T::f16, {uint8_t(h[i]), uint8_t(h[i] >> 8)}, 0)) << "f16 -> f32 element " << i;
    // bf16 <-> f16 and same-type: through fp32, rounded once.
    std::vector<uint16_t> x(count);
    emulate_cast<body::F16, body::Bf16>(x.data(), b.data(), count);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(x[i], round_by_table(f16, value_of(T::bf16, {uint8_t(b[i]), uint8_t(b[i] >> 8)}, 0)))
          << "bf16 -> f16 element " << i;
    emulate_cast<body::Bf16, body::F16>(x.data(), h.data(), count);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(x[i], round_by_table(bf16, value_of(T::f16, {uint8_t(h[i]), uint8_t(h[i] >> 8)}, 0)))
          << "f16 -> bf16 element " << i;
    emulate_cast<body::Bf16, body::Bf16>(x.data(), b.data(), count);
    ASSERT_EQ(x, b);
  }
}

}  // namespace
