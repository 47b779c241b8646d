// The paced recursive-doubling all-gather, simulated element by element: every rank ends
// holding every (owner, param) element exactly once, only sends what it held when the step
// began, and no rank has more than pace_bytes in flight in a round.
#include <gtest/gtest.h>

#include <map>

#include "test_plan_common.hpp"
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {
using testing::expand;

int ceil_log2(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

// held[rank][param][storage element] = how many times rank received (or owns) it.
using Holdings = std::vector<std::vector<std::vector<int>>>;

void simulate(const GroupLayout& g, const AllGatherSchedule& s) {
  const int ws = g.world_size;
  ASSERT_EQ(static_cast<int>(s.steps.size()), ceil_log2(ws));
  Holdings held(ws);
  for (int r = 0; r < ws; ++r) {
    for (const ParamLayout& p : g.params) held[r].emplace_back(p.storage_numel, 0);
    for (size_t i = 0; i < g.params.size(); ++i)  // each rank places its own shard first
      for (int64_t e : expand(g.params[i].shards[r].placement)) held[r][i][e] = 1;
  }
  for (size_t k = 0; k < s.steps.size(); ++k) {
    const Step& step = s.steps[k];
    ASSERT_EQ(step.distance, 1 << k);
    const Holdings at_start = held;
    for (const Round& round : step.rounds) {
      std::map<int, int64_t> sent_bytes;  // by sender
      for (const Transfer& t : round.transfers) {
        ASSERT_EQ(t.dst_rank, (t.src_rank + step.distance) % ws);
        const ParamLayout& p = g.params[t.param];
        ASSERT_EQ(t.storage, slice(p.shards[t.owner_rank].placement, t.shard_begin, t.shard_end));
        sent_bytes[t.src_rank] += (t.shard_end - t.shard_begin) * p.elem_size;
        for (int64_t e : expand(t.storage)) {
          ASSERT_EQ(at_start[t.src_rank][t.param][e], 1)
              << "rank " << t.src_rank << " sends element " << e << " it did not hold";
          ++held[t.dst_rank][t.param][e];
        }
      }
      for (const auto& [rank, bytes] : sent_bytes)
        ASSERT_LE(bytes, s.pace_bytes) << "rank " << rank;
    }
  }
  for (int r = 0; r < ws; ++r)
    for (size_t i = 0; i < g.params.size(); ++i)
      for (int64_t e = 0; e < g.params[i].storage_numel; ++e)
        ASSERT_EQ(held[r][i][e], e < g.params[i].numel ? 1 : 0)
            << "rank " << r << " param " << i << " element " << e << " (world size " << ws << ")";
}

TEST(PlanSchedule, StepsAreCeilLog2ForAnyWorldSize) {
  for (int ws = 1; ws <= 33; ++ws) {
    const AllGatherSchedule s = allgather_schedule(plan_group({{{64, 3}, 4, 0}}, ws), 1 << 20);
    EXPECT_EQ(static_cast<int>(s.steps.size()), ceil_log2(ws)) << "world size " << ws;
  }
}

TEST(PlanSchedule, ThreeRanksLastStepSendsOneBlock) {
  const AllGatherSchedule s = allgather_schedule(plan_group({{{3}, 4, 0}}, 3), 1024);
  ASSERT_EQ(s.steps.size(), 2u);
  ASSERT_EQ(s.steps[1].rounds.size(), 1u);
  const auto& last = s.steps[1].rounds[0].transfers;
  ASSERT_EQ(last.size(), 3u);  // each rank forwards only its own block, over distance 2
  for (const Transfer& t : last) {
    EXPECT_EQ(t.owner_rank, t.src_rank);
    EXPECT_EQ(t.dst_rank, (t.src_rank + 2) % 3);
  }
}

TEST(PlanSchedule, PacingSplitsBlocksIntoRounds) {
  // 10 fp32 elements per shard, 16-byte pace: 4 + 4 + 2 elements per step-0 block.
  const AllGatherSchedule s = allgather_schedule(plan_group({{{20}, 4, 0}}, 2), 16);
  ASSERT_EQ(s.steps.size(), 1u);
  ASSERT_EQ(s.steps[0].rounds.size(), 3u);
  EXPECT_EQ(s.steps[0].rounds[2].transfers[0].shard_begin, 8);
  EXPECT_EQ(s.steps[0].rounds[2].transfers[0].shard_end, 10);
  EXPECT_THROW(allgather_schedule(plan_group({{{20}, 8, 0}}, 2), 4), Error);
}

TEST(PlanSchedule, RandomGroupsDeliverEveryBlockOnce) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 300; ++trial) {
    const int ws = 1 + trial % 16;
    const GroupLayout g = plan_group(testing::random_params(rng, ws), ws);
    const int64_t pace = std::vector<int64_t>{8, 24, 100, 1 << 20}[trial % 4];
    simulate(g, allgather_schedule(g, pace));
  }
}

}  // namespace
}  // namespace tide::plan
