// Element types, conversions and the reduction kernels, checked against independent
// references (the compiler's _Float16, float64 arithmetic).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include "test_collectives_ref.hpp"
#include "tide/error.hpp"
#include "tide/reduce_kernels.hpp"

using namespace tide;
using namespace tide::test;

TEST(Dtype, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::i8), 1u);
  EXPECT_EQ(dtype_size(DType::u8), 1u);
  EXPECT_EQ(dtype_size(DType::i16), 2u);
  EXPECT_EQ(dtype_size(DType::i32), 4u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_size(DType::boolean), 1u);
  EXPECT_STREQ(dtype_name(DType::bf16), "bf16");
  EXPECT_STREQ(dtype_name(DType::boolean), "bool");
  EXPECT_STREQ(reduce_op_name(ReduceOp::premul_sum), "premul_sum");
  EXPECT_TRUE(is_floating(DType::f16));
  EXPECT_FALSE(is_floating(DType::i64));
}

// Round-to-nearest-even by hand: the two bf16 neighbours of x, nearer one, ties to even.
static uint16_t bf16_reference(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  uint16_t lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
  double dl = std::fabs(static_cast<double>(x) - from_bf16(lo)), dh = std::fabs(static_cast<double>(x) - from_bf16(hi));
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Dtype, Bf16ConversionRoundsToNearestEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16(f), h);  // round trip
  }
  std::mt19937 g(std::random_device{}());
  for (int i = 0; i < 200000; ++i) {
    float x = std::bit_cast<float>(static_cast<uint32_t>(g()));
    if (!std::isfinite(x) || std::fabs(x) > 3e38f) continue;
    ASSERT_EQ(float_to_bf16(x), bf16_reference(x)) << x;
  }
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);          // tie: to even (down)
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);      // tie: to even (up)
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TEST(Dtype, F16ConversionMatchesCompiler) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float want = static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(h)));
    float got = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << h;
    ASSERT_EQ(float_to_f16(got), h);
  }
  std::mt19937 g(std::random_device{}());
  for (int i = 0; i < 200000; ++i) {
    // Bias towards f16's range (exponents around 2^-26 .. 2^17) to hit subnormals and overflow.
    float x = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(g), std::uniform_int_distribution<int>(-26, 17)(g));
    ASSERT_EQ(float_to_f16(x), std::bit_cast<uint16_t>(static_cast<_Float16>(x))) << x;
  }
}

TEST(Dtype, KernelEveryTypeAndOpMatchesReference) {
  const uint64_t seed = std::random_device{}();
  for (DType dt : kAllDTypes)
    for (ReduceOp op : kAllOps) {
      if (!op_defined(dt, op)) {
        EXPECT_THROW(check_reduce("test", 0, dt, dt, op), Error);
        continue;
      }
      for (size_t n : {1, 2, 3, 5})
        for (size_t count : {1, 17, 1024, 3001}) {
          std::vector<std::vector<uint8_t>> data;
          std::vector<const void*> srcs;
          for (size_t r = 0; r < n; ++r) data.push_back(random_elems(dt, count, mix(seed, r * 131 + count)));
          for (auto& d : data) srcs.push_back(d.data());
          std::vector<uint8_t> out(count * dtype_size(dt), 0xab);
          ReduceArgs args{op, premul_factor(dt)};
          reduce_kernel(out.data(), dt, srcs.data(), n, dt, count, args);
          std::string err = check_reduction(out.data(), dt, srcs, dt, count, args);
          ASSERT_EQ(err, "") << "n=" << n;
        }
    }
}

TEST(Dtype, KernelMixedPrecisionAndInPlace) {
  const uint64_t seed = std::random_device{}();
  for (DType in : {DType::bf16, DType::f16})
    for (ReduceOp op : kAllOps) {
      const size_t count = 2049, n = 4;
      std::vector<std::vector<uint8_t>> data;
      std::vector<const void*> srcs;
      for (size_t r = 0; r < n; ++r) data.push_back(random_elems(in, count, mix(seed, r)));
      for (auto& d : data) srcs.push_back(d.data());
      std::vector<float> out(count);
      ReduceArgs args{op, 0.37};
      check_reduce("test", 0, in, DType::f32, op);
      reduce_kernel(out.data(), DType::f32, srcs.data(), n, in, count, args);
      ASSERT_EQ(check_reduction(out.data(), DType::f32, srcs, in, count, args), "");
    }
  // dst aliasing one source (all_reduce reduces into its own staging piece).
  std::vector<float> a(5000), b(5000);
  auto ra = random_elems(DType::f32, 5000, seed), rb = random_elems(DType::f32, 5000, seed + 1);
  std::memcpy(a.data(), ra.data(), ra.size());
  std::memcpy(b.data(), rb.data(), rb.size());
  std::vector<const void*> srcs{ra.data(), rb.data()};
  const void* alias[2] = {a.data(), b.data()};
  reduce_kernel(b.data(), DType::f32, alias, 2, DType::f32, 5000, {});
  EXPECT_EQ(check_reduction(b.data(), DType::f32, srcs, DType::f32, 5000, {}), "");
  EXPECT_THROW(check_reduce("test", 0, DType::f32, DType::bf16, ReduceOp::sum), Error);
  EXPECT_THROW(check_reduce("test", 0, DType::i32, DType::f32, ReduceOp::sum), Error);
}
