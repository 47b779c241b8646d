// main() of tide_cuda_tests. A rank process of the CUDA scenarios (cuda_harness.hpp
// re-executes this binary) runs its scenario and exits here, before GoogleTest starts: no
// test exists only to receive it, so nothing in the parent skips by construction (a strict
// GPU run fails on every skip).
#include <gtest/gtest.h>

#include "cuda_harness.hpp"

int main(int argc, char** argv) {
  tide::cudatest::child_main_if_requested();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
