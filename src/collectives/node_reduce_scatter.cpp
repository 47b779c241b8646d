// TIDE-RS across nodes: the two-phase pipeline of param_reduce_scatter.cpp, with a node's
// ranks in place of the world and an engine between the nodes. The whole group's flat
// padded-shard space is cut into windows (plan::rs_pipeline, one piece per destination
// rank of the group). Per window, on every rank of a node:
//   phase 1: copy my gradient slices for every destination into my staging slot (grad dtype);
//            the rank of the node on the destination's rail (same local rank) sums the
//            node's pieces, in local rank order, into an fp32 node partial;
//   phase 2: send each partial along the rail to its destination's node (the engine),
//            receive the other nodes' partials of my own shard, and add all of them, in node
//            order, into my sharded gradient (rounded once to its dtype). A window's partials
//            are in flight while the next window's phase 1 runs.
// Sum order: node partials over local ranks 0..L-1, then nodes 0..N-1, fixed and the same
// run to run; with one rank per node it is rank order, as on one host. Staging: the node's
// slots (slot_bytes, one piece per group rank) plus, for each of two windows in flight,
// 2N fp32 partials of at most one piece's elements (sent and received): at most about
// 4 x slot_bytes x 4 / (L x grad element size), independent of the number of nodes.
#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "algorithms.hpp"
#include "tide/engine.hpp"

namespace tide::algo {

namespace {
StagingReport run_node_reduce_scatter(Ctx& c, const ParamReduceScatter& a);
}

StagingReport node_param_reduce_scatter(Ctx& c, const ParamReduceScatter& a) {
  try {
    return run_node_reduce_scatter(c, a);
  } catch (const TimeoutError& e) {  // a peer failed: say in which collective
    a.nodes->engine->abandon();        // a window's partials may be in flight
    throw TimeoutError(detail::concat("tide param_reduce_scatter across nodes: rank ", a.nodes->rank, ": ", e.what()));
  } catch (...) {
    a.nodes->engine->abandon();
    throw;
  }
}

namespace {
StagingReport run_node_reduce_scatter(Ctx& c, const ParamReduceScatter& a) {
  Transport& t = c.t;
  const plan::Topology& topo = *a.nodes->topology;
  Engine& engine = *a.nodes->engine;
  const int me = a.nodes->rank, lme = c.rank(), L = topo.local_size, N = topo.num_nodes, ws = topo.world_size;
  const int my_node = topo.node_of(me);
  const plan::GroupLayout& layout = *a.layout;
  const size_t ges = dtype_size(a.grad_dtype), oes = dtype_size(a.out_dtype);
  const DType part_dtype = a.out_dtype == DType::f64 ? DType::f64 : DType::f32;
  const size_t pes = dtype_size(part_dtype);
  TIDE_CHECK(is_floating(a.grad_dtype) &&
                 (a.op.op == ReduceOp::sum || a.op.op == ReduceOp::avg || a.op.op == ReduceOp::premul_sum),
             "tide param_reduce_scatter: rank ", me, ": across nodes, only sum / avg / premul_sum of floating "
             "gradients (got ", reduce_op_name(a.op.op), " of ", dtype_name(a.grad_dtype), ")");
  // Phase 1 premultiplies; phase 2 divides by the whole group for avg.
  const ReduceArgs node_op = a.op.op == ReduceOp::premul_sum ? a.op : ReduceArgs{};
  ReduceArgs rail_op;
  if (a.op.op == ReduceOp::avg) rail_op = {ReduceOp::avg, 1.0, static_cast<size_t>(ws)};

  zero_shard_padding(a, me);

  StagingReport report;
  report.slot_bytes = t.slot_bytes();
  const size_t piece = t.slot_bytes() / static_cast<size_t>(ws) / 64 * 64;
  TIDE_CHECK(piece >= ges, "tide param_reduce_scatter: rank ", me, ": a staging slot of ", t.slot_bytes(),
             " bytes cannot hold a piece for each of ", ws, " ranks (TIDE_SHM_SLOT_BYTES)");
  const plan::RsPipeline pipe = plan::rs_pipeline(
      layout, {static_cast<int64_t>(piece), t.num_slots(), static_cast<int64_t>(ges)});
  report.num_slots = pipe.num_slots;
  const RsSlots slots = place_rs_slots(c, a, report);
  auto slot_of = [&](int local, int idx) { return slots.at(t, a.reuse, local, idx); };

  struct Mine {  // a piece whose node partial this rank sums
    size_t p;
    int dst;
    int64_t lo, hi, pos;
    const void* in_place;  // my own contribution, or null: staged in my slot
  };
  // Two windows in flight: window k's partials travel (engine) while window k + 1's node
  // phase runs. Per window, partials[j]: this node's partial for my rail's rank on node j;
  // received[j]: node j's partial of my own shard (j != my_node).
  // A partial holds one destination's part of a window: at most a piece, less for small groups
  // (sized to the widest window).
  const size_t part_bytes = static_cast<size_t>(pipe.widest_window()) * pes;
  struct Window {
    std::shared_ptr<std::byte[]> partials, received;  // kept alive by the engine while in flight
    std::vector<Mine> own;  // my own shard's pieces: phase 2 adds the nodes' partials there
  };
  std::array<Window, 2> windows;
  const size_t windows_in_flight = std::min<size_t>(2, pipe.chunks.size());
  for (size_t i = 0; i < windows_in_flight; ++i) {
    windows[i].partials.reset(new std::byte[static_cast<size_t>(N) * part_bytes]());  // no stale bytes in the
    windows[i].received.reset(new std::byte[static_cast<size_t>(N) * part_bytes]());  // gaps that are sent
  }
  report.partial_bytes = windows_in_flight * 2 * static_cast<size_t>(N) * part_bytes;

  std::vector<StridedCopy> ops;
  std::vector<const void*> srcs(static_cast<size_t>(std::max(L, N)));
  std::vector<Mine> mine;
  std::vector<int64_t> extent(static_cast<size_t>(N));  // elements of the partial for node j's rail rank
  std::vector<EngineSend> sends;
  std::vector<EngineRecv> recvs;
  // Phase 2's end: the window's partials have arrived; add them, in node order, into my shard.
  auto add_partials = [&](Window& w) {
    engine.finish();
    for (const Mine& m : w.own) {
      for (int j = 0; j < N; ++j) {
        const std::byte* from = j == my_node ? w.partials.get() : w.received.get();
        srcs[static_cast<size_t>(j)] = from + static_cast<size_t>(j) * part_bytes + static_cast<size_t>(m.pos) * pes;
      }
      t.reduce(bytes_of(a.out) + static_cast<size_t>(a.out_offsets[m.p] + m.lo) * oes, a.out_dtype,
               std::span(srcs.data(), static_cast<size_t>(N)), part_dtype, static_cast<size_t>(m.hi - m.lo), rail_op);
    }
  };
  for (size_t k = 0; k < pipe.chunks.size(); ++k) {
    const plan::RsChunk& chunk = pipe.chunks[k];
    Window& w = windows[k % 2];
    const int idx = c.begin_step();
    std::byte* my_slot = slot_of(lme, idx);
    ops.clear();
    mine.clear();
    std::fill(extent.begin(), extent.end(), 0);
    for (const plan::RsPiece& pc : chunk.pieces) {
      const size_t p = static_cast<size_t>(pc.param);
      const int d = pc.dst_rank;
      const std::byte* grad = bytes_of(a.grads[p]);
      if (topo.local_rank(d) == lme) {
        const bool direct = plan::contiguous(pc.grad);
        mine.push_back({p, d, pc.shard_begin, pc.shard_end, pc.staging_offset,
                        direct ? grad + static_cast<size_t>(pc.grad[0].offset) * ges : nullptr});
        int64_t& ext = extent[static_cast<size_t>(topo.node_of(d))];
        ext = std::max(ext, pc.staging_offset + pc.shard_end - pc.shard_begin);
        if (direct) continue;
      }
      stage_slices(ops, my_slot + static_cast<size_t>(d) * piece + static_cast<size_t>(pc.staging_offset) * ges, grad,
                   pc.grad, ges);
    }
    t.convert(ops, a.grad_dtype, a.grad_dtype);
    t.post(Flag::ready(), c.step);
    // Phase 1, the node's sum: local ranks in order, into this node's fp32 partials.
    for (int r = 0; r < L; ++r)
      if (r != lme) t.wait(r, Flag::ready(), c.step);
    for (const Mine& m : mine) {
      const size_t at = static_cast<size_t>(m.dst) * piece + static_cast<size_t>(m.pos) * ges;
      for (int r = 0; r < L; ++r) srcs[static_cast<size_t>(r)] = r == lme && m.in_place ? m.in_place : slot_of(r, idx) + at;
      std::byte* into = w.partials.get() + static_cast<size_t>(topo.node_of(m.dst)) * part_bytes +
                        static_cast<size_t>(m.pos) * pes;
      t.reduce(into, part_dtype, std::span(srcs.data(), static_cast<size_t>(L)), a.grad_dtype,
               static_cast<size_t>(m.hi - m.lo), node_op);
    }
    c.end_step();  // my slot's readers are done with this window once the node's peers are
    // Phase 2: the partials along the rail (in flight while the next window's node phase runs).
    sends.clear();
    recvs.clear();
    const int64_t my_extent = extent[static_cast<size_t>(my_node)];
    for (int j = 0; j < N; ++j) {
      if (j == my_node) continue;
      const int peer = topo.rank_of(j, lme);
      if (const int64_t n = extent[static_cast<size_t>(j)]; n > 0)
        sends.push_back({peer, w.partials.get() + static_cast<size_t>(j) * part_bytes, static_cast<size_t>(n) * pes});
      if (my_extent > 0)
        recvs.push_back({peer, w.received.get() + static_cast<size_t>(j) * part_bytes,
                         static_cast<size_t>(my_extent) * pes});
    }
    w.own.clear();
    for (const Mine& m : mine)
      if (m.dst == me) w.own.push_back(m);
    engine.start(sends, recvs, std::make_shared<std::array<std::shared_ptr<std::byte[]>, 2>>(
                                   std::array{w.partials, w.received}));
    if (k > 0) add_partials(windows[(k - 1) % 2]);
  }
  if (!pipe.chunks.empty()) add_partials(windows[(pipe.chunks.size() - 1) % 2]);
  if (report.reused_slots > 0)
    for (int r = 0; r < L; ++r)
      if (r != lme) t.wait(r, Flag::done(), c.step);
  return report;
}

}  // namespace

}  // namespace tide::algo
