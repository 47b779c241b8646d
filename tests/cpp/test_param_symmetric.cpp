// Comm::allocate_symmetric on 1..4 ranks: peers see each other's writes, sizes differ per
// rank (0 allowed), release() returns pages to the OS and reads as zeros, nothing is left in
// /dev/shm, no file descriptor leaks.
#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fstream>

#include "test_param_common.hpp"
#include "tide/host_transport.hpp"

using namespace tide;
using namespace tide::test;

namespace {

int count_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (d && ::readdir(d)) ++n;
  if (d) ::closedir(d);
  return n;
}

size_t resident_pages(void* p, size_t bytes) {
  const size_t page = 4096, n = (bytes + page - 1) / page;
  std::vector<unsigned char> v(n);
  if (::mincore(p, bytes, v.data()) != 0) return SIZE_MAX;
  size_t c = 0;
  for (auto x : v) c += x & 1;
  return c;
}

long statm_resident() {
  std::ifstream f("/proc/self/statm");
  long size = 0, res = 0;
  f >> size >> res;
  return res;
}

class ParamSymmetric : public ::testing::TestWithParam<int> {};

TEST_P(ParamSymmetric, PeersSeeWritesAndReleaseFrees) {
  auto out = run_ranks(GetParam(), [](Rank& rk) {
    CommOptions o;
    o.timeout = std::chrono::seconds(20);
    auto comm = rk.comm(o);
    const int ws = rk.world_size, me = rk.rank;
    const int fds0 = count_fds();
    {
      // Different sizes per rank; the last rank has none when ws > 1.
      auto size_of = [&](int r) -> size_t { return ws > 1 && r == ws - 1 ? 0 : (r + 1) * 40000 + 123; };
      auto buf = comm->allocate_symmetric(size_of(me));
      TIDE_REQUIRE(memfd_mappings(kSymmetricLabel) == (ws > 1 ? ws - 1 : 1), "symmetric mappings: ",
                   memfd_mappings(kSymmetricLabel));
      for (int r = 0; r < ws; ++r) TIDE_REQUIRE(buf->bytes(r) == size_of(r), "bytes(", r, ")=", buf->bytes(r));
      auto mine = random_elems(DType::u8, size_of(me), mix(rk.seed, me));
      if (size_of(me)) std::memcpy(buf->local(), mine.data(), mine.size());
      comm->barrier();
      for (int r = 0; r < ws; ++r) {
        auto want = random_elems(DType::u8, size_of(r), mix(rk.seed, r));
        TIDE_REQUIRE(want.empty() || std::memcmp(buf->peer(r), want.data(), want.size()) == 0,
                     "rank ", me, " reads wrong data from rank ", r);
      }
      comm->barrier();
    }
    {
      // release(): a big buffer, all pages touched, then an unaligned interior range released.
      const size_t bytes = size_t{8} << 20;
      auto buf = comm->allocate_symmetric(bytes);
      std::byte* b = buf->local();
      std::memset(b, 0x5a, bytes);
      const size_t before = resident_pages(b, bytes);
      const long rss_before = statm_resident();
      TIDE_REQUIRE(before == bytes / 4096, "resident pages after touching: ", before);
      const size_t off = 1000, len = bytes - 3000;
      buf->release(off, len);
      const size_t after = resident_pages(b, bytes);
      const long rss_after = statm_resident();
      TIDE_REQUIRE(after <= 2, "release left ", after, " of ", bytes / 4096, " pages resident");
      TIDE_REQUIRE(rss_before - rss_after >= static_cast<long>(bytes / 4096) * 9 / 10, "RSS went from ", rss_before,
                   " to ", rss_after, " pages");
      for (size_t i = 0; i < bytes; i += 977) {
        const bool inside = i >= off && i < off + len;
        TIDE_REQUIRE(static_cast<uint8_t>(b[i]) == (inside ? 0 : 0x5a), "byte ", i, " is ", int(b[i]));
      }
      TIDE_REQUIRE(static_cast<uint8_t>(b[off - 1]) == 0x5a && b[off] == std::byte{0} &&
                   b[off + len - 1] == std::byte{0} && static_cast<uint8_t>(b[off + len]) == 0x5a, "edges");
      comm->barrier();
      // Peers see zeros too; then the range is writable again.
      for (int r = 0; r < ws; ++r)
        TIDE_REQUIRE(buf->peer(r)[off + 4096 * 3] == std::byte{0}, "rank ", r, "'s released range is not zero");
      comm->barrier();
      std::memset(b + off, 0x33, len);
      comm->barrier();
      for (int r = 0; r < ws; ++r)
        TIDE_REQUIRE(static_cast<uint8_t>(buf->peer(r)[off + len / 2]) == 0x33, "rewrite of rank ", r);
      comm->barrier();
    }
    TIDE_REQUIRE(count_fds() == fds0, "fds: ", fds0, " before, ", count_fds(), " after");
    TIDE_REQUIRE(memfd_mappings(kSymmetricLabel) == 0, "symmetric mappings left: ", memfd_mappings(kSymmetricLabel));
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

INSTANTIATE_TEST_SUITE_P(Param, ParamSymmetric, ::testing::Values(1, 2, 3, 4),
                         [](const auto& i) { return "ws" + std::to_string(i.param); });

}  // namespace
