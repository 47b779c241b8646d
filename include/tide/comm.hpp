// A communicator: one process group's ranks on one host, the collectives over them.
// This is the whole surface the torch adapter (ProcessGroupTide) uses. Every call is
// blocking and collective (all ranks call it in the same order with matching arguments;
// send/recv are between two ranks). Calls on one Comm come from one thread at a time.
//
// Failures: mismatched arguments across ranks raise tide::Error on every rank, naming the
// collective, the ranks and the sizes. A dead or silent peer raises tide::TimeoutError on
// every survivor within `timeout`. After either, the Comm is unusable (every later call
// raises), like a NCCL communicator after an async error.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tide/dtype.hpp"
#include "tide/plan.hpp"
#include "tide/store.hpp"

namespace tide {

class Engine;  // include/tide/engine.hpp

struct CommOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  int num_threads = 0;        // copy/reduce threads per rank; 0: TIDE_NUM_THREADS or a default
  size_t staging_bytes = 0;   // shared-memory staging per rank; 0: TIDE_SHM_STAGING_BYTES or default
  // param_all_gather's algorithm: "direct" (every rank reads every shard from its owner:
  // one host), "doubling" (the inter-node paced recursive doubling, through staging);
  // empty: TIDE_HOST_ALLGATHER or "direct". Pace: bytes per rank and round, at most a slot;
  // 0: TIDE_ALLGATHER_PACE_BYTES or a slot. Ranks must agree (checked).
  std::string allgather_algorithm;
  size_t allgather_pace_bytes = 0;
  // Where the step and flag counters start; ranks must agree. Only tests set it: near 2^32,
  // to run the wrap-around that a long-lived communicator reaches after 2^32 pipeline steps.
  uint64_t counter_start = 0;
  // Every rank's pid where already known (the group's node discovery): a rank that dies
  // before it joins the transport is then reported at once, not at the timeout.
  std::vector<int> pids;
  // Ranks of the group on this host, pseudo-nodes included (the node discovery's count);
  // 0: the communicator's. How long a waiting rank spins depends on it (host_spin).
  int host_ranks = 0;
};

struct ReduceArgs {
  ReduceOp op = ReduceOp::sum;
  double premul_factor = 1.0;  // used by ReduceOp::premul_sum only
  // ReduceOp::avg: the number of contributors when the sources are partial sums of several
  // (TIDE-RS across nodes); 0: the number of sources.
  size_t avg_divisor = 0;
};

// Memory that every rank of a communicator maps: rank r's part is peer(r), local() is this
// rank's. Allocated collectively (each rank passes the size of its own part); unmapped when
// the last reference goes. Nothing survives the processes (names are unlinked at once).
class SymmetricBuffer {
 public:
  virtual ~SymmetricBuffer() = default;
  virtual std::byte* local() = 0;
  virtual std::byte* peer(int rank) = 0;
  virtual size_t bytes(int rank) const = 0;
  // Returns the physical pages of [offset, offset + bytes) of the local part to the OS: the
  // range stays mapped and reads as zeros until written again (FSDP2's "free the unsharded
  // storage" without giving up the symmetric address).
  virtual void release(size_t offset, size_t bytes) = 0;
  // Where the memory is: -1 for host memory, else the CUDA device ordinal.
  virtual int device() const { return -1; }
};

// TIDE-AG: every rank's shard of every parameter of an FSDP2 group lands at the planner's
// placement (plan::Shard::placement) in this rank's unsharded storage of that parameter,
// read straight from the owner's shard memory and converted on the way (the
// mixed-precision cast happens where the shard is read). Each byte is copied once.
struct ParamAllGather {
  const plan::GroupLayout* layout = nullptr;
  // Rank r's padded sharded storage of param p: shard_offsets[p] bytes into shards->peer(r)
  // (the same offsets on every rank), `shard_dtype` elements.
  SymmetricBuffer* shards = nullptr;
  std::span<const size_t> shard_offsets;
  DType shard_dtype = DType::f32;
  // This rank's unsharded storage of each parameter (layout->params[p].storage_numel
  // elements of `storage_dtype`); private memory is fine.
  std::span<void* const> storages;
  DType storage_dtype = DType::f32;
};

// TIDE-RS: this rank's unsharded gradients (one per parameter, contiguous in the
// parameter's shape, `grad_dtype`) are reduced over all ranks into each rank's sharded
// gradients: param p's shard (plan::Shard::numel elements, the rest of its padded extent
// zero-filled) at out_offsets[p] elements into `out` (`out_dtype`: f32, or grad_dtype).
// Two phases per pipeline chunk: phase 1 copies this rank's slices into staging, phase 2
// every rank reduces its slices from all ranks' staging, in rank order 0..n-1 (fp32
// accumulation: bitwise reproducible), straight into its output. Staging is bounded and
// independent of the world size. Across nodes (`nodes`), the order is: each node's ranks in
// order into an fp32 partial, then the partials in node order (the same as rank order when
// each node has one rank).
struct ParamReduceScatter {
  const plan::GroupLayout* layout = nullptr;
  std::span<const void* const> grads;
  DType grad_dtype = DType::f32;
  void* out = nullptr;
  std::span<const int64_t> out_offsets;
  DType out_dtype = DType::f32;
  ReduceArgs op;
  // Slot-Reuse: vacated all-gather storage this rank may use as staging: [offset, offset +
  // bytes) of `reuse` (the same ranges on every rank). Pipeline slots that do not fit
  // (plan::assign_staging_slots) use the communicator's own staging.
  SymmetricBuffer* reuse = nullptr;
  std::span<const plan::Region> reuse_regions;
  // Across nodes (null: one host): the communicator is one node of the group `nodes`
  // describes, and the layout is the whole group's.
  const struct TwoLevel* nodes = nullptr;
  // Owns the gradients behind `grads`, or null. Set, TIDE-RS with one rank per node sends
  // contiguous gradient pieces to the other nodes straight from the gradients (no copy into
  // a node partial): the engine holds this past a failed exchange, as it holds the partials.
  std::shared_ptr<const void> grads_alive;
};

// A group of nodes as the two-level collectives see it from one rank: the nodes (the ranks of
// a node are consecutive, in order), this rank in the whole group, and the engine between
// the nodes (none on one node).
struct TwoLevel {
  plan::Topology topology;
  int rank = 0;
  Engine* engine = nullptr;
};

// What the last param_reduce_scatter did with its staging (for tests and TIDE_DEBUG).
struct StagingReport {
  size_t slot_bytes = 0;
  int num_slots = 0;
  int reused_slots = 0;       // placed in vacated all-gather storage
  size_t fallback_bytes = 0;  // in the communicator's own staging
  size_t partial_bytes = 0;   // across nodes: the node partials sent and received
  size_t direct_bytes = 0;    // across nodes: bytes sent straight from the gradients
};

// One send or receive of a group that progresses together (Comm::send_recv).
struct P2POp {
  bool send = true;
  void* buf = nullptr;  // read by a send, written by a receive
  size_t bytes = 0;
  int peer = -1;
  int tag = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // How param_all_gather moves shards ("direct", "doubling"; CommOptions::allgather_algorithm).
  virtual const char* param_all_gather_algorithm() const { return "direct"; }
  // How long a rank waiting on a peer of this communicator spins before it sleeps (the host
  // transport's host_spin); TIDE-AG's node peers wait on their progress words by it too.
  virtual std::chrono::microseconds wait_spin() const = 0;
  // The timeout of the collectives that begin from now on; set_timeout (any thread) changes
  // it for the collectives that begin after it (the group's setTimeout).
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  // From any thread: the collective in progress and every later one raise TimeoutError with
  // `why` on this rank, and peers waiting on it fail fast (the group's ProcessGroup.abort).
  virtual void abort(const std::string& why) = 0;

  // outs[r] receives rank r's `count` elements of `in`. outs.size() == world_size.
  virtual void all_gather(const void* in, std::span<void* const> outs, size_t count, DType dtype) = 0;

  // out = reduction over ranks r of ins_r[rank], `count` elements; ins.size() == world_size
  // (this rank's inputs, one per destination rank). in_dtype may be bf16/f16 with
  // out_dtype f32 (mixed-precision reduce-scatter); otherwise the two are equal.
  // Accumulation is in fp32 for bf16/f16 and in rank order 0..world_size-1, so results are
  // bitwise identical on every rank and run to run.
  virtual void reduce_scatter(std::span<const void* const> ins, void* out, size_t count,
                              DType in_dtype, DType out_dtype, ReduceArgs op) = 0;

  virtual void all_reduce(void* inout, size_t count, DType dtype, ReduceArgs op) = 0;
  // Only root's `inout` receives the result; others' buffers are left unchanged.
  virtual void reduce(void* inout, size_t count, DType dtype, ReduceArgs op, int root) = 0;
  virtual void broadcast(void* buf, size_t bytes, int root) = 0;
  // On root, outs.size() == world_size; elsewhere outs is empty.
  virtual void gather(const void* in, std::span<void* const> outs, size_t bytes, int root) = 0;
  // On root, ins.size() == world_size; elsewhere ins is empty.
  virtual void scatter(std::span<const void* const> ins, void* out, size_t bytes, int root) = 0;
  // Byte counts and offsets, one per peer (MPI_Alltoallv, in bytes).
  virtual void all_to_all(const void* in, std::span<const size_t> send_bytes,
                          std::span<const size_t> send_offsets, void* out,
                          std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets) = 0;
  virtual void barrier() = 0;
  // Point to point: matched in call order per (sender, receiver) pair; tags must match.
  virtual void send(const void* buf, size_t bytes, int peer, int tag) = 0;
  virtual void recv(void* buf, size_t bytes, int peer, int tag) = 0;
  // Sends and receives that progress together, as NCCL's grouped ones (torch's
  // batch_isend_irecv); returns when all are done. A send blocks once the channel to its peer
  // is full, so ranks that each send to the next and then receive from the previous deadlock
  // with send() and recv() one at a time, not here. Per pair they match in order, as single ones.
  virtual void send_recv(std::span<const P2POp> ops) = 0;

  // ---- the FSDP2 zero-copy path -------------------------------------------------------
  // Collective: every rank passes the size of its own part.
  virtual std::shared_ptr<SymmetricBuffer> allocate_symmetric(size_t bytes) = 0;
  virtual void param_all_gather(const ParamAllGather& args) = 0;
  virtual StagingReport param_reduce_scatter(const ParamReduceScatter& args) = 0;
};

// Ranks of one host over POSIX shared memory. `ns` names the group (distinct per
// process group); all ranks rendezvous through `store`. Shared-memory names are unlinked
// as soon as every rank has mapped them, so nothing survives the processes.
std::unique_ptr<Comm> make_host_comm(Store& store, const std::string& ns, int rank, int world_size,
                                     CommOptions options = {});

}  // namespace tide
