// Counters near their wrap point: every flag holds the low 32 bits of a 64-bit counter and
// compares cyclically, so a communicator that has run 2^32 pipeline steps (or p2p chunks, or
// exchanges) goes on as on its first day. Started just below 2^31 and 2^32 (where a signed or
// a 32-bit compare breaks), with three pipeline slots (where a 32-bit step % slots breaks).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "test_collectives_ref.hpp"
#include "test_host_harness.hpp"

using namespace tide;
using namespace tide::test;

namespace {

void run_across_wrap(uint64_t start) {
  auto out = run_ranks(3, [start](Rank& rk) {
    ::setenv("TIDE_SHM_SLOT_BYTES", "64K", 1);
    CommOptions o;
    o.timeout = std::chrono::seconds(20);
    o.staging_bytes = 3 * (64 << 10);  // three slots: not a power of two
    o.num_threads = 1;
    o.counter_start = start;
    auto comm = rk.comm(o);
    const int ws = rk.world_size, me = rk.rank;
    const size_t n = 50000;  // 200 KB of int32: four pipeline steps per all_reduce
    auto data = [&](int r, int it) {
      std::vector<int32_t> v(n);
      uint64_t s = mix(mix(rk.seed, static_cast<uint64_t>(r)), static_cast<uint64_t>(it));
      for (auto& x : v) x = static_cast<int32_t>((s = mix(s, 1)) % 2001) - 1000;
      return v;
    };
    // 40 rounds x ~10 steps each crosses the wrap point 2^(31|32), which is 100 steps ahead.
    for (int it = 0; it < 40; ++it) {
      std::vector<int32_t> mine = data(me, it), want(n, 0);
      for (int r = 0; r < ws; ++r) {
        auto v = data(r, it);
        for (size_t i = 0; i < n; ++i) want[i] += v[i];
      }
      comm->all_reduce(mine.data(), n, DType::i32, {});
      TIDE_REQUIRE(mine == want, "all_reduce wrong at round ", it, " (counters from ", start, ")");

      std::vector<std::vector<int32_t>> gathered(ws, std::vector<int32_t>(n));
      std::vector<void*> outs;
      for (auto& g : gathered) outs.push_back(g.data());
      auto in = data(me, it + 1000);
      comm->all_gather(in.data(), outs, n, DType::i32);
      for (int r = 0; r < ws; ++r) TIDE_REQUIRE(gathered[r] == data(r, it + 1000), "all_gather from rank ", r, " at round ", it);

      // A ring of sends: p2p chunk counters cross the wrap too.
      std::vector<int32_t> got(n);
      auto sent = data(me, it + 2000);
      const int next = (me + 1) % ws, prev = (me + ws - 1) % ws;
      if (me % 2 == 0) {
        comm->send(sent.data(), n * 4, next, it);
        comm->recv(got.data(), n * 4, prev, it);
      } else {
        comm->recv(got.data(), n * 4, prev, it);
        comm->send(sent.data(), n * 4, next, it);
      }
      TIDE_REQUIRE(got == data(prev, it + 2000), "recv from rank ", prev, " at round ", it);
      comm->barrier();
    }
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

TEST(HostCounters, SignedWrapAt2To31) { run_across_wrap((uint64_t{1} << 31) - 100); }
TEST(HostCounters, UnsignedWrapAt2To32) { run_across_wrap((uint64_t{1} << 32) - 100); }

}  // namespace
