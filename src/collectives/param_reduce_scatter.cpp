// TIDE-RS on one host: a two-phase pipeline over windows of the flat padded-shard space
// (the parameters' padded shards back to back, as FSDP2's reduce output). Per window:
//   phase 1: this rank copies its gradient slices for every destination d (the planner's
//            placement of d's shard, in grad dtype: no widening) into piece d of its slot,
//            and posts ready;
//   phase 2: it reduces its own piece from every rank's slot, in rank order 0..n-1 with the
//            reduce engine (fp32 accumulation for bf16/f16, the same kernel as
//            reduce_scatter, hence the same bits), straight into its sharded gradient.
// A slot is slot_bytes (the communicator's), one piece of slot_bytes / world_size per
// destination, so staging does not grow with the world size. Its own contribution is read
// in place when its slice is contiguous. Slot-Reuse places slots in vacated all-gather
// storage (the same place on every rank); the rest use the communicator's staging. Slot
// reuse is safe by the done-flag protocol of Ctx::begin_step for both kinds of slot.
#include <cstring>
#include <vector>

#include "algorithms.hpp"

namespace tide::algo {

void zero_shard_padding(const ParamReduceScatter& a, int rank) {
  const size_t oes = dtype_size(a.out_dtype);
  for (size_t p = 0; p < a.layout->params.size(); ++p) {
    const plan::ParamLayout& pl = a.layout->params[p];
    const int64_t n = pl.shards[rank].numel;
    if (pl.padded_shard_numel > n)
      std::memset(bytes_of(a.out) + static_cast<size_t>(a.out_offsets[p] + n) * oes, 0,
                  static_cast<size_t>(pl.padded_shard_numel - n) * oes);
  }
}

RsSlots place_rs_slots(const Ctx& c, const ParamReduceScatter& a, StagingReport& report) {
  const int n_slots = c.t.num_slots();
  RsSlots slots{std::vector<int64_t>(static_cast<size_t>(n_slots), -1)};
  if (a.reuse && !a.reuse_regions.empty() && report.num_slots > 0) {
    std::vector<plan::Region> regions(a.reuse_regions.begin(), a.reuse_regions.end());
    for (auto& r : regions) r.base_id = 0;  // all are ranges of `reuse`
    const int64_t align = report.slot_bytes % 4096 == 0 ? 4096 : 64;
    plan::SlotReuse homes = plan::assign_staging_slots(std::move(regions), static_cast<int64_t>(report.slot_bytes),
                                                       report.num_slots, align);
    // The pipeline's i-th step (i < num_slots) takes transport slot (step + 1 + i) % n_slots.
    for (int i = 0; i < report.num_slots; ++i) {
      const int idx = static_cast<int>((c.step + 1 + static_cast<uint64_t>(i)) % static_cast<uint64_t>(n_slots));
      if (homes.slots[i].reused) {
        slots.reuse_offset[idx] = homes.slots[i].offset;
        ++report.reused_slots;
      }
    }
  }
  report.fallback_bytes = static_cast<size_t>(report.num_slots - report.reused_slots) * report.slot_bytes;
  return slots;
}

void stage_slices(std::vector<StridedCopy>& ops, std::byte* dst, const std::byte* grad,
                  const std::vector<plan::Strided>& slices, size_t elem_size) {
  for (const plan::Strided& pat : slices) {
    StridedCopy op;
    op.dst = dst;
    op.src = grad + static_cast<size_t>(pat.offset) * elem_size;
    op.run = static_cast<size_t>(pat.run);
    op.count = static_cast<size_t>(pat.count);
    op.dst_stride = op.run;
    op.src_stride = static_cast<size_t>(pat.stride);
    if (op.count == 1 || pat.run == pat.stride) {
      op.run *= op.count;
      op.count = 1;
    }
    ops.push_back(op);
    dst += static_cast<size_t>(pat.numel()) * elem_size;
  }
}

StagingReport param_reduce_scatter(Ctx& c, const ParamReduceScatter& a) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  const plan::GroupLayout& layout = *a.layout;
  const size_t ges = dtype_size(a.grad_dtype), oes = dtype_size(a.out_dtype);

  zero_shard_padding(a, me);

  StagingReport report;
  report.slot_bytes = t.slot_bytes();
  const size_t piece = c.piece_bytes();
  const int n_slots = t.num_slots();
  // The planner cuts the flat padded-shard space into windows of one piece per
  // destination and lists, per window, every gradient slice and where it is staged.
  const plan::RsPipeline pipe = plan::rs_pipeline(
      layout, {static_cast<int64_t>(piece), n_slots, static_cast<int64_t>(ges)});
  report.num_slots = pipe.num_slots;

  const RsSlots slots = place_rs_slots(c, a, report);
  auto slot_of = [&](int rank, int idx) { return slots.at(t, a.reuse, rank, idx); };

  std::vector<StridedCopy> ops;
  std::vector<const void*> srcs(ws);
  struct Mine {  // one reduction of phase 2
    size_t p;
    int64_t lo, hi, pos;
    const void* in_place;  // my own contribution, or null: staged in my piece
  };
  std::vector<Mine> mine;
  for (const plan::RsChunk& chunk : pipe.chunks) {
    const int idx = c.begin_step();
    std::byte* my_slot = slot_of(me, idx);
    // Phase 1.
    ops.clear();
    mine.clear();
    for (const plan::RsPiece& pc : chunk.pieces) {
      const size_t p = static_cast<size_t>(pc.param);
      const int d = pc.dst_rank;
      const int64_t lo = pc.shard_begin, hi = pc.shard_end, pos = pc.staging_offset;
      const std::vector<plan::Strided>& pats = pc.grad;
      const std::byte* grad = bytes_of(a.grads[p]);
      if (d == me) {
        const bool direct = plan::contiguous(pats);
        mine.push_back({p, lo, hi, pos, direct ? grad + static_cast<size_t>(pats[0].offset) * ges : nullptr});
        if (direct) continue;
      }
      stage_slices(ops, my_slot + static_cast<size_t>(d) * piece + static_cast<size_t>(pos) * ges, grad, pats, ges);
    }
    t.convert(ops, a.grad_dtype, a.grad_dtype);
    t.post(Flag::ready(), c.step);
    // Phase 2.
    for (int r = 0; r < ws; ++r)
      if (r != me) t.wait(r, Flag::ready(), c.step);
    for (const Mine& m : mine) {
      const size_t at = static_cast<size_t>(me) * piece + static_cast<size_t>(m.pos) * ges;
      for (int r = 0; r < ws; ++r)
        srcs[r] = r == me && m.in_place ? m.in_place : slot_of(r, idx) + at;
      t.reduce(bytes_of(a.out) + static_cast<size_t>(a.out_offsets[m.p] + m.lo) * oes, a.out_dtype, srcs,
               a.grad_dtype, static_cast<size_t>(m.hi - m.lo), a.op);
    }
    c.end_step();
  }
  // Slots in reused storage belong to the caller again once we return: wait until no peer
  // reads mine any more.
  if (report.reused_slots > 0)
    for (int r = 0; r < ws; ++r)
      if (r != me) t.wait(r, Flag::done(), c.step);
  return report;
}

}  // namespace tide::algo
