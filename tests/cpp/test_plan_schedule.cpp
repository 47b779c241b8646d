// The paced recursive-doubling all-gather, simulated element by element: every rank ends
// holding every (owner, param) element exactly once, only sends what it held when the step
// began, and no rank has more than pace_bytes in flight in a round.
#include <gtest/gtest.h>

#include <map>
#include <string>

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

namespace tide::plan {
namespace {

// The two-level schedule, simulated element by element: inter-node transfers join ranks of
// one rail on different nodes and carry only what the sender held when the step began;
// node-local copies join ranks of one node and read only what the source held by then;
// every rank ends with every element of every shard exactly once.
void simulate_nodes(const GroupLayout& g, const NodeAllGatherSchedule& s) {
  const Topology& t = s.topology;
  const int ws = g.world_size;
  ASSERT_EQ(static_cast<int>(s.inter_node.steps.size()), ceil_log2(t.num_nodes));
  std::vector<std::vector<std::vector<int>>> held(ws);
  for (int r = 0; r < ws; ++r) {
    for (const ParamLayout& p : g.params) held[r].emplace_back(p.storage_numel, 0);
    for (size_t i = 0; i < g.params.size(); ++i)
      for (int64_t e : expand(g.params[i].shards[r].placement)) held[r][i][e] = 1;
  }
  auto local_copies = [&](int after_step) {
    const auto before = held;  // copies within a phase read what their source held at its start
    for (const NodeLocalCopy& c : s.node_local) {
      if (c.after_step != after_step) continue;
      const Transfer& b = c.block;
      ASSERT_EQ(t.node_of(b.src_rank), t.node_of(b.dst_rank)) << "node-local copy across nodes";
      ASSERT_NE(b.src_rank, b.dst_rank);
      ASSERT_EQ(t.local_rank(b.owner_rank), t.local_rank(b.src_rank)) << "a block of another rail";
      for (int64_t e : expand(b.storage)) {
        ASSERT_EQ(before[b.src_rank][b.param][e], 1) << "rank " << b.src_rank << " lacks element " << e
                                                       << " after step " << after_step;
        ++held[b.dst_rank][b.param][e];
      }
    }
  };
  local_copies(-1);
  for (size_t k = 0; k < s.inter_node.steps.size(); ++k) {
    const Step& step = s.inter_node.steps[k];
    ASSERT_EQ(step.distance, 1 << k);
    const auto at_start = held;
    for (const Round& round : step.rounds) {
      std::map<int, int64_t> sent_bytes;
      for (const Transfer& tr : round.transfers) {
        ASSERT_EQ(t.local_rank(tr.src_rank), t.local_rank(tr.dst_rank)) << "inter-node transfer off its rail";
        ASSERT_EQ(t.node_of(tr.dst_rank), (t.node_of(tr.src_rank) + step.distance) % t.num_nodes);
        ASSERT_NE(t.node_of(tr.src_rank), t.node_of(tr.dst_rank));
        const ParamLayout& p = g.params[tr.param];
        ASSERT_EQ(tr.storage, slice(p.shards[tr.owner_rank].placement, tr.shard_begin, tr.shard_end));
        sent_bytes[tr.src_rank] += (tr.shard_end - tr.shard_begin) * p.elem_size;
        for (int64_t e : expand(tr.storage)) {
          ASSERT_EQ(at_start[tr.src_rank][tr.param][e], 1) << "rank " << tr.src_rank << " sends element " << e
                                                            << " it did not hold";
          ++held[tr.dst_rank][tr.param][e];
        }
      }
      for (const auto& [rank, bytes] : sent_bytes) ASSERT_LE(bytes, s.inter_node.pace_bytes) << "rank " << rank;
    }
    local_copies(static_cast<int>(k));
  }
  for (int r = 0; r < ws; ++r)
    for (size_t i = 0; i < g.params.size(); ++i)
      for (int64_t e = 0; e < g.params[i].storage_numel; ++e)
        ASSERT_EQ(held[r][i][e], e < g.params[i].numel ? 1 : 0)
            << "rank " << r << " param " << i << " element " << e << " (" << t.num_nodes << " nodes x "
            << t.local_size << ")";
}

TEST(PlanNodeSchedule, EveryBlockOnceAtOneToSevenNodes) {
  std::mt19937 rng(7);
  for (int nodes = 1; nodes <= 7; ++nodes)
    for (int local = 1; local <= 3; ++local)
      for (int trial = 0; trial < 8; ++trial) {
        const int ws = nodes * local;
        const GroupLayout g = plan_group(testing::random_params(rng, ws), ws);
        const int64_t pace = std::vector<int64_t>{8, 24, 100, 1 << 20}[trial % 4];
        simulate_nodes(g, node_allgather_schedule(g, {ws, local, nodes}, pace));
        if (HasFatalFailure()) return;
      }
}

TEST(PlanNodeSchedule, OneNodeIsAllNodeLocalAndOneRankPerNodeIsAllInterNode) {
  const GroupLayout g = plan_group({{{12, 5}, 4, 0}}, 4);
  const NodeAllGatherSchedule one_node = node_allgather_schedule(g, {4, 4, 1}, 64);
  EXPECT_TRUE(one_node.inter_node.steps.empty());
  EXPECT_EQ(one_node.node_local.size(), 12u);  // 4 ranks x 3 peers
  const NodeAllGatherSchedule flat = node_allgather_schedule(g, {4, 1, 4}, 64);
  EXPECT_TRUE(flat.node_local.empty());
  // One rank per node: exactly the single-level doubling.
  const AllGatherSchedule single = allgather_schedule(g, 64);
  ASSERT_EQ(flat.inter_node.steps.size(), single.steps.size());
  for (size_t k = 0; k < single.steps.size(); ++k) {
    ASSERT_EQ(flat.inter_node.steps[k].rounds.size(), single.steps[k].rounds.size());
    for (size_t m = 0; m < single.steps[k].rounds.size(); ++m) {
      const auto& a = flat.inter_node.steps[k].rounds[m].transfers;
      const auto& b = single.steps[k].rounds[m].transfers;
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(a[i].src_rank == b[i].src_rank && a[i].dst_rank == b[i].dst_rank &&
                    a[i].owner_rank == b[i].owner_rank && a[i].storage == b[i].storage);
    }
  }
}

TEST(PlanNodeSchedule, RejectsATopologyOfAnotherGroup) {
  const GroupLayout g = plan_group({{{8}, 4, 0}}, 4);
  EXPECT_THROW(node_allgather_schedule(g, {6, 2, 3}, 64), Error);
}

TEST(PlanTopology, NodesFromHosts) {
  EXPECT_EQ(topology_from_hosts({"a", "a", "b", "b"}), (Topology{4, 2, 2}));
  EXPECT_EQ(topology_from_hosts({"a", "b", "c", "d"}), (Topology{4, 1, 4}));
  EXPECT_EQ(topology_from_hosts({"a", "a", "a", "b", "b", "b"}), (Topology{6, 3, 2}));
  EXPECT_EQ(topology_from_hosts({"a", "a", "a"}), (Topology{3, 3, 1}));
  EXPECT_EQ(topology_from_hosts({"a", "b", "c"}), (Topology{3, 1, 3}));
}

TEST(PlanTopology, RejectsNodesThatDoNotFitTheHosts) {
  auto message = [](const std::vector<std::string>& hosts) {
    try {
      topology_from_hosts(hosts);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({"a", "a", "a", "b"}).find("do not split"), std::string::npos);
  EXPECT_NE(message({"a", "b", "a", "b"}).find("consecutive"), std::string::npos);
  EXPECT_NE(message({"a", "a", "b", "c"}).find("span hosts"), std::string::npos);  // a node of two hosts
  EXPECT_NE(message({"a", "a", "b", "b", "b", "b"}).find("same number"), std::string::npos);
  EXPECT_NE(message({"a", "a", "b", "b", "c", "c"}).find("no error"), std::string::npos);
}

}  // namespace
}  // namespace tide::plan
