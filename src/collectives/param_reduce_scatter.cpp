// TIDE-RS, the one executor of the host and CUDA (include/tide/rs_node.hpp). Per window of
// the flat padded-shard space (plan::rs_pipeline, one piece per destination rank):
//   phase 1: each rank of a node copies its gradient slices for every destination into
//            piece d of its slot (grad dtype: no widening; its own contribution to its own
//            rail is read in place where contiguous) and posts ready;
//   phase 2: the rank on the destination's rail (the same local rank) sums the node's
//            pieces in local rank order: on one node straight into the sharded output with
//            the op; across nodes into an fp32 node partial (in the gradient dtype where a
//            node has one rank: exact, and bf16 halves the bytes), which the engine carries to
//            the destination's node while the next window's phase 1 runs; each rank then
//            adds its shard's partials in node order (rounded once to the output dtype).
//            With one rank per node and the caller's gradients held for the engine
//            (args.grads_alive), a contiguous piece's partial is the gradient itself: it is
//            sent and read from there, not copied.
// A slot is slot_bytes, one piece of slot_bytes / world size per destination, so staging
// does not grow with the world size. Slot-Reuse puts slots in vacated all-gather storage
// (the same place on every rank of the node); a slot is reused only after every node rank
// finished reading it (RsNode::begin_window).
#include <algorithm>
#include <array>
#include <memory>
#include <utility>
#include <vector>

#include "tide/engine.hpp"
#include "tide/error.hpp"
#include "tide/rs_node.hpp"

namespace tide {
namespace {

// The pipeline's slots, by slot index: at reuse_offset bytes into the Slot-Reuse memory
// (plan::assign_staging_slots over the vacated regions) or, at -1, the node's own slot.
struct Slots {
  RsNode& node;
  SymmetricBuffer* reuse;
  std::vector<int64_t> reuse_offset;
  std::byte* at(int local, int index) const {
    const int64_t off = reuse_offset[static_cast<size_t>(index)];
    return off >= 0 ? reuse->peer(local) + off : node.slot(local, index);
  }
};

// Fills report's reused_slots and fallback_bytes (slot_bytes and num_slots must be set).
Slots place_slots(RsNode& node, const ParamReduceScatter& a, StagingReport& report) {
  const int n_slots = node.num_slots();
  Slots slots{node, a.reuse, std::vector<int64_t>(static_cast<size_t>(n_slots), -1)};
  if (a.reuse && !a.reuse_regions.empty() && report.num_slots > 0) {
    std::vector<plan::Region> regions(a.reuse_regions.begin(), a.reuse_regions.end());
    for (auto& r : regions) r.base_id = 0;  // all are ranges of `reuse`
    const int64_t align = report.slot_bytes % 4096 == 0 ? 4096 : static_cast<int64_t>(node.piece_align());
    const plan::SlotReuse placed = plan::assign_staging_slots(std::move(regions),
                                                             static_cast<int64_t>(report.slot_bytes),
                                                             report.num_slots, align);
    const uint64_t first = node.next_step();
    for (int i = 0; i < report.num_slots; ++i)
      if (placed.slots[i].reused) {
        slots.reuse_offset[(first + static_cast<uint64_t>(i)) % static_cast<uint64_t>(n_slots)] = placed.slots[i].offset;
        ++report.reused_slots;
      }
  }
  report.fallback_bytes = static_cast<size_t>(report.num_slots - report.reused_slots) * report.slot_bytes;
  return slots;
}

// A gradient's slices (plan::Strided, elements) as copies back to back from dst on.
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

size_t round_up(size_t n, size_t align) { return (n + align - 1) / align * align; }

StagingReport run(const ParamReduceScatter& a, const TwoLevel& group, RsNode& node) {
  const plan::Topology& topo = group.topology;
  const int me = group.rank, lme = node.local_rank(), L = topo.local_size, N = topo.num_nodes, ws = topo.world_size;
  const int my_node = topo.node_of(me);
  const plan::GroupLayout& layout = *a.layout;
  TIDE_CHECK(layout.world_size == ws && node.local_size() == L && lme == topo.local_rank(me) && (N == 1 || group.engine),
             "tide param_reduce_scatter: rank ", me, ": layout for ", layout.world_size, " ranks, topology ", N, " x ",
             L, ", node of ", node.local_size(), " (its rank ", lme, ")", group.engine ? "" : ", no engine");
  const size_t ges = dtype_size(a.grad_dtype), oes = dtype_size(a.out_dtype);
  // On one node the node's sum is the result; across nodes it is a partial in fp32 (fp64 for
  // an fp64 output): premul_sum multiplies there, avg divides once by the group at the end.
  const bool one_node = N == 1;
  DType part_dtype = a.out_dtype == DType::f64 ? DType::f64 : DType::f32;
  // With one rank per node a node partial is that rank's gradient, which its own dtype holds
  // exactly: it crosses nodes in that dtype (bf16: half the bytes), and the sums are the same
  // bits. A premul_sum factor, applied in the node phase, would round there: it stays wide.
  if (L == 1 && a.op.op != ReduceOp::premul_sum && dtype_size(a.grad_dtype) < dtype_size(part_dtype))
    part_dtype = a.grad_dtype;
  const size_t pes = dtype_size(part_dtype);
  const bool from_grads =
      !one_node && L == 1 && part_dtype == a.grad_dtype && a.op.op != ReduceOp::premul_sum && a.grads_alive;
  ReduceArgs node_op = a.op, rail_op;
  if (!one_node) {
    TIDE_CHECK(is_floating(a.grad_dtype) &&
                   (a.op.op == ReduceOp::sum || a.op.op == ReduceOp::avg || a.op.op == ReduceOp::premul_sum),
               "tide param_reduce_scatter: rank ", me, ": across nodes, only sum / avg / premul_sum of floating "
               "gradients (got ", reduce_op_name(a.op.op), " of ", dtype_name(a.grad_dtype), ")");
    node_op = a.op.op == ReduceOp::premul_sum ? a.op : ReduceArgs{};
    if (a.op.op == ReduceOp::avg) rail_op = {ReduceOp::avg, 1.0, static_cast<size_t>(ws)};
  }
  for (size_t p = 0; p < layout.params.size(); ++p)
    TIDE_CHECK(a.grads[p] || layout.params[p].numel == 0, "tide param_reduce_scatter: rank ", me, ": parameter ", p,
               " has no gradient");

  // FSDP2 reduces zero-padded inputs: the padding of my shards is zero.
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const plan::ParamLayout& pl = layout.params[p];
    const int64_t n = pl.shards[me].numel;
    if (pl.padded_shard_numel > n)
      node.zero(static_cast<std::byte*>(a.out) + static_cast<size_t>(a.out_offsets[p] + n) * oes,
                static_cast<size_t>(pl.padded_shard_numel - n) * oes);
  }

  StagingReport report;
  report.slot_bytes = node.slot_bytes();
  const size_t piece = node.slot_bytes() / static_cast<size_t>(ws) / node.piece_align() * node.piece_align();
  TIDE_CHECK(piece >= ges, "tide param_reduce_scatter: rank ", me, ": a staging slot of ", node.slot_bytes(),
             " bytes cannot hold a piece for each of ", ws,
             " ranks (TIDE_SHM_STAGING_BYTES on the host, TIDE_CUDA_STAGING_BYTES on CUDA)");
  const plan::RsPipeline pipe = plan::rs_pipeline(
      layout, {static_cast<int64_t>(piece), node.num_slots(), static_cast<int64_t>(ges), node.window_align()});
  report.num_slots = pipe.num_slots;
  const Slots slots = place_slots(node, a, report);

  // Across nodes, per window in flight (two: window k's partials travel while window k + 1's
  // node phase runs), N partials of one destination's part of a window each, for my rail's
  // rank on every node (this node's sums), then N - 1 received (the other nodes' partials of
  // my shard). Where every piece is sent straight from the gradient, no partial is made here.
  bool all_direct = from_grads;
  for (const plan::RsChunk& chunk : pipe.chunks)
    for (const plan::RsPiece& pc : chunk.pieces) all_direct = all_direct && plan::contiguous(pc.grad);
  const size_t made = all_direct ? 0 : static_cast<size_t>(N), per_window = made + static_cast<size_t>(N - 1);
  const size_t part_bytes = round_up(static_cast<size_t>(pipe.widest_window()) * pes, node.piece_align());
  const size_t windows_in_flight = one_node ? 0 : std::min<size_t>(2, pipe.chunks.size());
  report.partial_bytes = windows_in_flight * per_window * part_bytes;
  std::shared_ptr<std::byte> partials;
  if (report.partial_bytes) partials = node.partials(report.partial_bytes);
  auto partial = [&](size_t window, int of_node) {
    return partials.get() + ((window % 2) * per_window + static_cast<size_t>(of_node)) * part_bytes;
  };
  auto received = [&](size_t window, int of_node) {  // never from my own node
    return partials.get() + ((window % 2) * per_window + made + static_cast<size_t>(of_node - (of_node > my_node))) * part_bytes;
  };
  // What a failed exchange's late delivery may still touch: the partials, and the gradients
  // where they are sent from.
  std::shared_ptr<const void> engine_alive = partials;
  if (from_grads)
    engine_alive = std::make_shared<std::pair<std::shared_ptr<std::byte>, std::shared_ptr<const void>>>(
        partials, a.grads_alive);

  struct Sum {  // a piece whose node sum this rank makes
    size_t p;
    int dst;
    int64_t lo, hi, pos;
    const void* in_place;  // my own contribution, or null: staged in my slot
  };
  std::array<std::vector<Sum>, 2> own;  // per window in flight: my own shard's pieces
  std::vector<Sum> sums;
  std::vector<StridedCopy> ops;
  std::vector<const void*> srcs(static_cast<size_t>(std::max(L, N)));
  std::vector<int64_t> extent(static_cast<size_t>(N));  // elements of the partial for node j's rail rank
  std::vector<EngineSend> sends;
  std::vector<EngineRecv> recvs;
  auto out_at = [&](const Sum& s) {
    return static_cast<std::byte*>(a.out) + static_cast<size_t>(a.out_offsets[s.p] + s.lo) * oes;
  };
  // My node's partial of a piece: the gradient itself where it is sent from there.
  auto node_partial = [&](size_t k, const Sum& s) -> const void* {
    if (from_grads && s.in_place) return s.in_place;
    return partial(k, topo.node_of(s.dst)) + static_cast<size_t>(s.pos) * pes;
  };
  // A window's end across nodes: its partials arrived; add them, in node order, into my shard.
  auto add_partials = [&](size_t k) {
    group.engine->finish();
    for (const Sum& s : own[k % 2]) {
      for (int j = 0; j < N; ++j)
        srcs[static_cast<size_t>(j)] = j == my_node ? node_partial(k, s) : received(k, j) + static_cast<size_t>(s.pos) * pes;
      node.accumulate(out_at(s), a.out_dtype, std::span(srcs.data(), static_cast<size_t>(N)), part_dtype,
                      static_cast<size_t>(s.hi - s.lo), rail_op);
    }
  };

  uint64_t step = 0;
  for (size_t k = 0; k < pipe.chunks.size(); ++k) {
    const plan::RsChunk& chunk = pipe.chunks[k];
    step = node.begin_window();
    const int idx = static_cast<int>(step % static_cast<uint64_t>(node.num_slots()));
    std::byte* my_slot = slots.at(lme, idx);
    // Phase 1.
    ops.clear();
    sums.clear();
    std::fill(extent.begin(), extent.end(), 0);
    for (const plan::RsPiece& pc : chunk.pieces) {
      const size_t p = static_cast<size_t>(pc.param);
      const int d = pc.dst_rank;
      const auto* grad = static_cast<const std::byte*>(a.grads[p]);
      if (topo.local_rank(d) == lme) {
        const bool direct = plan::contiguous(pc.grad);
        sums.push_back({p, d, pc.shard_begin, pc.shard_end, pc.staging_offset,
                        direct ? grad + static_cast<size_t>(pc.grad[0].offset) * ges : nullptr});
        if (!from_grads) {  // one message per node pair: the partial's span
          int64_t& ext = extent[static_cast<size_t>(topo.node_of(d))];
          ext = std::max(ext, pc.staging_offset + pc.shard_end - pc.shard_begin);
        }
        if (direct) continue;
      }
      stage_slices(ops, my_slot + static_cast<size_t>(d) * piece + static_cast<size_t>(pc.staging_offset) * ges, grad,
                   pc.grad, ges);
    }
    node.stage(ops, a.grad_dtype);
    node.ready(step);
    // Phase 2, the node's sum: local ranks in order.
    node.await_ready(step);
    for (const Sum& s : sums) {
      if (from_grads && s.in_place) continue;  // its partial is the gradient
      const size_t at = static_cast<size_t>(s.dst) * piece + static_cast<size_t>(s.pos) * ges;
      for (int r = 0; r < L; ++r)
        srcs[static_cast<size_t>(r)] = r == lme && s.in_place ? s.in_place : slots.at(r, idx) + at;
      const std::span<const void* const> node_srcs(srcs.data(), static_cast<size_t>(L));
      if (one_node)
        node.accumulate(out_at(s), a.out_dtype, node_srcs, a.grad_dtype, static_cast<size_t>(s.hi - s.lo), node_op);
      else
        node.accumulate(partial(k, topo.node_of(s.dst)) + static_cast<size_t>(s.pos) * pes, part_dtype, node_srcs,
                        a.grad_dtype, static_cast<size_t>(s.hi - s.lo), node_op);
    }
    node.end_window(step);
    if (one_node) continue;
    // The partials along the rail, in flight while the next window's node phase runs.
    sends.clear();
    recvs.clear();
    const int64_t my_extent = extent[static_cast<size_t>(my_node)];
    for (int j = 0; j < N; ++j) {
      if (j == my_node) continue;
      const int peer = topo.rank_of(j, lme);
      if (from_grads) {
        // A message per piece, in the plan's order, which the peer receives alike.
        for (const Sum& s : sums) {
          const size_t bytes = static_cast<size_t>(s.hi - s.lo) * pes;
          if (bytes == 0) continue;
          if (s.dst == peer) {
            sends.push_back({peer, node_partial(k, s), bytes});
            if (s.in_place) report.direct_bytes += bytes;
          }
          if (s.dst == me) recvs.push_back({peer, received(k, j) + static_cast<size_t>(s.pos) * pes, bytes});
        }
        continue;
      }
      if (const int64_t n = extent[static_cast<size_t>(j)]; n > 0)
        sends.push_back({peer, partial(k, j), static_cast<size_t>(n) * pes});
      if (my_extent > 0) recvs.push_back({peer, received(k, j), static_cast<size_t>(my_extent) * pes});
    }
    own[k % 2].clear();
    for (const Sum& s : sums)
      if (s.dst == me) own[k % 2].push_back(s);
    group.engine->start(sends, recvs, engine_alive);
    if (k > 0) add_partials(k - 1);
  }
  if (!one_node && !pipe.chunks.empty()) add_partials(pipe.chunks.size() - 1);
  // Slots in reused storage belong to the caller again on return: no node rank reads mine.
  if (report.reused_slots > 0 && !pipe.chunks.empty()) node.release(step);
  return report;
}

}  // namespace

StagingReport param_reduce_scatter(const ParamReduceScatter& a, const TwoLevel& group, RsNode& node) {
  if (group.topology.num_nodes == 1) return run(a, group, node);
  try {
    return run(a, group, node);
  } catch (const TimeoutError& e) {  // a peer failed: say in which collective
    group.engine->abandon();           // a window's partials may be in flight
    throw TimeoutError(detail::concat("tide param_reduce_scatter across nodes: rank ", group.rank, ": ", e.what()));
  } catch (...) {
    group.engine->abandon();
    throw;
  }
}

}  // namespace tide
