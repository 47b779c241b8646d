// TIDE-RS across nodes on CUDA: the host's two-level pipeline (src/collectives/
// node_reduce_scatter.cpp), its node half on this node's CudaGroup and its inter-node half
// over an engine ordered on the group's compute stream (NCCL). The whole group's flat
// padded-shard space is cut into windows (plan::rs_pipeline, one piece per group rank). Per
// window t (the group's rs epoch):
//   copy stream:    wait rs_done >= t - slots on every node rank (the slot is free); copy my
//                   gradient slices for every destination into piece d of my slot (grad
//                   dtype; a slice for my own rail read in place when contiguous); post rs_ready
//   compute stream: wait rs_ready >= t on every node rank; for each piece whose destination
//                   is on my rail (same local rank), the node's L slices in local rank order,
//                   fp32 (launch_accumulate_f32, few CTAs), into this window's partial for
//                   the destination's node; post rs_done
//   engine:         the partials along the rail, one message per peer node, while the next
//                   window's node phase runs; then the nodes' partials of my own shard, in
//                   node order, into my fp32 shard (avg: times 1 / group size, once).
// Sum order as on the host: local ranks, then nodes. Staging: the node's slots (Slot-Reuse
// applies) plus 2 windows x 2N fp32 pieces, about 4 x slot x 4 / (L x grad element size):
// flat in the node count. Nothing waits on the host.
#include <algorithm>
#include <array>
#include <vector>

#include "rs_common.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"
#include "tide/cuda/kernels.hpp"
#include "tide/engine.hpp"

namespace tide::cuda {

namespace {
StagingReport run(CudaGroup& g, const ParamReduceScatter& a, const plan::Topology& topo, int rank, Engine& engine,
                  cudaStream_t stream);
}

StagingReport param_reduce_scatter_across_nodes(CudaGroup& g, const ParamReduceScatter& a, const plan::Topology& topo,
                                                int rank, Engine& engine, cudaStream_t stream) {
  try {
    return run(g, a, topo, rank, engine, stream);
  } catch (...) {
    engine.abandon();  // a window's partials may be in flight
    throw;
  }
}

namespace {
StagingReport run(CudaGroup& g, const ParamReduceScatter& a, const plan::Topology& topo, int rank, Engine& engine,
                  cudaStream_t stream) {
  const int me = rank, lme = g.rank(), L = topo.local_size, N = topo.num_nodes, ws = topo.world_size;
  const int my_node = topo.node_of(me);
  TIDE_CHECK(a.layout, "tide: cuda: param_reduce_scatter on rank ", me, ": no layout");
  const plan::GroupLayout& layout = *a.layout;
  const size_t np = layout.params.size();
  TIDE_CHECK(layout.world_size == ws && g.world_size() == L && lme == topo.local_rank(me),
             "tide: cuda: param_reduce_scatter on rank ", me, ": layout for ", layout.world_size, " ranks, topology ",
             N, " x ", L, ", node group of ", g.world_size(), " (its rank ", lme, ")");
  TIDE_CHECK(g.allgather_path().path != AllGatherPath::nccl, "tide: cuda: param_reduce_scatter on rank ", me,
             ": the node's GPUs cannot map each other's memory (", g.allgather_path().reason, ")");
  TIDE_CHECK(a.grads.size() == np && a.out_offsets.size() == np, "tide: cuda: param_reduce_scatter on rank ", me, ": ",
             np, " params but ", a.grads.size(), " grads and ", a.out_offsets.size(), " output offsets");
  TIDE_CHECK(a.out || np == 0, "tide: cuda: param_reduce_scatter on rank ", me, ": no output");
  detail::check_rs_dtypes(a, me);
  const float scale = detail::rs_scale(a, ws, me);
  // premul_sum multiplies in the node phase; avg divides once, at the end.
  const float node_scale = a.op.op == ReduceOp::premul_sum ? scale : 1.f;
  const float final_scale = a.op.op == ReduceOp::avg ? scale : 1.f;
  const size_t ges = dtype_size(a.grad_dtype);
  const size_t piece = g.slot_bytes() / static_cast<size_t>(ws) / 256 * 256;
  TIDE_CHECK(piece >= ges, "tide: cuda: param_reduce_scatter on rank ", me, ": a staging slot of ", g.slot_bytes(),
             " bytes cannot hold a piece for each of ", ws, " ranks (TIDE_CUDA_STAGING_BYTES)");
  const int n_slots = g.num_slots();
  const plan::RsPipeline pipe = plan::rs_pipeline(
      layout, {static_cast<int64_t>(piece), n_slots, static_cast<int64_t>(ges), kAccumulateAlign});

  StagingReport report;
  report.slot_bytes = g.slot_bytes();
  report.num_slots = pipe.num_slots;
  const detail::RsSlots slots(g, a, g.current(CudaGroup::kRsReady) + 1, report);
  // One destination's part of a window in fp32: at most a piece, less for small groups.
  // 256-byte multiples: every partial starts aligned, for the accumulation's vector path.
  const size_t part_bytes = (static_cast<size_t>(pipe.widest_window()) * sizeof(float) + 255) / 256 * 256;
  report.partial_bytes = std::min<size_t>(2, pipe.chunks.size()) * 2 * static_cast<size_t>(N) * part_bytes;

  cudaStream_t cs = g.copy_stream(), ks = g.compute_stream();
  g.begin("param_reduce_scatter", stream, {cs, ks});
  auto* out = static_cast<float*>(a.out);
  detail::zero_shard_padding(layout, out, a.out_offsets, me, ks);
  // Per window w: this node's partials for my rail's rank on every node, then the partials
  // of my own shard received from every node. Freed in stream order after the last reader.
  void* raw = nullptr;
  if (report.partial_bytes) TIDE_CUDA_CHECK(cudaMallocFromPoolAsync(&raw, report.partial_bytes, g.transient_pool(), ks));
  const std::shared_ptr<std::byte> partial_memory(static_cast<std::byte*>(raw), [ks](std::byte* p) {
    if (p && cudaFreeAsync(p, ks) != cudaSuccess) (void)cudaGetLastError();
  });
  auto partial = [&](int w, int node) {
    return partial_memory.get() + (static_cast<size_t>(w * 2) * N + static_cast<size_t>(node)) * part_bytes;
  };
  auto received = [&](int w, int node) {
    return partial_memory.get() + (static_cast<size_t>(w * 2 + 1) * N + static_cast<size_t>(node)) * part_bytes;
  };

  struct Mine {  // a piece whose node partial this rank sums
    size_t p;
    int dst;
    int64_t lo, hi, pos;
    const void* in_place;  // my own contribution, or null: staged in my slot
  };
  std::array<std::vector<Mine>, 2> own;  // per window: my own shard's pieces
  std::vector<Mine> mine;
  std::vector<int64_t> extent(static_cast<size_t>(N));  // elements of the partial for node j's rail rank
  std::vector<const void*> srcs(static_cast<size_t>(std::max(L, N)));
  std::vector<EngineSend> sends;
  std::vector<EngineRecv> recvs;
  auto add_partials = [&](int w) {  // the compute stream waits for window w's exchange first
    engine.finish();
    for (const Mine& m : own[static_cast<size_t>(w)]) {
      for (int j = 0; j < N; ++j)
        srcs[static_cast<size_t>(j)] = (j == my_node ? partial(w, j) : received(w, j)) + static_cast<size_t>(m.pos) * sizeof(float);
      detail::accumulate_in_order(out + a.out_offsets[m.p] + m.lo, std::span(srcs.data(), static_cast<size_t>(N)),
                                  DType::f32, static_cast<size_t>(m.hi - m.lo), final_scale, g.rs_ctas(), ks);
    }
  };
  uint64_t t = 0;
  for (size_t k = 0; k < pipe.chunks.size(); ++k) {
    const plan::RsChunk& chunk = pipe.chunks[k];
    const int w = static_cast<int>(k % 2);
    t = g.next(CudaGroup::kRsReady);
    (void)g.next(CudaGroup::kRsDone);
    const int idx = static_cast<int>(t % static_cast<uint64_t>(n_slots));
    if (t > static_cast<uint64_t>(n_slots))
      for (int r = 0; r < L; ++r)
        if (r != lme) g.wait(cs, r, CudaGroup::kRsDone, t - static_cast<uint64_t>(n_slots));
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(cs, g.slot_free_event(idx), 0));
    std::byte* my_slot = slots.at(lme, idx);
    // Phase 1: my slices for every destination of the group into piece d of my slot.
    mine.clear();
    std::fill(extent.begin(), extent.end(), 0);
    detail::CopyBatch batch(cs, g.device());
    for (const plan::RsPiece& pc : chunk.pieces) {
      const size_t p = static_cast<size_t>(pc.param);
      const int d = pc.dst_rank;
      TIDE_CHECK(a.grads[p], "tide: cuda: param_reduce_scatter on rank ", me, ": param ", p, " has no gradient");
      const auto* grad = static_cast<const std::byte*>(a.grads[p]);
      if (topo.local_rank(d) == lme) {
        const bool direct = plan::contiguous(pc.grad);
        mine.push_back({p, d, pc.shard_begin, pc.shard_end, pc.staging_offset,
                        direct ? grad + static_cast<size_t>(pc.grad[0].offset) * ges : nullptr});
        int64_t& ext = extent[static_cast<size_t>(topo.node_of(d))];
        ext = std::max(ext, pc.staging_offset + pc.shard_end - pc.shard_begin);
        if (direct) continue;
      }
      detail::stage_slices(batch, my_slot + static_cast<size_t>(d) * piece + static_cast<size_t>(pc.staging_offset) * ges,
                           grad, pc.grad, ges);
    }
    batch.flush();
    g.post(cs, CudaGroup::kRsReady, t);
    // The node's sum: local ranks in order, into this window's fp32 partials.
    TIDE_CUDA_CHECK(cudaEventRecord(g.phase1_event(), cs));
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(ks, g.phase1_event(), 0));
    for (int r = 0; r < L; ++r)
      if (r != lme) g.wait(ks, r, CudaGroup::kRsReady, t);
    for (const Mine& m : mine) {
      const size_t at = static_cast<size_t>(m.dst) * piece + static_cast<size_t>(m.pos) * ges;
      for (int r = 0; r < L; ++r) srcs[static_cast<size_t>(r)] = r == lme && m.in_place ? m.in_place : slots.at(r, idx) + at;
      detail::accumulate_in_order(reinterpret_cast<float*>(partial(w, topo.node_of(m.dst)) + static_cast<size_t>(m.pos) * sizeof(float)),
                                  std::span(srcs.data(), static_cast<size_t>(L)), a.grad_dtype,
                                  static_cast<size_t>(m.hi - m.lo), node_scale, g.rs_ctas(), ks);
    }
    g.post(ks, CudaGroup::kRsDone, t);
    TIDE_CUDA_CHECK(cudaEventRecord(g.slot_free_event(idx), ks));
    // The partials along the rail, in flight while the next window's node phase runs.
    sends.clear();
    recvs.clear();
    const int64_t my_extent = extent[static_cast<size_t>(my_node)];
    for (int j = 0; j < N; ++j) {
      if (j == my_node) continue;
      const int peer = topo.rank_of(j, lme);
      if (const int64_t n = extent[static_cast<size_t>(j)]; n > 0)
        sends.push_back({peer, partial(w, j), static_cast<size_t>(n) * sizeof(float)});
      if (my_extent > 0) recvs.push_back({peer, received(w, j), static_cast<size_t>(my_extent) * sizeof(float)});
    }
    own[static_cast<size_t>(w)].clear();
    for (const Mine& m : mine)
      if (m.dst == me) own[static_cast<size_t>(w)].push_back(m);
    engine.start(sends, recvs, partial_memory);
    if (k > 0) add_partials(static_cast<int>((k - 1) % 2));
  }
  if (!pipe.chunks.empty()) add_partials(static_cast<int>((pipe.chunks.size() - 1) % 2));
  // Reused slots belong to the caller again on return: no node peer may still read mine.
  if (report.reused_slots > 0 && !pipe.chunks.empty())
    for (int r = 0; r < L; ++r)
      if (r != lme) g.wait(ks, r, CudaGroup::kRsDone, t);
  g.end(stream, {cs, ks});
  return report;
}

}  // namespace

}  // namespace tide::cuda
