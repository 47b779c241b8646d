// The reduce-scatter pipeline, Slot-Reuse and the buffer accounting.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <utility>

#include "test_plan_common.hpp"
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {
using testing::expand;

TEST(PlanPipeline, ChunksCoverEveryShardElementOnceAndSlotsCycle) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 600; ++trial) {
    const int ws = 1 + trial % 16;
    const GroupLayout g = plan_group(testing::random_params(rng, ws), ws);
    // Half the trials align each parameter's staging with 16-byte granules (the CUDA executors').
    const int64_t elem = trial % 3 == 0 ? 2 : 4, align = trial % 2 ? 16 : 0;
    const RsPipelineOptions opt{std::vector<int64_t>{16, 48, 160, 4096}[trial % 4], 1 + trial % 3, elem, align};
    const RsPipeline pipe = rs_pipeline(g, opt);
    EXPECT_EQ(pipe.chunk_elems, opt.chunk_bytes / elem);
    std::vector<int64_t> base;  // each parameter's padded shard in the flat output space
    for (int64_t at = 0; const ParamLayout& p : g.params) base.push_back(std::exchange(at, at + p.padded_shard_numel));
    // covered[param][dst][shard element]
    std::vector<std::vector<std::vector<int>>> covered(g.params.size());
    for (size_t i = 0; i < g.params.size(); ++i)
      for (const Shard& s : g.params[i].shards) covered[i].emplace_back(s.numel, 0);
    int64_t prev_end = 0;
    for (size_t c = 0; c < pipe.chunks.size(); ++c) {
      const RsChunk& chunk = pipe.chunks[c];
      EXPECT_EQ(chunk.id, static_cast<int>(c));
      EXPECT_EQ(chunk.slot, chunk.id % opt.max_inflight);
      EXPECT_LT(chunk.slot, pipe.num_slots);
      EXPECT_EQ(chunk.begin, prev_end);
      EXPECT_LT(chunk.begin, chunk.end);
      EXPECT_LE(chunk.end - chunk.begin, pipe.chunk_elems);
      EXPECT_LE(chunk.staged, pipe.chunk_elems);
      if (!align) EXPECT_EQ(chunk.staged, chunk.end - chunk.begin);
      prev_end = chunk.end;
      std::vector<std::vector<int>> staged(ws, std::vector<int>(pipe.chunk_elems, 0));
      for (const RsPiece& p : chunk.pieces) {
        const Shard& s = g.params[p.param].shards[p.dst_rank];
        EXPECT_EQ(p.grad, slice(s.placement, p.shard_begin, p.shard_end));
        for (int64_t e = p.shard_begin; e < p.shard_end; ++e) ++covered[p.param][p.dst_rank][e];
        // Staged congruent with its place in the flat output (FSDP2's padded shards back to
        // back): one head aligns the staged sources and the fp32 output together.
        if (align)
          EXPECT_EQ(((p.staging_offset - base[p.param] - p.shard_begin) * elem % align + align) % align, 0)
              << "piece of param " << p.param << " in chunk " << c;
        for (int64_t o = p.staging_offset; o < p.staging_offset + p.shard_end - p.shard_begin;
             ++o) {
          ASSERT_TRUE(o >= 0 && o < chunk.staged);
          EXPECT_EQ(++staged[p.dst_rank][o], 1) << "staging overlap in chunk " << c;
        }
      }
    }
    int64_t total = 0;
    for (const ParamLayout& p : g.params) total += p.padded_shard_numel;
    EXPECT_EQ(prev_end, total);
    for (size_t i = 0; i < g.params.size(); ++i)
      for (int r = 0; r < ws; ++r)
        for (int n : covered[i][r]) ASSERT_EQ(n, 1) << "param " << i << " rank " << r;
    EXPECT_LE(pipe.staging_bytes(), opt.max_inflight * opt.chunk_bytes);
    EXPECT_EQ(pipe.slot_bytes, pipe.widest_window() * elem);
  }
  EXPECT_THROW(rs_pipeline(plan_group({{{8}, 2, 0}}, 2), {16, 2, 4, 6}), Error);   // not a multiple
  EXPECT_THROW(rs_pipeline(plan_group({{{8}, 2, 0}}, 2), {8, 2, 4, 16}), Error);   // wider than a chunk
}

TEST(PlanPipeline, StagingAddressedStaysWithinTheSlotsAtEveryWorldSize) {
  // 1024 rows of 256 per rank and an odd-sized parameter, bf16 gradients reduced in fp32.
  // A per-rank slot of 256 KiB split among destinations as the executors split it (chunk =
  // slot / world size). Measured from the pieces: the staging bytes the pipeline addresses,
  // and that every gradient element is staged exactly once (nothing dropped to fit).
  const int64_t slot = 256 << 10, elem = 4;
  const int inflight = 3;
  for (int ws : {16, 32, 64}) {
    const GroupLayout g = plan_group({{{1024 * ws, 256}, 2, 0}, {{7 * ws + 3}, 2, 0}}, ws);
    const RsPipeline pipe = rs_pipeline(g, {slot / ws, inflight, elem});
    int64_t addressed = 0, staged = 0, numel = 0;
    std::set<int> slots;
    for (const RsChunk& c : pipe.chunks) {
      slots.insert(c.slot);
      for (const RsPiece& p : c.pieces) {
        const int64_t end = p.dst_rank * pipe.chunk_elems + p.staging_offset + (p.shard_end - p.shard_begin);
        addressed = std::max(addressed, end * elem);
        staged += p.shard_end - p.shard_begin;
      }
    }
    for (const ParamLayout& p : g.params) numel += p.numel;
    EXPECT_EQ(staged, numel) << "world size " << ws;
    EXPECT_LE(addressed, slot) << "world size " << ws;
    EXPECT_EQ(static_cast<int>(slots.size()), inflight) << "world size " << ws;
    const int64_t measured = addressed * static_cast<int64_t>(slots.size());
    const BufferBytes stock = stock_fsdp2_bytes(g, {4, 0});
    EXPECT_GE(stock.rs_input, int64_t{ws} * 1024 * 256 * 4);  // grows with the world
    EXPECT_LT(measured * 4, stock.rs_input) << "world size " << ws;
  }
  EXPECT_THROW(rs_pipeline(plan_group({{{8}, 2, 0}}, 2), {2, 2, 4}), Error);
}

TEST(PlanAccounting, HandCountedGroup) {
  // (5, 3) and (7,) at 4 ranks: padded shards 6 + 2 elements; bf16 params, fp32 sharded
  // params and reduction.
  const GroupLayout g = plan_group({{{5, 3}, 2, 0}, {{7}, 2, 0}}, 4);
  const BufferBytes stock = stock_fsdp2_bytes(g, {4, 4});
  EXPECT_EQ(stock.param_storage, (24 + 8) * 2);
  EXPECT_EQ(stock.ag_input, 8 * 2);
  EXPECT_EQ(stock.ag_output, 4 * 8 * 2);
  EXPECT_EQ(stock.rs_input, 4 * 8 * 4);
  EXPECT_EQ(stock.rs_output, 8 * 4);
  EXPECT_EQ(stock_fsdp2_bytes(g, {4, 2}).ag_input, 0);  // no cast: shards copied in place
  const BufferBytes tide = tide_bytes(g, {4, 4}, 3, 100);
  EXPECT_EQ(tide.param_storage, stock.param_storage);
  EXPECT_EQ(tide.ag_input + tide.ag_output + tide.rs_input, 0);
  EXPECT_EQ(tide.rs_output, (0 + 1) * 4);  // rank 3 holds no row of (5, 3), one of (7,)
  EXPECT_EQ(tide.collective(), 4 + 100);
}

TEST(PlanSlotReuse, HandCase) {
  // 3 slots of 300 bytes at 256-byte alignment into [100, 900) of buffer 0 and [0, 300) of 1.
  const SlotReuse r = assign_staging_slots({{1, 0, 300}, {0, 100, 800}}, 300, 3, 256);
  ASSERT_EQ(r.slots.size(), 3u);
  EXPECT_TRUE(r.slots[0].reused);
  EXPECT_EQ(r.slots[0].base_id, 0);
  EXPECT_EQ(r.slots[0].offset, 256);
  EXPECT_EQ(r.slots[1].base_id, 1);
  EXPECT_EQ(r.slots[1].offset, 0);
  EXPECT_FALSE(r.slots[2].reused);
  EXPECT_EQ(r.slots[2].offset, 0);
  EXPECT_EQ(r.fallback_bytes, 512);
  EXPECT_THROW(assign_staging_slots({{0, 0, 100}, {0, 50, 100}}, 10, 1, 1), Error);
}

TEST(PlanSlotReuse, RandomAssignmentsStayInsideAlignedAndDisjoint) {
  std::mt19937 rng(11);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 1000; ++trial) {
    std::vector<Region> regions;
    for (int base = 0; base < uniform(0, 4); ++base)
      for (int64_t at = uniform(0, 300); at < 4000; at += uniform(1, 1500)) {
        const int64_t bytes = uniform(0, 1200);
        regions.push_back({base, at, bytes});
        at += bytes;
      }
    const int64_t alignment = int64_t{1} << uniform(0, 9), slot_bytes = uniform(0, 900);
    const int num_slots = uniform(0, 8);
    const SlotReuse r = assign_staging_slots(regions, slot_bytes, num_slots, alignment);
    ASSERT_EQ(static_cast<int>(r.slots.size()), num_slots);
    int fallbacks = 0;
    for (int a = 0; a < num_slots; ++a) {
      const SlotHome& h = r.slots[a];
      EXPECT_EQ(h.offset % alignment, 0);
      if (!h.reused) {
        ++fallbacks;
        EXPECT_LE(h.offset + slot_bytes, r.fallback_bytes);
        continue;
      }
      EXPECT_TRUE(std::any_of(regions.begin(), regions.end(),
                              [&](const Region& g) {
                                return g.base_id == h.base_id && g.offset <= h.offset &&
                                       h.offset + slot_bytes <= g.offset + g.bytes;
                              }))
          << "slot " << a << " is not inside a vacated region";
      for (int b = 0; b < a; ++b) {
        const SlotHome& o = r.slots[b];
        if (o.reused == h.reused && o.base_id == h.base_id && slot_bytes > 0) {
          EXPECT_TRUE(o.offset + slot_bytes <= h.offset || h.offset + slot_bytes <= o.offset)
              << "slots " << b << " and " << a << " overlap";
        }
      }
    }
    EXPECT_EQ(r.fallback_bytes, fallbacks * ((slot_bytes + alignment - 1) / alignment * alignment));
  }
}

TEST(PlanSlotReuse, StorageRegionsOfAGroupHostItsStaging) {
  const GroupLayout g = plan_group({{{4096, 64}, 2, 0}, {{4096}, 2, 0}}, 8);
  const RsPipeline pipe = rs_pipeline(g, {1 << 14, 4, 4});
  const std::vector<Region> regions = storage_regions(g);
  ASSERT_EQ(regions.size(), 2u);
  EXPECT_EQ(regions[0].bytes, 4096 * 64 * 2);
  const SlotReuse r = assign_staging_slots(regions, pipe.slot_bytes, pipe.num_slots, 256);
  EXPECT_EQ(r.fallback_bytes, 0);
  EXPECT_EQ(tide_bytes(g, {4, 0}, 0, r.fallback_bytes).staging, 0);
}

}  // namespace
}  // namespace tide::plan
