// TIDE-RS, written once (src/collectives/param_reduce_scatter.cpp), over a node interface:
// the host (tide::Transport's shared-memory staging, at once) and CUDA (a CudaGroup's
// symmetric staging, enqueued on its streams) each supply only an RsNode. One node is the
// case of a one-node topology with no engine.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "tide/comm.hpp"
#include "tide/plan.hpp"
#include "tide/transport.hpp"

namespace tide {

class Engine;

// A node as TIDE-RS sees it from one of its ranks. The pipeline runs in windows: window
// step s uses staging slot s % num_slots() of every rank of the node; each window is
// begin_window, stage, ready, await_ready, accumulate..., end_window. The host does each
// call at once; CUDA enqueues it (staging on the copy stream, the rest and the engine's
// exchanges on the compute stream), so the executor never reads on the host what a window
// produced.
class RsNode {
 public:
  virtual ~RsNode() = default;
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  virtual size_t slot_bytes() const = 0;
  virtual int num_slots() const = 0;
  // Every piece of a slot and every node partial starts at a multiple of this many bytes.
  virtual size_t piece_align() const = 0;
  // The planner's staging alignment (plan::RsPipelineOptions::align_bytes): 0 on the host;
  // CUDA aligns for the accumulation's 16-byte loads.
  virtual int64_t window_align() const { return 0; }
  // The step of the next window (the same on every rank of the node).
  virtual uint64_t next_step() const = 0;
  // Starts the next window and returns its step, once every node rank finished reading the
  // slot's previous contents (the window num_slots() before).
  virtual uint64_t begin_window() = 0;
  // Slot `index` of the node's local rank `local` in the node's own staging.
  virtual std::byte* slot(int local, int index) = 0;
  // Phase 1: these copies (elements of `dtype`) into this rank's slot; then ready(step).
  virtual void stage(std::span<const StridedCopy> copies, DType dtype) = 0;
  virtual void ready(uint64_t step) = 0;
  // Phase 2 may read every node rank's slot of `step` after this.
  virtual void await_ready(uint64_t step) = 0;
  // dst = op over srcs, in their order, accumulated in fp32 (fp64 for fp64) and rounded once
  // to dst_dtype: the same bits for the same sources in the same order.
  virtual void accumulate(void* dst, DType dst_dtype, std::span<const void* const> srcs, DType src_dtype,
                          size_t count, ReduceArgs op) = 0;
  // This rank read all it needs of the window's slots.
  virtual void end_window(uint64_t step) = 0;
  // Returns once no node rank reads this rank's slots of windows up to `step` any more.
  virtual void release(uint64_t step) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  // A buffer of `bytes` in the memory the engine moves (node partials), freed when its last
  // owner lets go, after the work enqueued before that.
  virtual std::shared_ptr<std::byte> scratch(size_t bytes) = 0;
  // The node partials of one reduce-scatter (across nodes): `bytes` of scratch whose bytes
  // are all initialized (no uninitialized memory goes on the wire through the gaps between
  // partials): zeroed scratch here; the host keeps one buffer, zeroed once, across calls.
  virtual std::shared_ptr<std::byte> partials(size_t bytes) {
    std::shared_ptr<std::byte> p = scratch(bytes);
    zero(p.get(), bytes);
    return p;
  }
};

// TIDE-RS (arguments checked and agreed by the caller): a two-phase pipeline over windows
// of the flat padded-shard space. Per window, every rank of a node copies its gradient
// slices for every destination into its slot (grad dtype); the rank of the destination's
// rail sums the node's pieces in local rank order (into the output on one node, else into
// an fp32 node partial, or with one rank per node its gradient in its own dtype, sent from
// the gradient itself where args.grads_alive holds it for the engine); across
// nodes the partials travel along the rails over the engine while the next window's node
// phase runs, and each rank adds its shard's partials in node
// order. Sum order: local ranks, then nodes (rank order on one node, and with one rank per
// node); `group` on one node: one node of the node's ranks, no engine. Staging: the node's slots, or Slot-Reuse memory (args.reuse, indexed by local
// rank), plus across nodes 2 windows x 2N partials of at most one piece each.
StagingReport param_reduce_scatter(const ParamReduceScatter& args, const TwoLevel& group, RsNode& node);

}  // namespace tide
