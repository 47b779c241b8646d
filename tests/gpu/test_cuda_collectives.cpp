// The CUDA probe in a child rank process on device 0 (cuda_harness.hpp: fork + exec, so no
// process inherits CUDA state). Skips without a device ("no CUDA device"). The scenarios
// (symmetric memory, TIDE-AG, TIDE-RS at world sizes 1, 2 and 4) run in tide_cuda_selftest,
// which tests/gpu/run.sh drives with its limits and strict expectations.
#include <gtest/gtest.h>

#include "cuda_harness.hpp"
#include "cuda_scenarios.hpp"

namespace {

using tide::cudatest::run_ranks;
const std::vector<std::string> kNoArgs;  // rank processes start in gtest_main.cpp's main()

TEST(CudaProbe, RunsAndPicksAPath) {
  if (tide::cudatest::device_count(kNoArgs) == 0) GTEST_SKIP() << "no CUDA device";
  auto out = run_ranks("probe", 1, kNoArgs);
  EXPECT_TRUE(tide::cudatest::all_ok(out)) << tide::cudatest::summary(out);
}

}  // namespace
