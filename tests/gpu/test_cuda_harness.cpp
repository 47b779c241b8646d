// The GPU runner's own logic, on any machine: a group that fell back (host flags, single
// copies, ipc memory) fails a strict run's expectation by name (tide_cuda_selftest --expect).
#include <gtest/gtest.h>

#include "cuda_harness.hpp"

namespace {

using tide::cudatest::modes_mismatch;
using tide::cudatest::parse_modes;

const auto kH200 = parse_modes("flags=device,copies=batched,memory=vmm", ',');

TEST(CudaHarnessModes, TheModesAnH200OffersPass) {
  EXPECT_EQ(modes_mismatch("ag_bf16", "OK all-gather ok [modes: flags=device copies=batched memory=vmm]", kH200), "");
  // The host-sync scenarios ask for host flags: held to that.
  EXPECT_EQ(modes_mismatch("rs_bf16_sum_hostsync", "OK [modes: flags=host copies=batched memory=vmm]", kH200), "");
  EXPECT_EQ(modes_mismatch("probe", "OK devices=1", kH200), "");
  EXPECT_EQ(modes_mismatch("ag_bf16", "OK anything", {}), "");  // no expectation: nothing to hold to
}

TEST(CudaHarnessModes, EachFallbackIsNamed) {
  EXPECT_EQ(modes_mismatch("ag_bf16", "OK [modes: flags=host copies=batched memory=vmm]", kH200),
            " flags=host (expected device)");
  EXPECT_EQ(modes_mismatch("flags", "OK [modes: flags=device copies=single memory=ipc]", kH200),
            " copies=single (expected batched) memory=ipc (expected vmm)");
  EXPECT_EQ(modes_mismatch("flags_hostsync", "OK [modes: flags=device copies=batched memory=vmm]", kH200),
            " flags=device (expected host)");
  EXPECT_EQ(modes_mismatch("ag_f32", "OK all-gather ok", kH200), " no modes reported");
  EXPECT_EQ(modes_mismatch("ag_f32", "OK [modes: flags=device]", kH200),
            " copies=? (expected batched) memory=? (expected vmm)");
}

}  // namespace
