// The CUDA node-local layer: one CudaGroup per process group and process (one rank per
// process; several processes may share one GPU). It owns two non-blocking streams (copy:
// copy-engine transfers, compute: short-lived CTAs), a control block of flags, and the
// TIDE-RS staging slots in symmetric device memory. The collectives run on it directly
// (TIDE-AG: src/collectives/cuda/param_all_gather.cpp; TIDE-RS and TIDE-AG across nodes:
// the shared executors over its node interfaces, src/transport/cuda/rs_node.cpp and
// node_all_gather.cpp) rather than through tide::Transport, whose blocking host-memory
// copies and reductions do not fit stream-ordered device memory.
//
// Synchronisation between ranks: monotonic 32-bit counters ("at least" compared modulo
// 2^32) in a control block of HOST memory that every rank maps (a memfd passed over the
// FdChannel, registered with cudaHostRegister so streams can read and write it). Each rank
// has an inbox per flag and sender: a post writes the value into every peer's inbox, a wait
// reads only this rank's own inbox. Host memory keeps the host's view free of streams (a
// report or an abort never queues behind a stream stuck on a wait), and inboxes let an abort
// release this rank's own waits without touching any other rank's counters.
//   device mode (default): post = cuStreamWriteValue32 (with its memory barrier), wait =
//     cuStreamWaitValue32 GEQ: no host sync on the hot path; only the final event is
//     waited for, by the host (blocking) or by the torch adapter's watchdog.
//   host mode (TIDE_CUDA_SYNC=host, or automatically when stream memory operations fail or
//     the control block cannot be registered for streams):
//     post = synchronize the stream then store; wait = poll the inbox from the host with the
//     deadline. Slower, but every wait has a timeout.
// Both modes use the same words, so ranks in different modes interoperate.
//
// Failures: an expired deadline (or, in host mode, a peer's abort) throws tide::TimeoutError
// naming the collective, the rank and every rank's counters; the group is then unusable (every later call throws). abort() (a
// watchdog's) also marks this rank's poison word, which every peer checks (peers_failed()),
// so a failure on one rank becomes an error on every rank rather than wrong data. Device
// memory of a broken group is leaked at destruction (a stream may still use it).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "tide/comm.hpp"
#include "tide/engine.hpp"
#include "tide/cuda/probe.hpp"
#include "tide/cuda/symmetric.hpp"
#include "tide/store.hpp"

namespace tide::cuda {

enum class SyncMode { device, host };

// Whether this process still submits contiguous copies with cudaMemcpyBatchAsync (compiled in
// and not refused yet; after a refusal: one cudaMemcpyAsync per copy, logged).
bool batched_copies();

struct CudaGroupOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  size_t staging_bytes = 0;  // TIDE-RS staging per rank; 0: TIDE_CUDA_STAGING_BYTES or 32 MiB
  int num_slots = 2;         // pipeline depth (chunks in flight)
  int rs_ctas = 0;           // accumulate CTAs; 0: TIDE_RS_CTAS, else accumulate_ctas() (the device's SMs / 8)
  int sync = -1;             // -1: TIDE_CUDA_SYNC (device|host, default device); else SyncMode
  bool blocking = true;      // collectives return after the host saw them complete
  // The group is one node of a group over several: its symmetric memory must be registrable
  // by NCCL's one-sided puts between nodes (GPUDirect RDMA, fabric handles where offered).
  bool across_nodes = false;
};

class CudaGroup {
 public:
  // node_ag: TIDE-AG across nodes, the progress of each node rank through the inter-node steps.
  enum FlagId : uint32_t { kAgReady = 0, kAgDone, kRsReady, kRsDone, kNodeAg, kNumFlags };
  static constexpr size_t kFlagStride = 64;  // bytes between words (own cache line)

  // Collective. Sets `device` current in the calling thread.
  CudaGroup(std::shared_ptr<Store> store, std::string ns, int rank, int world_size, int device,
            CudaGroupOptions options = {});
  ~CudaGroup();
  CudaGroup(const CudaGroup&) = delete;
  CudaGroup& operator=(const CudaGroup&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return ws_; }
  int device() const { return device_; }
  const PathChoice& allgather_path() const { return ag_path_; }
  // The modes this group actually took, each of which falls back silently-but-logged where
  // the device refuses: "flags=device|host copies=batched|single memory=vmm|ipc" (copies:
  // whether cudaMemcpyBatchAsync has been refused in this process so far).
  std::string modes() const;

  // Collective: every rank passes the size of its own part.
  std::shared_ptr<CudaSymmetricBuffer> allocate_symmetric(size_t bytes);
  void barrier();  // over the store

  // ---- used by the collectives ------------------------------------------------------
  // `layout`, checked for a collective of this group: present, planned for this world size,
  // and the group's GPUs can map each other's memory (else tide::Error naming `collective`).
  const plan::GroupLayout& checked_layout(const plan::GroupLayout* layout, const char* collective) const;
  cudaStream_t copy_stream() const { return copy_; }
  cudaStream_t compute_stream() const { return compute_; }
  int rs_ctas() const { return rs_ctas_; }
  int num_slots() const { return num_slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t piece_bytes() const { return piece_bytes_; }  // slot_bytes / world_size, 256-aligned
  std::byte* slot(int rank, int index);
  // Ordering between this rank's own two streams (flags order ranks, events order streams):
  // recorded on the compute stream once slot `index` was read; on the copy stream after a
  // window's phase 1.
  cudaEvent_t slot_free_event(int index) const { return slot_free_[static_cast<size_t>(index)]; }
  cudaEvent_t phase1_event() const { return phase1_; }
  // Symmetric scratch of at least `bytes` on every rank (collective; same size everywhere).
  CudaSymmetricBuffer& scratch(size_t bytes);
  // This rank's own short-lived buffers (packing, node partials), stream-ordered
  // (cudaMallocFromPoolAsync / cudaFreeAsync): a pool of this group that keeps what it
  // grew to, where the device's default pool (release threshold 0) gives memory back at
  // every synchronization and maps it again at the next collective. Created at first use.
  cudaMemPool_t transient_pool();

  // Epochs count in 64 bits; a flag word holds the low 32 and compares cyclically (as
  // cuStreamWaitValue32's GEQ does), so nothing breaks at 2^32 collectives.
  uint64_t next(FlagId f) { return epoch_[f].fetch_add(1) + 1; }
  uint64_t current(FlagId f) const { return epoch_[f].load(); }
  void post(cudaStream_t stream, FlagId f, uint64_t value);
  void wait(cudaStream_t stream, int peer, FlagId f, uint64_t value);

  // Starts a collective: checks the group is usable, makes `work` streams wait for what the
  // caller enqueued on `caller` before the call.
  void begin(const char* collective, cudaStream_t caller, std::initializer_list<cudaStream_t> work);
  // Ends it: `caller` waits for the work streams; with CudaGroupOptions::blocking the host waits
  // too (deadline: CudaGroupOptions::timeout).
  void end(cudaStream_t caller, std::initializer_list<cudaStream_t> work);
  void fail(const std::string& why);  // marks the group unusable and throws TimeoutError
  // For the collectives that begin after it; from the thread that calls begin().
  void set_timeout(std::chrono::milliseconds timeout) { opt_.timeout = timeout; }

  // Any thread (a watchdog), never throws: marks the group unusable with `why` (prefixed
  // with the rank and every rank's counters), sets this rank's poison word and releases this
  // rank's streams from their waits by writing far-ahead values into its own inboxes (no
  // other rank's words are touched; no new wait is enqueued after it). The outputs of the
  // collectives in flight are then garbage. Call again to re-release (a late genuine post
  // from a peer may have lowered an inbox word).
  void abort(const std::string& why);
  bool broken() const { return broken_.load(); }
  std::string broken_why() const;
  // The first peer that aborted, or -1 (plain loads of the poison words: never blocks).
  int peer_failed() const;

 private:
  void host_wait_stream(cudaStream_t s, const char* what);
  // The inbox word of `receiver` for flag f from `sender`, and the poison word of `rank`.
  std::atomic<uint32_t>& inbox(int receiver, FlagId f, int sender) const;
  std::atomic<uint32_t>& poison(int rank) const;
  CUdeviceptr device_address(const std::atomic<uint32_t>& word) const;  // for stream memory ops
  std::string flags_report() const;
  void release_own_waits();
  std::chrono::steady_clock::time_point deadline() const;

  std::shared_ptr<Store> store_;
  std::string ns_;
  int rank_, ws_, device_;
  CudaGroupOptions opt_;
  SyncMode mode_ = SyncMode::device;
  Capabilities caps_;
  PathChoice ag_path_;
  cudaStream_t copy_ = nullptr, compute_ = nullptr;
  cudaEvent_t ev_in_ = nullptr, ev_out_[2] = {nullptr, nullptr}, phase1_ = nullptr;
  std::vector<cudaEvent_t> slot_free_;
  std::unique_ptr<FdChannel> fds_;
  bool vmm_ = false;  // symmetric memory from cuMemCreate (fds over fds_), else cudaMalloc + IPC
  std::byte* control_ = nullptr;      // host control block, mapped by every rank
  std::byte* control_dev_ = nullptr;  // the same memory as the device addresses it
  size_t control_bytes_ = 0;
  bool control_registered_ = false;
  std::shared_ptr<CudaSymmetricBuffer> staging_, scratch_;
  cudaMemPool_t transient_pool_ = nullptr;
  int num_slots_ = 2, rs_ctas_ = 8;
  size_t slot_bytes_ = 0, piece_bytes_ = 0;
  std::atomic<uint64_t> epoch_[kNumFlags] = {};  // read by abort() from another thread
  uint64_t alloc_seq_ = 0, barrier_seq_ = 0;
  const char* collective_ = "";
  std::chrono::steady_clock::time_point started_{};
  std::atomic<bool> broken_{false};
  std::shared_ptr<std::atomic<bool>> broken_shared_ = std::make_shared<std::atomic<bool>>(false);
  mutable std::mutex why_mutex_;  // broken_why_: set by fail() or abort(), read anywhere
  std::string broken_why_;
};

// TIDE-AG with copy engines: every rank's shard (args.shards must be a CudaSymmetricBuffer)
// is copied by cudaMemcpy(Batch/2D)Async from its owner's memory to the planner's
// placement in this rank's storages (device memory). Equal dtypes: no kernel at all.
// Different dtypes (f32/bf16/f16 pairs): copy engines cannot convert, so one small cast
// kernel first writes this rank's shard in the storage dtype into symmetric scratch; peers
// then copy those bytes. Stream-ordered after `stream`'s prior work; `stream` waits for the
// result.
void param_all_gather(CudaGroup& group, const ParamAllGather& args, cudaStream_t stream = nullptr);

// TIDE-AG of a group over several nodes, `group` being this rank's node: the two-level
// schedule of src/collectives/node_all_gather.cpp with the node peers' storages read over
// copy engines from the symmetric memory they lie in (storage p of every node rank at
// storage_offsets[p] of storage_home's part of that rank, indexed by local rank) and the
// inter-node rounds over the group's engine (nodes->engine), which must be ordered on
// group.copy_stream() (it starts
// after what was enqueued there before it, and what is enqueued after waits for it). Own
// shard: shards->local() at shard_offsets, cast on the GPU where the dtypes differ. Nothing
// waits on the host; `stream` waits for the end.
struct NodeAllGatherArgs {
  const TwoLevel* nodes = nullptr;  // the group, this rank in it, the engine
  SymmetricBuffer* storage_home = nullptr;
  std::span<const size_t> storage_offsets;
  size_t pace_bytes = 0;  // per rank and round, storage dtype; 0: TIDE_ALLGATHER_PACE_BYTES or 4 MiB
  NodeScheduleCache* schedules = nullptr;  // the plans, kept for the next calls
};
void param_all_gather_across_nodes(CudaGroup& group, const ParamAllGather& args, const NodeAllGatherArgs& nodes,
                                   cudaStream_t stream);

// TIDE-RS on CUDA (src/transport/cuda/rs_node.cpp: the executor of
// src/collectives/param_reduce_scatter.cpp over this group as its node): grads (device
// memory, private to each rank: no symmetric allocation) bf16/f16/f32 -> fp32 shards,
// ReduceOp sum / avg / premul_sum; phase 1 on the copy stream (copy engines into this rank's
// symmetric staging slot), phase 2 on the compute stream (launch_accumulate_f32, sources in
// rank order, few CTAs: TIDE_RS_CTAS). Other dtype / op combinations throw tide::Error.
StagingReport param_reduce_scatter(CudaGroup& group, const ParamReduceScatter& args,
                                   cudaStream_t stream = nullptr);
// The same over several nodes, `group` being this rank's node (`rank` in the whole group,
// args.layout the whole group's): fp32 node partials (one GPU per node: its gradient, in its
// dtype) in local rank order on the rank of the destination's rail, carried along the rail
// by `engine` (ordered on group.compute_stream()), added in node order (`nodes`: the group,
// this rank in it, the engine). Slot-Reuse memory is the node's.
StagingReport param_reduce_scatter_across_nodes(CudaGroup& group, const ParamReduceScatter& args,
                                                const TwoLevel& nodes, cudaStream_t stream = nullptr);

}  // namespace tide::cuda
