// The layout planner: for every (rank, parameter) of an FSDP2 parameter group, where the
// bytes of each shard live and where they must land. TIDE's collectives execute these plans
// directly against FSDP2's per-parameter storages, so no flat rank-major buffer exists.
//
// Pure C++20: no torch, no CUDA. Plain structs and vectors, deterministic output, no state.
// Units: offsets and lengths are in elements of the tensor they index unless a name says
// bytes; Strided::in_bytes converts a pattern to bytes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace tide::plan {

// ---- Parameters and FSDP2's sharding (sharding.cpp) -------------------------------------

// One parameter of an FSDP2 group as fully_shard sees it.
struct Param {
  std::vector<int64_t> shape;
  int64_t elem_size = 4;  // bytes per element of the unsharded (all-gathered) parameter
  int64_t shard_dim = 0;  // FSDP2's Shard(dim) placement; negative counts from the back
};

// `count` runs of `run` contiguous elements; run i starts at offset + i * stride.
struct Strided {
  int64_t offset = 0;
  int64_t run = 0;
  int64_t count = 0;
  int64_t stride = 0;

  int64_t numel() const { return run * count; }
  Strided in_bytes(int64_t elem_size) const {
    return {offset * elem_size, run * elem_size, count, stride * elem_size};
  }
  bool operator==(const Strided&) const = default;
};

// One rank's shard of one parameter, as FSDP2's FSDPParam._init_sharded_param builds it.
struct Shard {
  std::vector<int64_t> sharded_size;         // FSDPParam.sharded_size (unpadded)
  std::vector<int64_t> padded_sharded_size;  // FSDPParam.padded_sharded_param_size (chunk 0)
  int64_t begin = 0;                         // first index of this shard along shard_dim
  int64_t numel = 0;                         // real elements (product of sharded_size)
  int64_t padded_numel = 0;                  // elements of the padded sharded storage
  // Where the shard's real elements sit in the parameter's unsharded storage; shard element
  // i (contiguous, from 0, in the rank's padded sharded storage) is the i-th element of the
  // pattern. The same pattern is the shard's slice of the unsharded gradient.
  Strided placement;
};

struct ParamLayout {
  std::vector<int64_t> shape;
  int64_t elem_size = 4;
  int64_t shard_dim = 0;  // normalized to [0, ndim)
  int64_t numel = 0;
  int64_t chunk = 0;  // rows per shard along shard_dim: torch.chunk's ceil(size / world_size)
  int64_t padded_shard_numel = 0;  // the all-gather input numel of every rank
  // FSDPParam.all_gather_outputs[0]: world_size * padded_shard_numel elements. The unsharded
  // parameter is a view of its first `numel` elements in `shape` (for Shard(d > 0) the
  // sharding is even and the storage is exactly the unsharded tensor).
  int64_t storage_numel = 0;
  std::vector<Shard> shards;  // indexed by rank

  int64_t storage_bytes() const { return storage_numel * elem_size; }
};

struct GroupLayout {
  int world_size = 1;
  std::vector<ParamLayout> params;
};

// FSDP2's sharding of `params` over `world_size` ranks. Throws tide::Error for what FSDP2
// rejects (uneven Shard(d > 0), 0-dim parameters, shard_dim out of range) and bad sizes.
GroupLayout plan_group(const std::vector<Param>& params, int world_size);
// A hash of what fixes the layout (world size, shapes, element sizes, shard dims, padded
// and storage sizes): equal on ranks that planned the same group (tide/hash.hpp's FNV-1a).
uint64_t layout_hash(const GroupLayout& layout);

// ---- Addressing (addressing.cpp) ---------------------------------------------------------

// The part of pattern `p` holding its elements [begin, end) (in pattern order), as at most
// three patterns: a partial head run, whole runs, a partial tail run.
std::vector<Strided> slice(const Strided& p, int64_t begin, int64_t end);

// Whether the patterns, in order, cover one contiguous range of elements (then a runtime
// can read the range in place instead of gathering it).
bool contiguous(const std::vector<Strided>& patterns);

// All-gather: src_rank's shard of `param` (elements [0, numel) of its padded sharded
// storage) lands at `dst` in that parameter's unsharded storage on every rank.
struct AllGatherCopy {
  int src_rank = 0;
  int param = 0;
  int64_t numel = 0;
  Strided dst;
};
// Every (source rank, parameter) with real elements, ordered by parameter then rank.
std::vector<AllGatherCopy> allgather_copies(const GroupLayout& layout);

// Reduce-scatter: the slice `src` of the unsharded gradient of `param` (original shape,
// contiguous) is reduced into elements [0, numel) of dst_rank's sharded gradient, whatever
// that gradient's dtype.
struct ReduceScatterSlice {
  int param = 0;
  int dst_rank = 0;
  int64_t numel = 0;
  Strided src;
};
// Every (parameter, destination rank) with real elements, ordered by parameter then rank.
std::vector<ReduceScatterSlice> reduce_scatter_slices(const GroupLayout& layout);

// ---- Paced recursive-doubling all-gather (allgather_schedule.cpp) -------------------------

// Elements [shard_begin, shard_end) of owner_rank's shard of `param` go from src_rank to
// dst_rank. They are read from, and land at, the same place in both ranks' unsharded
// storage of the parameter: `storage` (elements), so the receiver forwards them in place.
struct Transfer {
  int src_rank = 0;
  int dst_rank = 0;
  int owner_rank = 0;
  int param = 0;
  int64_t shard_begin = 0;
  int64_t shard_end = 0;
  std::vector<Strided> storage;
};
// Within a round every rank sends at most pace_bytes, all to its step's peer.
struct Round {
  std::vector<Transfer> transfers;
};
// At step k every rank r sends to (r + distance) % world_size the blocks it holds, owners
// r, r-1, ..., r-distance+1 (the last step: only the first world_size - distance of them).
struct Step {
  int distance = 1;
  std::vector<Round> rounds;
};
struct AllGatherSchedule {
  int world_size = 1;
  int64_t pace_bytes = 0;
  std::vector<Step> steps;  // ceil(log2(world_size)) steps
};
// Before step 0 every rank has placed its own shard at its placement in its own storage
// (allgather_copies with src_rank == self); after the last step every rank holds every
// (owner, param) block exactly once. Throws if an element is larger than pace_bytes.
AllGatherSchedule allgather_schedule(const GroupLayout& layout, int64_t pace_bytes);

// ---- Nodes of a group (topology.cpp) ------------------------------------------------------

// num_nodes nodes of local_size ranks each; node j holds ranks j * local_size .. + local_size - 1
// (torchrun's numbering). A rail is the ranks of one local rank, one per node.
struct Topology {
  int world_size = 1;
  int local_size = 1;
  int num_nodes = 1;

  int node_of(int rank) const { return rank / local_size; }
  int local_rank(int rank) const { return rank % local_size; }
  int rank_of(int node, int local) const { return node * local_size + local; }
  bool operator==(const Topology&) const = default;
};
// The nodes of a group from each rank's host identity (in rank order): one node per host
// (pseudo-nodes come as host identities of their own: host_keys). Throws, naming the ranks and
// hosts, when the nodes are not equal blocks of consecutive ranks.
Topology topology_from_hosts(const std::vector<std::string>& hosts);

// ---- The all-gather across nodes (allgather_schedule.cpp) ---------------------------------
// Two levels. inter_node: on every rail at once, the paced recursive doubling over the
// nodes (Step::distance counts nodes; every transfer joins two ranks of one rail on
// different nodes), after which every rank holds the shards of its rail. node_local: each
// rank then copies, from every other rank of its node, the blocks of that rank's rail, each
// as soon as the peer holds it: after inter-node step after_step (-1: the peer's own shard,
// before step 0), so node-local delivery overlaps the inter-node steps.
struct NodeLocalCopy {
  Transfer block;  // src_rank and dst_rank on the same node; the whole shard of owner_rank
  int after_step = -1;
};
struct NodeAllGatherSchedule {
  Topology topology;
  AllGatherSchedule inter_node;
  std::vector<NodeLocalCopy> node_local;  // by dst_rank, then after_step
};
NodeAllGatherSchedule node_allgather_schedule(const GroupLayout& layout, const Topology& topology,
                                              int64_t pace_bytes);
// The pace to plan with when blocks travel as storage_elem_size-byte elements: schedules
// pace in the parameters' own element size, so a wider storage dtype fits fewer elements
// per round (and a round holds at least one element of the widest parameter).
int64_t planner_pace(const GroupLayout& layout, int64_t pace_bytes, int64_t storage_elem_size);

// ---- Two-phase reduce-scatter pipeline (rs_pipeline.cpp) ----------------------------------

// Output elements [shard_begin, shard_end) of dst_rank's sharded gradient of `param`: read
// from `grad` (elements of the unsharded gradient) of every rank, accumulated at
// staging_offset.. in dst_rank's staging slot.
struct RsPiece {
  int param = 0;
  int dst_rank = 0;
  int64_t shard_begin = 0;
  int64_t shard_end = 0;
  int64_t staging_offset = 0;  // elements from the start of the slot
  std::vector<Strided> grad;
};
// Chunk `id` is the window [begin, end) of the flat padded shard space (parameters'
// padded shards back to back, as FSDP2's reduce_output), the same window on every rank.
// Phase 1 reads the gradients of its pieces into staging slot `slot`; phase 2 completes the
// exchange and the reduction into the sharded gradients and frees the slot for chunk
// id + max_inflight.
struct RsChunk {
  int id = 0;
  int slot = 0;  // id % max_inflight
  int64_t begin = 0;
  int64_t end = 0;
  int64_t staged = 0;           // staging elements the window takes per destination (<= chunk_elems)
  std::vector<RsPiece> pieces;  // ordered by destination rank, then parameter
};
struct RsPipelineOptions {
  int64_t chunk_bytes = 4 << 20;  // staging bytes per chunk
  int max_inflight = 2;           // chunks between phase 1 and the end of phase 2
  int64_t staging_elem_size = 4;  // bytes per staged element (fp32 accumulation)
  // 0: a window's parameters lie back to back in staging, as in the flat output space.
  // Else (a multiple of staging_elem_size): each parameter's part of a window starts in
  // staging at an offset congruent, modulo align_bytes / staging_elem_size elements, with
  // its first element's place in the flat output space, so that after the same head of a
  // few elements the CUDA accumulation reads every staged source and writes the fp32 output
  // 16 bytes at a time, also where FSDP2's layout puts a parameter's shard off a 16-byte
  // boundary; a window then ends where its staging would overflow, so windows cover
  // slightly less of the flat space (less than align_bytes per parameter).
  int64_t align_bytes = 0;
};
struct RsPipeline {
  int64_t chunk_elems = 0;
  int64_t slot_bytes = 0;  // min(chunk, whole output) elements * staging_elem_size
  int num_slots = 0;       // min(max_inflight, number of chunks)
  std::vector<RsChunk> chunks;

  // Per rank; depends on the per-rank output, not on the world size.
  int64_t staging_bytes() const { return slot_bytes * num_slots; }
  // The most staging elements one destination's part of a window takes (<= chunk_elems):
  // what a buffer holding one window's part for a destination needs.
  int64_t widest_window() const {
    int64_t w = 0;
    for (const RsChunk& c : chunks) w = std::max(w, c.staged);
    return w;
  }
};
RsPipeline rs_pipeline(const GroupLayout& layout, const RsPipelineOptions& options);

// ---- Slot-Reuse (slot_reuse.cpp) ----------------------------------------------------------

// A free byte range [offset, offset + bytes) of buffer `base_id` (e.g. the unsharded
// storage of parameter base_id once backward no longer needs it).
struct Region {
  int64_t base_id = 0;
  int64_t offset = 0;
  int64_t bytes = 0;
};
// The whole unsharded storage of every parameter, base_id = parameter index: what becomes
// vacant after a group's backward, before its reduce-scatter.
std::vector<Region> storage_regions(const GroupLayout& layout);

struct SlotHome {
  bool reused = false;   // true: inside a vacated region; false: in the fallback buffer
  int64_t base_id = -1;  // the vacated buffer; -1 for the fallback buffer
  int64_t offset = 0;    // bytes from the start of base_id's buffer (or the fallback's)
};
struct SlotReuse {
  std::vector<SlotHome> slots;  // one per staging slot
  int64_t fallback_bytes = 0;   // size of the fallback staging buffer still needed
};
// Places num_slots staging slots of slot_bytes each inside the vacated regions (first fit,
// regions in (base_id, offset) order), at offsets that are multiples of `alignment` (base
// buffers are assumed aligned at least as much); the rest go to a fallback buffer. Throws if
// regions overlap each other.
SlotReuse assign_staging_slots(std::vector<Region> vacated, int64_t slot_bytes, int num_slots,
                               int64_t alignment);

// ---- Buffer accounting (accounting.cpp) ---------------------------------------------------

struct DtypeSizes {
  int64_t reduce_elem_size = 4;  // reduce-scatter dtype (FSDP2's reduce_dtype or grad dtype)
  int64_t orig_elem_size = 0;    // sharded parameter dtype; 0: same as Param::elem_size
};
// Bytes one rank allocates per group, by role.
struct BufferBytes {
  int64_t param_storage = 0;  // per-parameter unsharded storages (both stock and TIDE)
  int64_t ag_input = 0;       // stock: cast copy of the local shards (mixed precision only)
  int64_t ag_output = 0;      // stock: flat rank-major all-gather output
  int64_t rs_input = 0;       // stock: flat rank-major reduce-scatter input in reduce dtype
  int64_t rs_output = 0;      // the reduced shards (stock: padded flat; TIDE: sharded grads)
  int64_t staging = 0;        // TIDE: reduce-scatter staging not covered by Slot-Reuse

  // Everything but the parameter storages, which FSDP2 holds either way.
  int64_t collective() const { return ag_input + ag_output + rs_input + rs_output + staging; }
};
// Stock FSDP2: foreach_all_gather + foreach_reduce.
BufferBytes stock_fsdp2_bytes(const GroupLayout& layout, const DtypeSizes& dtypes);
// TIDE on `rank`, with `staging_bytes` from RsPipeline::staging_bytes or, with Slot-Reuse,
// SlotReuse::fallback_bytes.
BufferBytes tide_bytes(const GroupLayout& layout, const DtypeSizes& dtypes, int rank,
                       int64_t staging_bytes);

}  // namespace tide::plan
