// TIDE-RS on CUDA: bf16/f16/f32 per-parameter gradients -> fp32 shards, in windows of the
// flat padded-shard space (as the host version, src/collectives/param_reduce_scatter.cpp).
//
// Choice: gradients stay private (any device memory); each rank first copies its own slices
// into its own symmetric staging slot (phase 1, copy engines on the copy stream: one
// contiguous or 2D copy per slice, in grad dtype, no widening). Phase 2 (compute stream)
// reads piece `rank` of every rank's slot straight over IPC with launch_accumulate_f32 —
// sources in rank order 0..n-1, fp32 accumulation, a few CTAs (TIDE_RS_CTAS) — into the
// fp32 shard. Its own slice is read in place when contiguous (no staging copy).
//
// Per window s (global step counter t = the group's rs epoch, the same on every rank):
//   copy stream:    wait rs_done >= t - slots on every rank   (slot t % slots is free)
//                   phase-1 copies; post rs_ready = t
//   compute stream: wait rs_ready >= t on every rank; accumulate; post rs_done = t
// The two streams overlap phase 1 of window s+1 with phase 2 of window s; staging is
// slots x slot_bytes per rank whatever the world size.
#include <algorithm>

#include "copies.hpp"
#include "rs_common.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"
#include "tide/cuda/kernels.hpp"

namespace tide::cuda {

StagingReport param_reduce_scatter(CudaGroup& g, const ParamReduceScatter& a, cudaStream_t stream) {
  const int me = g.rank(), ws = g.world_size();
  const plan::GroupLayout& layout = g.checked_layout(a.layout, "param_reduce_scatter");
  const size_t np = layout.params.size();
  TIDE_CHECK(a.grads.size() == np && a.out_offsets.size() == np, "tide: cuda: param_reduce_scatter on rank ", me, ": ",
             np, " params but ", a.grads.size(), " grads and ", a.out_offsets.size(), " output offsets");
  detail::check_rs_dtypes(a, me);
  const float scale = detail::rs_scale(a, ws, me);
  TIDE_CHECK(a.out || np == 0, "tide: cuda: param_reduce_scatter on rank ", me, ": no output");
  const size_t ges = dtype_size(a.grad_dtype);
  const size_t piece = g.piece_bytes();
  const int n_slots = g.num_slots();
  // The planner's windows of one piece per destination, with every slice and its staging.
  // Every part of a window starts 16-byte aligned in staging: vector loads in phase 2.
  const plan::RsPipeline pipe = plan::rs_pipeline(
      layout, {static_cast<int64_t>(piece), n_slots, static_cast<int64_t>(ges), kAccumulateAlign});
  const int64_t steps = static_cast<int64_t>(pipe.chunks.size());

  StagingReport report;
  report.slot_bytes = g.slot_bytes();
  report.num_slots = pipe.num_slots;

  const uint64_t first = g.current(CudaGroup::kRsReady) + 1;  // step id of window 0
  const detail::RsSlots slots(g, a, first, report);
  auto slot_of = [&](int rank, int idx) { return slots.at(rank, idx); };

  cudaStream_t cs = g.copy_stream(), ks = g.compute_stream();
  g.begin("param_reduce_scatter", stream, {cs, ks});
  auto* out = static_cast<float*>(a.out);
  detail::zero_shard_padding(layout, out, a.out_offsets, me, ks);  // FSDP2 reduces zero-padded inputs

  struct Mine {
    size_t p;
    int64_t lo, hi, pos;
    const void* in_place;
  };
  std::vector<Mine> mine;
  std::vector<const void*> srcs(static_cast<size_t>(ws));
  uint64_t t = 0;
  for (const plan::RsChunk& chunk : pipe.chunks) {
    t = g.next(CudaGroup::kRsReady);
    (void)g.next(CudaGroup::kRsDone);
    const int idx = static_cast<int>(t % static_cast<uint64_t>(n_slots));
    // The slot was last used by step t - n_slots: every reader of it must be done. Peers
    // say so through their rs_done; our own compute stream through the slot's event.
    if (t > static_cast<uint64_t>(n_slots))
      for (int r = 0; r < ws; ++r)
        if (r != me) g.wait(cs, r, CudaGroup::kRsDone, t - static_cast<uint64_t>(n_slots));
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(cs, g.slot_free_event(idx), 0));
    std::byte* my_slot = slot_of(me, idx);
    // Phase 1: my slices for every destination into piece d of my slot.
    mine.clear();
    detail::CopyBatch batch(cs, g.device());
    for (const plan::RsPiece& pc : chunk.pieces) {
      const size_t p = static_cast<size_t>(pc.param);
      const int d = pc.dst_rank;
      const int64_t lo = pc.shard_begin, hi = pc.shard_end, pos = pc.staging_offset;
      const std::vector<plan::Strided>& pats = pc.grad;
      TIDE_CHECK(a.grads[p], "tide: cuda: param_reduce_scatter on rank ", me, ": param ", p, " has no gradient");
      const auto* grad = static_cast<const std::byte*>(a.grads[p]);
      if (d == me) {
        const bool direct = plan::contiguous(pats);
        mine.push_back({p, lo, hi, pos, direct ? grad + static_cast<size_t>(pats[0].offset) * ges : nullptr});
        if (direct) continue;
      }
      detail::stage_slices(batch, my_slot + static_cast<size_t>(d) * piece + static_cast<size_t>(pos) * ges, grad, pats,
                           ges);
    }
    batch.flush();
    g.post(cs, CudaGroup::kRsReady, t);
    // Phase 2: every rank's piece `me`, in rank order, into my fp32 shard: after the peers'
    // rs_ready and after our own phase 1 (an event: flags are only for other ranks).
    TIDE_CUDA_CHECK(cudaEventRecord(g.phase1_event(), cs));
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(ks, g.phase1_event(), 0));
    for (int r = 0; r < ws; ++r)
      if (r != me) g.wait(ks, r, CudaGroup::kRsReady, t);
    for (const Mine& m : mine) {
      const size_t at = static_cast<size_t>(me) * piece + static_cast<size_t>(m.pos) * ges;
      float* dst = out + a.out_offsets[m.p] + m.lo;
      const size_t count = static_cast<size_t>(m.hi - m.lo);
      for (int r = 0; r < ws; ++r) srcs[static_cast<size_t>(r)] = r == me && m.in_place ? m.in_place : slot_of(r, idx) + at;
      detail::accumulate_in_order(dst, srcs, a.grad_dtype, count, scale, g.rs_ctas(), ks);
    }
    g.post(ks, CudaGroup::kRsDone, t);
    TIDE_CUDA_CHECK(cudaEventRecord(g.slot_free_event(idx), ks));
  }
  // Reused slots belong to the caller again on return: no peer may still read mine.
  if (report.reused_slots > 0 && steps > 0)
    for (int r = 0; r < ws; ++r)
      if (r != me) g.wait(ks, r, CudaGroup::kRsDone, t);
  g.end(stream, {cs, ks});
  return report;
}

}  // namespace tide::cuda
