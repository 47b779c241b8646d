// FSDP2's sharding rules (hand cases) and the all-gather / reduce-scatter addressing
// (invariants over random groups, checked against an independent element-by-element rule).
#include <gtest/gtest.h>

#include <numeric>
#include <string>

#include "test_plan_common.hpp"
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {
using testing::expand;

using Sizes = std::vector<int64_t>;

TEST(PlanSharding, FiveByThreeOverFourRanksGivesRows2210) {
  const GroupLayout g = plan_group({{{5, 3}, 2, 0}}, 4);
  const ParamLayout& p = g.params[0];
  EXPECT_EQ(p.chunk, 2);
  EXPECT_EQ(p.padded_shard_numel, 6);
  EXPECT_EQ(p.storage_numel, 24);
  const Sizes rows = {2, 2, 1, 0}, begins = {0, 2, 4, 5};
  for (int r = 0; r < 4; ++r) {
    const Shard& s = p.shards[r];
    EXPECT_EQ(s.sharded_size, (Sizes{rows[r], 3})) << "rank " << r;
    EXPECT_EQ(s.padded_sharded_size, (Sizes{2, 3}));
    EXPECT_EQ(s.begin, begins[r]);
    EXPECT_EQ(s.numel, rows[r] * 3);
    EXPECT_EQ(s.padded_numel, 6);
    EXPECT_EQ(s.placement.offset, begins[r] * 3);
    EXPECT_EQ(s.placement.numel(), rows[r] * 3);
  }
}

TEST(PlanSharding, ThreeElementsOverEightRanks) {
  const ParamLayout p = plan_group({{{3}, 4, 0}}, 8).params[0];
  EXPECT_EQ(p.chunk, 1);
  EXPECT_EQ(p.storage_numel, 8);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(p.shards[r].sharded_size, Sizes{r < 3 ? 1 : 0}) << "rank " << r;
    EXPECT_EQ(p.shards[r].padded_sharded_size, Sizes{1});
    EXPECT_EQ(p.shards[r].begin, std::min(r, 3));
  }
  EXPECT_EQ(allgather_copies(plan_group({{{3}, 4, 0}}, 8)).size(), 3u);
}

TEST(PlanSharding, EvenShardOnDimOneIsStrided) {
  const ParamLayout p = plan_group({{{3, 8}, 2, 1}}, 4).params[0];
  EXPECT_EQ(p.storage_numel, 24);  // exactly the unsharded tensor
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(p.shards[r].sharded_size, (Sizes{3, 2}));
    EXPECT_EQ(p.shards[r].placement, (Strided{2 * r, 2, 3, 8})) << "rank " << r;
  }
}

TEST(PlanSharding, NegativeShardDimCountsFromTheBack) {
  const ParamLayout p = plan_group({{{3, 8}, 2, -1}}, 4).params[0];
  EXPECT_EQ(p.shard_dim, 1);
  EXPECT_EQ(p.shards[1].placement, (Strided{2, 2, 3, 8}));
}

std::string error_of(const std::vector<Param>& params, int world_size) {
  try {
    plan_group(params, world_size);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PlanSharding, UnevenShardOnDimOneIsRejectedLikeFsdp2) {
  const std::string msg = error_of({{{4}, 4, 0}, {{3, 7}, 4, 1}}, 4);
  for (const char* part : {"parameter 1", "(3, 7)", "dim 1", "world size 4", "uneven"})
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
}

TEST(PlanSharding, RejectsWhatFsdp2Rejects) {
  EXPECT_NE(error_of({{{}, 4, 0}}, 2).find("0-dim"), std::string::npos);
  EXPECT_NE(error_of({{{4, 4}, 4, 2}}, 2).find("Shard(2)"), std::string::npos);
  EXPECT_NE(error_of({{{4, 4}, 4, 0}}, 0).find("world size"), std::string::npos);
  EXPECT_NE(error_of({{{4}, 0, 0}}, 2).find("element size"), std::string::npos);
}

TEST(PlanSharding, WorldSizeOneKeepsEverything) {
  const ParamLayout p = plan_group({{{5, 3}, 4, 0}}, 1).params[0];
  EXPECT_EQ(p.shards[0].sharded_size, (Sizes{5, 3}));
  EXPECT_EQ(p.storage_numel, 15);
  EXPECT_EQ(p.shards[0].placement.numel(), 15);
}

TEST(PlanSharding, EmptyChunksReportZeroRowsLikeGetDimChunkedSize) {
  // torch.chunk gives (2, 0), (2, 0), (1, 0); _get_dim_chunked_size turns each into (0, 0).
  const ParamLayout p = plan_group({{{5, 0}, 4, 0}}, 4).params[0];
  for (const Shard& s : p.shards) EXPECT_EQ(s.sharded_size, (Sizes{0, 0}));
  EXPECT_EQ(p.shards[0].padded_sharded_size, (Sizes{2, 0}));
  EXPECT_EQ(p.storage_numel, 0);
}

TEST(PlanAddressing, SliceCoversExactlyTheRequestedElements) {
  std::mt19937 rng(1234);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 2000; ++trial) {
    const Strided p{uniform(0, 9), uniform(1, 7), uniform(1, 6), 0};
    const Strided q{p.offset, p.run, p.count, p.run + uniform(0, 5)};
    const auto all = expand(q);
    const int64_t b = uniform(0, static_cast<int>(q.numel()));
    const int64_t e = uniform(static_cast<int>(b), static_cast<int>(q.numel()));
    const auto parts = slice(q, b, e);
    EXPECT_LE(parts.size(), 3u);
    EXPECT_EQ(expand(parts), std::vector<int64_t>(all.begin() + b, all.begin() + e));
  }
  EXPECT_THROW(slice({0, 2, 2, 4}, 1, 5), Error);
}

// Independent rule: element e of the unsharded tensor has coordinate c along shard_dim; it
// belongs to rank c / chunk, at this index of that rank's (contiguous) shard.
void check_tiling(const ParamLayout& p, int ws,
                  const std::vector<std::pair<int, Strided>>& by_rank) {
  int64_t inner = 1;
  for (size_t d = p.shard_dim + 1; d < p.shape.size(); ++d) inner *= p.shape[d];
  const int64_t size = p.shape[p.shard_dim];
  std::vector<int> hits(p.storage_numel, 0);
  for (const auto& [rank, pattern] : by_rank) {
    const Shard& s = p.shards[rank];
    ASSERT_EQ(pattern.numel(), s.numel);
    const auto elems = expand(pattern);
    for (size_t i = 0; i < elems.size(); ++i) {
      const int64_t e = elems[i];
      ASSERT_TRUE(e >= 0 && e < p.numel) << "element " << e << " outside the real elements";
      ++hits[e];
      const int64_t coord = e / inner % size;
      ASSERT_EQ(coord / p.chunk, rank);
      const int64_t rows = s.sharded_size[p.shard_dim];
      ASSERT_EQ(static_cast<int64_t>(i),
                (e / (size * inner) * rows + coord - s.begin) * inner + e % inner);
    }
  }
  for (int64_t e = 0; e < p.storage_numel; ++e)
    ASSERT_EQ(hits[e], e < p.numel ? 1 : 0) << "element " << e;
  ASSERT_LE(p.numel, p.storage_numel);
  ASSERT_EQ(p.storage_numel, ws * p.padded_shard_numel);
}

TEST(PlanAddressing, AllGatherDestinationsTileEachParameterOnce) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 400; ++trial) {
    const int ws = 1 + trial % 16;
    const GroupLayout g = plan_group(testing::random_params(rng, ws), ws);
    std::vector<std::vector<std::pair<int, Strided>>> by_param(g.params.size());
    for (const AllGatherCopy& c : allgather_copies(g)) {
      EXPECT_EQ(c.numel, c.dst.numel());
      EXPECT_LE(c.numel, g.params[c.param].shards[c.src_rank].padded_numel);
      by_param[c.param].push_back({c.src_rank, c.dst});
    }
    for (size_t i = 0; i < g.params.size(); ++i) check_tiling(g.params[i], ws, by_param[i]);
  }
}

TEST(PlanAddressing, ReduceScatterSlicesCoverEachGradientOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int ws = 1 + trial % 16;
    const GroupLayout g = plan_group(testing::random_params(rng, ws), ws);
    std::vector<std::vector<std::pair<int, Strided>>> by_param(g.params.size());
    for (const ReduceScatterSlice& s : reduce_scatter_slices(g)) {
      EXPECT_EQ(s.numel, g.params[s.param].shards[s.dst_rank].numel);
      by_param[s.param].push_back({s.dst_rank, s.src});
    }
    for (size_t i = 0; i < g.params.size(); ++i) check_tiling(g.params[i], ws, by_param[i]);
  }
}

}  // namespace
}  // namespace tide::plan

TEST(PlanAddressing, ContiguousPatterns) {
  using tide::plan::Strided;
  using tide::plan::contiguous;
  EXPECT_TRUE(contiguous({}));
  EXPECT_TRUE(contiguous({Strided{3, 5, 1, 0}}));
  EXPECT_TRUE(contiguous({Strided{0, 4, 3, 4}}));                      // runs back to back
  EXPECT_FALSE(contiguous({Strided{0, 4, 3, 6}}));                     // gaps between runs
  EXPECT_TRUE(contiguous({Strided{2, 2, 1, 0}, Strided{4, 3, 2, 3}})); // head + whole runs
  EXPECT_FALSE(contiguous({Strided{2, 2, 1, 0}, Strided{5, 3, 1, 0}}));
}
