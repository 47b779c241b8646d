// The fp32 accumulation kernel on the GPU against a host fp32 sum in the same order (bitwise);
// tests/cpp/test_kernel_bodies.cpp runs the same arithmetic on the CPU in every CI run.
// Compiled and linked on every build; skips where there is no CUDA device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "tide/cuda/kernels.hpp"

namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class CudaAccumulate : public ::testing::TestWithParam<std::tuple<size_t, int, bool>> {};

TEST_P(CudaAccumulate, MatchesHostFp32SumInSourceOrder) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  auto [count, nsrc, misaligned] = GetParam();
  const size_t offset = misaligned ? 1 : 0;  // shifts every pointer by one element
  std::mt19937 rng(count * 31 + nsrc);
  std::normal_distribution<float> dist;
  std::vector<std::vector<uint16_t>> host(nsrc, std::vector<uint16_t>(count + offset));
  for (auto& v : host)
    for (auto& x : v) x = to_bf16(dist(rng));
  std::vector<float> init(count + offset);
  for (auto& x : init) x = dist(rng);

  tide::cuda::AccumulateSources srcs{};
  srcs.count = nsrc;
  std::vector<void*> dev(nsrc);
  for (int s = 0; s < nsrc; ++s) {
    ASSERT_EQ(cudaMalloc(&dev[s], (count + offset) * 2), cudaSuccess);
    cudaMemcpy(dev[s], host[s].data(), (count + offset) * 2, cudaMemcpyHostToDevice);
    srcs.ptr[s] = static_cast<uint16_t*>(dev[s]) + offset;
  }
  float* dst = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dst), (count + offset) * 4), cudaSuccess);
  cudaMemcpy(dst, init.data(), (count + offset) * 4, cudaMemcpyHostToDevice);
  const float scale = 0.125f;
  // The default launch, then every variant of the benchmark's sweep (launch_accumulate_f32_groups).
  for (int groups : {0, 1, 2, 4}) {
    cudaMemcpy(dst, init.data(), (count + offset) * 4, cudaMemcpyHostToDevice);
    const cudaError_t e = groups ? tide::cuda::launch_accumulate_f32_groups(groups, dst + offset, srcs, tide::DType::bf16,
                                                                           count, scale, /*carry=*/true, 4, nullptr)
                                 : tide::cuda::launch_accumulate_f32(dst + offset, srcs, tide::DType::bf16, count, scale,
                                                                     /*carry=*/true, 4, nullptr);
    ASSERT_EQ(e, cudaSuccess) << "groups per thread " << groups;
    std::vector<float> got(count + offset);
    cudaMemcpy(got.data(), dst, (count + offset) * 4, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < count; ++i) {
      volatile float acc = init[i + offset];  // the carried sum, then the sources in order
      for (int s = 0; s < nsrc; ++s) acc = acc + from_bf16(host[s][i + offset]);
      volatile float want = scale * acc;
      ASSERT_EQ(got[i + offset], want) << "element " << i << ", groups per thread " << groups;
    }
  }
  for (auto p : dev) cudaFree(p);
  cudaFree(dst);
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaAccumulate,
                         ::testing::Combine(::testing::Values(size_t{1}, size_t{1000},
                                                              size_t{1} << 20),
                                            ::testing::Values(1, 3, 8),
                                            ::testing::Bool()));

}  // namespace
