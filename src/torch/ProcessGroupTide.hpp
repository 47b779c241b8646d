// ProcessGroupTide: the c10d backend "tide". A thin adapter: it checks and maps torch
// tensors onto tide::Comm calls (include/tide/comm.hpp) and runs them, in issue order, on
// one worker thread so every op returns an async Work with a future, as gloo's do.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <optional>

#include "ParamCollectives.hpp"
#include "tide/comm.hpp"

namespace tide::torch_backend {

class WorkTide : public c10d::Work {
 public:
  WorkTide(c10d::OpType op, const char* profiling_title, std::vector<at::Tensor> outputs);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Called on the worker thread when the collective ends (eptr null on success).
  void complete(std::exception_ptr eptr);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ProcessGroupTide : public c10d::Backend {
 public:
  // job_rank: this rank in the whole job (what TIDE_LOCAL_WORLD_SIZE's pseudo-nodes split);
  // -1: `rank` (the default group).
  ProcessGroupTide(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout, const std::string& group_name, int job_rank = -1);
  ~ProcessGroupTide() override;

  const std::string getBackendName() const override { return "tide"; }
  // dist.set_timeout (torch >= 2.15; ProcessGroup.set_timeout forwards it to each backend):
  // the timeout of every collective issued after it, on every communicator of the group
  // (host, node, CUDA, the gloo and NCCL delegates). Ops already queued start their clock
  // when they run, with the timeout of that moment.
  void setTimeout(std::chrono::milliseconds timeout) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // A coalescing block (torch's batch_isend_irecv, _coalescing_manager with a device): the
  // host's sends and receives issued in it wait for endCoalescing and then progress together
  // (Comm::send_recv), so ranks that each send to the next and receive from the previous do
  // not deadlock; other ops run as they come. Across nodes gloo runs them as they come; CUDA
  // tensors' go to the NCCL delegate's own block. endCoalescing's Work: NCCL's where the block
  // had CUDA tensors, else done when the worker has run what it had before it, the host's
  // sends and receives, and waited for gloo's.
  bool supportsCoalescing() const override { return true; }
  // ProcessGroup.abort (torch's _abort_process_group): the host collective in progress and
  // every later one raise DistBackendError here, peers waiting on this rank fail fast, and the
  // gloo / NCCL delegates abort. The CUDA path's own collectives are not reached (status.md).
  void abort() override;
  // The collectives issued on the group so far (sends and receives not counted, as NCCL's
  // collective sequence): what TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper compares across ranks
  // before each collective. It starts at 0 on every rank; setting it is a no-op, as in torch 2.15.
  void setSequenceNumberForGroup() override {}
  // dist.split_group (torch 2.15's ProcessGroup.split_group): this rank's part of `ranks` (this
  // group's ranks), a new tide group made as init_process_group makes one
  // (python/tide/_backend.py's create, its delegates included); null where this rank is not in it.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  uint64_t getSequenceNumberForGroup() override { return collective_seq_.load(); }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Standard ops on CUDA tensors go to this NCCL backend (python/tide/_backend.py creates
  // it where CUDA and NCCL exist), so a tide group is a complete CUDA backend.
  void set_cuda_delegate(c10::intrusive_ptr<c10d::Backend> nccl) { cuda_ = std::move(nccl); }
  // A group over several nodes (hosts, or TIDE_LOCAL_WORLD_SIZE pseudo-nodes) has no host
  // transport: its standard ops on CPU tensors go to this gloo backend (python/tide/_backend.py).
  int num_nodes() const { return num_nodes_; }
  void set_cpu_delegate(c10::intrusive_ptr<c10d::Backend> gloo);
  // Whether the parameter collectives run on this group for tensors on `device` (-1: CPU):
  // across nodes, equal nodes of consecutive ranks and an engine (gloo on CPUs; on CUDA the
  // NCCL delegate and a tide built with CUDA); "" when they do, else why not.
  std::string why_not_across_nodes(int device = -1);
  // The engine between nodes for `device`, in words ("gloo", "nccl send-recv", ...).
  std::string inter_node_engine(int device = -1);
  int64_t inter_node_bytes_sent() const;

  // ---- the FSDP2 zero-copy path (python/tide/fsdp/) ------------------------------------
  // Each call runs on the ParamCollectives of its tensors' device (ParamCollectives.hpp):
  // CUDA's stream-ordered on the current stream, the host's on the worker thread.
  // Collective, blocking: symmetric memory for the group's sharded parameters, host shared
  // memory (device -1) or CUDA device memory every rank maps (device >= 0).
  std::shared_ptr<tide::SymmetricBuffer> allocate_symmetric(size_t bytes, int device = -1);
  // TIDE-AG: every rank's shards (in `shards`, at shard_offsets bytes) land at the planner's
  // addresses in this rank's per-parameter unsharded storages, cast where read.
  c10::intrusive_ptr<c10d::Work> param_all_gather(const tide::plan::GroupLayout& layout,
                                                  std::shared_ptr<tide::SymmetricBuffer> shards,
                                                  std::vector<size_t> shard_offsets,
                                                  at::ScalarType shard_dtype,
                                                  std::vector<at::Tensor> storages);
  // TIDE-RS: per-parameter unsharded gradients reduced into the flat sharded output `out`
  // (param p at out_offsets[p] elements), two-phase, fp32 accumulation in rank order.
  // Slot-Reuse: staging may go into `reuse_regions` (offset, bytes) of `reuse`.
  c10::intrusive_ptr<c10d::Work> param_reduce_scatter(const tide::plan::GroupLayout& layout,
                                                      std::vector<at::Tensor> grads, at::Tensor out,
                                                      std::vector<int64_t> out_offsets,
                                                      const c10d::ReduceOp& op,
                                                      std::shared_ptr<tide::SymmetricBuffer> reuse,
                                                      std::vector<std::pair<int64_t, int64_t>> reuse_regions);
  // The same two calls as c10d collectives, so that CommDebugMode, the profiler and any
  // TorchDispatchMode see FSDP2's collectives under the names the built-in backends give
  // them: defer_*() checks the arguments and keeps the call for this thread; this thread's
  // next _allgather_base / _reduce_scatter_base with zero-element tensors (what
  // dist.all_gather_into_tensor / reduce_scatter_tensor dispatch as c10d::_allgather_base_ /
  // c10d::_reduce_scatter_base_) runs it and returns its Work. drop_deferred() drops a kept call.
  void defer_param_all_gather(const tide::plan::GroupLayout& layout, std::shared_ptr<tide::SymmetricBuffer> shards,
                              std::vector<size_t> shard_offsets, at::ScalarType shard_dtype,
                              std::vector<at::Tensor> storages);
  void defer_param_reduce_scatter(const tide::plan::GroupLayout& layout, std::vector<at::Tensor> grads,
                                  at::Tensor out, std::vector<int64_t> out_offsets, const c10d::ReduceOp& op,
                                  std::shared_ptr<tide::SymmetricBuffer> reuse,
                                  std::vector<std::pair<int64_t, int64_t>> reuse_regions);
  void drop_deferred();
  tide::StagingReport last_staging_report() const { return last_staging_; }
  std::string host_allgather_algorithm() const;
  // The CUDA all-gather path of this node for `device` and why ("nccl": the GPUs cannot map
  // each other's memory, so FSDP2 keeps its stock path). Collective at the first CUDA call.
  std::pair<std::string, std::string> cuda_path_choice(int device);
  // TIDE-RS staging on CUDA: (slot bytes, slots), for Slot-Reuse regions that fit them.
  std::pair<size_t, int> cuda_staging_geometry(int device);

 private:
  using Launch = std::function<c10::intrusive_ptr<c10d::Work>()>;
  // The checked call of param_all_gather / param_reduce_scatter, not yet run.
  Launch make_param_all_gather(const tide::plan::GroupLayout& layout, std::shared_ptr<tide::SymmetricBuffer> shards,
                               std::vector<size_t> shard_offsets, at::ScalarType shard_dtype,
                               std::vector<at::Tensor> storages);
  Launch make_param_reduce_scatter(const tide::plan::GroupLayout& layout, std::vector<at::Tensor> grads,
                                   at::Tensor out, std::vector<int64_t> out_offsets, const c10d::ReduceOp& op,
                                   std::shared_ptr<tide::SymmetricBuffer> reuse,
                                   std::vector<std::pair<int64_t, int64_t>> reuse_regions);
  // The call this thread deferred for `op`, run, when the tensors are the zero-element tokens.
  c10::intrusive_ptr<c10d::Work> run_deferred(c10d::OpType op, const at::Tensor& output, const at::Tensor& input);
  std::mutex deferred_mutex_;
  std::map<std::thread::id, std::pair<c10d::OpType, Launch>> deferred_;

  // The parameter collectives for tensors on `device` (-1: CPU; CUDA's made at the first call).
  ParamCollectives& params(int device);

  // Queues `fn` on the worker thread; the Work completes when it returns or throws.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType op, const char* name,
                                         std::vector<at::Tensor> outputs,
                                         std::function<void()> fn);
  void worker_loop();
  // The backend that runs a standard op on `tensors` instead of the host transport: NCCL
  // for CUDA tensors, gloo on a group of several nodes; null: the host transport runs it.
  c10::intrusive_ptr<c10d::Backend> delegate(const std::vector<at::Tensor>& tensors, const char* op) const;
  // The delegate's Work for `op`: gloo's with its failures as DistBackendError (DelegatedWork.hpp);
  // NCCL's as it is (NCCL raises DistBackendError itself).
  c10::intrusive_ptr<c10d::Work> delegated(const char* op, const c10::intrusive_ptr<c10d::Backend>& d,
                                           c10::intrusive_ptr<c10d::Work> work) const;
  // In a coalescing block: keeps a host send / receive for endCoalescing (`finish` runs after
  // it: a receive's copy into a non-contiguous tensor), or gloo's Work (any time: returned as is).
  c10::intrusive_ptr<c10d::Work> coalesce(c10d::OpType type, const char* name, const tide::P2POp& op,
                                          std::vector<at::Tensor> tensors, std::function<void()> finish);
  c10::intrusive_ptr<c10d::Work> coalesce(const c10::intrusive_ptr<c10d::Backend>& d,
                                          c10::intrusive_ptr<c10d::Work> delegated);
  std::function<void()> prepare_reduce_scatter_tensor(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts,
                                                      const char* name);

  // The host communicator of a one-node group: the standard ops on CPU tensors (null when
  // the group spans several nodes: gloo runs them).
  std::unique_ptr<tide::Comm> comm_;
  int num_nodes_ = 0;
  std::optional<tide::plan::Topology> topology_;  // several nodes that fit
  std::string topology_error_;
  std::unique_ptr<ParamCollectives> cpu_params_;   // chosen at creation
  mutable std::mutex cuda_params_mutex_;
  std::unique_ptr<ParamCollectives> cuda_params_;  // made at the first CUDA call
  c10::intrusive_ptr<c10d::Backend> cuda_;
  c10::intrusive_ptr<c10d::Backend> cpu_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string group_name_;
  int job_rank_;  // this process's rank in the job, whatever the group
  std::atomic<std::chrono::milliseconds> timeout_;  // setTimeout, from any thread
  tide::StagingReport last_staging_;
  std::mutex mutex_;
  std::condition_variable cv_;
  using Queued = std::pair<c10::intrusive_ptr<WorkTide>, std::function<void()>>;
  std::deque<Queued> queue_;
  // Works the worker finished, released by the next enqueue() or the destructor: never on the
  // worker, where freeing a tensor's Python object takes the GIL, and taking it while the
  // interpreter finalizes ends the thread through a noexcept frame (std::terminate).
  std::vector<Queued> finished_;
  bool stop_ = false;
  std::thread worker_;
  // The coalescing block (the caller's thread only, as torch issues it).
  struct CoalescedP2P {
    tide::P2POp op;
    std::function<void()> finish;
    c10::intrusive_ptr<WorkTide> work;  // what the send / receive call returned
  };
  bool coalescing_ = false;
  bool queued_in_block_ = false;  // an op went to the worker during the block
  std::atomic<uint64_t> collective_seq_{0};
  std::vector<CoalescedP2P> coalesced_p2p_;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_gloo_;
};

}  // namespace tide::torch_backend
