// TIDE-AG across nodes on CUDA. The executor is the host's (src/collectives/node_all_gather.cpp,
// node_param_all_gather); here are its node side and its set-up on a GPU:
//   - the node peers are this node's CudaGroup: peers' storages through the symmetric
//     memory they lie in (the Slot-Reuse pool), progress in the group's node_ag flags,
//     moves as cudaMemcpy2DAsync (copy engines), packing buffers from the group's
//     transient pool (stream-ordered),
//     the final barrier as ag_done flags: all enqueued on the group's copy stream;
//   - the engine (NCCL) must be stream-ordered on that same stream: its exchanges start
//     after the moves enqueued before them, and what is enqueued after waits for them.
// Nothing waits on the host; the caller's stream waits for the end.
#include <algorithm>
#include <vector>

#include "../../core/env.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"
#include "tide/cuda/kernels.hpp"
#include "tide/engine.hpp"

namespace tide::cuda {
namespace {

class CudaNodePeers final : public NodePeers {
 public:
  CudaNodePeers(CudaGroup& g, const plan::Topology& topo, int rank, SymmetricBuffer& storages,
                std::span<const size_t> offsets, cudaStream_t s)
      : g_(g), topo_(topo), me_(rank), storages_(storages), offsets_(offsets), s_(s) {}

  const std::byte* storage(int rank, int param) override {
    return storages_.peer(local(rank)) + offsets_[static_cast<size_t>(param)];
  }
  void publish(uint64_t value) override {
    // The executor publishes base + 1, base + 2, ... from the group's last value: the flag's
    // epoch stays what it published, which an abort's release reads.
    TIDE_CHECK(value == g_.current(CudaGroup::kNodeAg) + 1, "tide: cuda: param_all_gather on rank ", me_,
               ": progress ", value, " after ", g_.current(CudaGroup::kNodeAg));
    g_.post(s_, CudaGroup::kNodeAg, g_.next(CudaGroup::kNodeAg));
  }
  void await(int rank, uint64_t value) override { g_.wait(s_, local(rank), CudaGroup::kNodeAg, value); }
  void barrier() override {
    const uint64_t done = g_.next(CudaGroup::kAgDone);
    g_.post(s_, CudaGroup::kAgDone, done);
    for (int r = 0; r < g_.world_size(); ++r)
      if (r != g_.rank()) g_.wait(s_, r, CudaGroup::kAgDone, done);
  }
  void copy(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) override {
    if (rows == 1)  // no pitch limit (cudaMemcpy2D's widths stop at cudaDevAttrMaxPitch)
      TIDE_CUDA_CHECK(cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, s_));
    else
      TIDE_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, s_));
  }
  std::shared_ptr<std::byte> scratch(size_t bytes) override {
    void* p = nullptr;
    TIDE_CUDA_CHECK(cudaMallocFromPoolAsync(&p, std::max<size_t>(bytes, 1), g_.transient_pool(), s_));
    cudaStream_t s = s_;
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [s](std::byte* q) {
      if (cudaFreeAsync(q, s) != cudaSuccess) (void)cudaGetLastError();  // in stream order
    });
  }

 private:
  int local(int rank) const {
    TIDE_CHECK(topo_.node_of(rank) == topo_.node_of(me_), "tide: cuda: rank ", me_, " asked for node-local memory of rank ",
               rank, " on another node");
    return topo_.local_rank(rank);
  }
  CudaGroup& g_;
  const plan::Topology& topo_;
  int me_;
  SymmetricBuffer& storages_;
  std::span<const size_t> offsets_;
  cudaStream_t s_;
};

bool castable(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

}  // namespace

void param_all_gather_across_nodes(CudaGroup& g, const ParamAllGather& a, const NodeAllGatherArgs& nodes,
                                   cudaStream_t stream) {
  TIDE_CHECK(nodes.nodes && nodes.nodes->engine, "tide: cuda: param_all_gather: no group of nodes or no engine");
  const plan::Topology& topo = nodes.nodes->topology;
  const int me = nodes.nodes->rank;
  Engine& engine = *nodes.nodes->engine;
  TIDE_CHECK(a.layout, "tide: cuda: param_all_gather on rank ", me, ": no layout");
  const plan::GroupLayout& layout = *a.layout;
  const size_t np = layout.params.size();
  TIDE_CHECK(layout.world_size == topo.world_size && g.world_size() == topo.local_size &&
                 g.rank() == topo.local_rank(me),
             "tide: cuda: param_all_gather on rank ", me, ": layout for ", layout.world_size, " ranks, topology ",
             topo.num_nodes, " x ", topo.local_size, ", node group of ", g.world_size(), " (its rank ", g.rank(), ")");
  TIDE_CHECK(g.allgather_path().path != AllGatherPath::nccl, "tide: cuda: param_all_gather on rank ", me,
             ": the node's GPUs cannot map each other's memory (", g.allgather_path().reason, ")");
  TIDE_CHECK(a.storages.size() == np && a.shard_offsets.size() == np && nodes.storage_offsets.size() == np,
             "tide: cuda: param_all_gather on rank ", me, ": ", np, " params but ", a.storages.size(), " storages, ",
             a.shard_offsets.size(), " shard offsets and ", nodes.storage_offsets.size(), " storage offsets");
  TIDE_CHECK(a.shards && nodes.storage_home, "tide: cuda: param_all_gather on rank ", me,
             ": no shard memory or no symmetric home of the storages");
  const bool cast = a.shard_dtype != a.storage_dtype;
  TIDE_CHECK(!cast || (castable(a.shard_dtype) && castable(a.storage_dtype)), "tide: cuda: param_all_gather on rank ",
             me, ": no conversion from ", dtype_name(a.shard_dtype), " to ", dtype_name(a.storage_dtype),
             " (f32/bf16/f16 only)");
  const size_t des = dtype_size(a.storage_dtype);
  for (size_t p = 0; p < np; ++p)
    TIDE_CHECK(a.storages[p] == nodes.storage_home->local() + nodes.storage_offsets[p] ||
                   layout.params[p].storage_numel == 0,
               "tide: cuda: param_all_gather on rank ", me, ": param ", p,
               "'s storage is not at its offset in the symmetric home");

  cudaStream_t s = g.copy_stream();
  g.begin("param_all_gather", stream, {s});
  CudaNodePeers peers(g, topo, me, *nodes.storage_home, nodes.storage_offsets, s);
  // This rank's own shard, cast where the dtypes differ (copy engines cannot convert), to
  // its placement in its own storages.
  for (size_t p = 0; p < np; ++p) {
    const plan::Shard& sh = layout.params[p].shards[me];
    if (sh.numel == 0) continue;
    const std::byte* src = a.shards->local() + a.shard_offsets[p];
    std::shared_ptr<std::byte> converted;
    if (cast) {
      converted = peers.scratch(static_cast<size_t>(sh.numel) * des);
      TIDE_CUDA_CHECK(launch_cast(converted.get(), a.storage_dtype, src, a.shard_dtype, static_cast<size_t>(sh.numel), s));
      src = converted.get();
    }
    const plan::Strided& pl = sh.placement;
    const size_t run = static_cast<size_t>(pl.run) * des;
    peers.copy(static_cast<std::byte*>(a.storages[p]) + static_cast<size_t>(pl.offset) * des,
               pl.count > 1 ? static_cast<size_t>(pl.stride) * des : run, src, run, run, static_cast<size_t>(pl.count));
  }
  size_t pace = nodes.pace_bytes;
  if (pace == 0) pace = env::get_bytes("TIDE_ALLGATHER_PACE_BYTES", size_t{4} << 20);
  TIDE_CHECK(nodes.schedules, "tide: cuda: param_all_gather on rank ", me, ": no schedule cache");
  const plan::NodeAllGatherSchedule& schedule = nodes.schedules->get(
      layout, topo, plan::planner_pace(layout, static_cast<int64_t>(pace), static_cast<int64_t>(des)), me);
  // The storages lie at the same pool offsets on every rank of the group (CudaPath checks
  // the offsets across ranks): contiguous blocks may be put straight into a peer's.
  node_param_all_gather({&layout, &schedule, me, a.storages, des, g.current(CudaGroup::kNodeAg), true}, engine, peers);
  g.end(stream, {s});
}

}  // namespace tide::cuda
