// Symmetric memory, TIDE-AG and TIDE-RS on CUDA at world sizes 1, 2 and 4, every rank a
// separate process on device 0 (cuda_harness.hpp: fork + exec, so no process inherits CUDA
// state). References are computed on the host from fresh random data. Skips without a
// device ("no CUDA device").
#include <gtest/gtest.h>

#include "cuda_harness.hpp"
#include "cuda_scenarios.hpp"

namespace {

using tide::cudatest::run_ranks;
const std::vector<std::string> kNoArgs;  // rank processes start in gtest_main.cpp's main()

class CudaCollectives : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CudaCollectives, Scenario) {
  if (tide::cudatest::device_count(kNoArgs) == 0) GTEST_SKIP() << "no CUDA device";
  auto [name, ws] = GetParam();
  auto out = run_ranks(name, ws, kNoArgs);
  EXPECT_TRUE(tide::cudatest::all_ok(out)) << tide::cudatest::summary(out);
}

INSTANTIATE_TEST_SUITE_P(
    All, CudaCollectives,
    ::testing::Combine(::testing::ValuesIn(tide::cudatest::scenario_names()), ::testing::Values(1, 2, 4)),
    [](const auto& info) { return std::get<0>(info.param) + "_ws" + std::to_string(std::get<1>(info.param)); });

TEST(CudaProbe, RunsAndPicksAPath) {
  if (tide::cudatest::device_count(kNoArgs) == 0) GTEST_SKIP() << "no CUDA device";
  auto out = run_ranks("probe", 1, kNoArgs);
  EXPECT_TRUE(tide::cudatest::all_ok(out)) << tide::cudatest::summary(out);
}

}  // namespace
