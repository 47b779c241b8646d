// Capability probing and the all-gather path decision. The decision is pure logic over a
// Capabilities value, so it is tested here on hand-made capabilities (runs without a GPU);
// probe() itself runs in a child process in test_cuda_collectives.cpp (CudaProbe.RunsAndPicksAPath).
#include <gtest/gtest.h>

#include "tide/cuda/probe.hpp"

namespace {

using tide::cuda::AllGatherPath;
using tide::cuda::Capabilities;
using tide::cuda::choose_allgather_path;

Capabilities fake(int n, bool multicast, int engines = 3) {
  Capabilities c;
  c.device_count = n;
  for (int d = 0; d < n; ++d) {
    tide::cuda::DeviceCaps dc;
    dc.ordinal = d;
    dc.uuid[0] = static_cast<uint8_t>(0xA0 + d);  // distinct GPUs
    dc.sm_count = 132;
    dc.copy_engines = engines;
    dc.unified_addressing = dc.ipc = true;
    dc.vmm = dc.posix_fd_handles = true;
    dc.multicast = multicast;
    c.devices.push_back(dc);
  }
  c.peer_access.assign(n, std::vector<bool>(n, true));
  return c;
}

TEST(CudaPathChoice, CopyEnginesAlsoWhereMulticastExists) {
  // TIDE has no multicast path: multicast is reported, the copy engines carry the bytes.
  auto pc = choose_allgather_path(fake(8, true), {0, 1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(pc.path, AllGatherPath::copy_engine);
  EXPECT_NE(pc.reason.find("multicast present, unused"), std::string::npos) << pc.reason;
}

TEST(CudaPathChoice, CopyEnginesWithoutMulticast) {
  auto pc = choose_allgather_path(fake(2, false), {0, 1});
  EXPECT_EQ(pc.path, AllGatherPath::copy_engine);
  EXPECT_EQ(pc.reason, "peer access between every rank's device");
}

TEST(CudaPathChoice, NcclWithoutCopyEngines) {
  auto pc = choose_allgather_path(fake(2, false, 0), {0, 1});
  EXPECT_EQ(pc.path, AllGatherPath::nccl);
  EXPECT_EQ(pc.reason, "no copy engine on device 1");
}

TEST(CudaPathChoice, CopyEnginesWhenRanksShareADevice) {
  EXPECT_EQ(choose_allgather_path(fake(1, true), {0, 0, 0, 0}).path, AllGatherPath::copy_engine);
}

TEST(CudaPathChoice, NcclWithoutPeerAccess) {
  Capabilities c = fake(2, false);
  c.peer_access[0][1] = c.peer_access[1][0] = false;
  EXPECT_EQ(choose_allgather_path(c, {0, 1}).path, AllGatherPath::nccl);
}

TEST(CudaPathChoice, GpusAreMatchedByUuidNotOrdinal) {
  // A rank restricted by its own CUDA_VISIBLE_DEVICES calls its GPU 0; peers map its UUID to
  // their own numbering, or find it missing.
  Capabilities c = fake(2, false);
  EXPECT_EQ(tide::cuda::ordinal_of(c, c.devices[1].uuid), 1);
  tide::cuda::DeviceUuid other{};
  other[0] = 0x42;
  EXPECT_EQ(tide::cuda::ordinal_of(c, other), -1);
  auto pc = choose_allgather_path(c, {0, tide::cuda::ordinal_of(c, other)});
  EXPECT_EQ(pc.path, AllGatherPath::nccl);
  EXPECT_NE(pc.reason.find("the GPU of local rank 1 is not visible in this process"), std::string::npos) << pc.reason;
}

TEST(CudaPathChoice, NcclWithoutDevice) {
  EXPECT_EQ(choose_allgather_path(Capabilities{}, {0}).path, AllGatherPath::nccl);
}

}  // namespace
