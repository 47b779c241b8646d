// The CUDA side of ProcessGroupTide's FSDP2 path: TIDE-AG and TIDE-RS on CUDA tensors, over
// a tide::cuda::CudaGroup (src/transport/cuda) created on the device of the first CUDA call.
// Built only when tide_cuda is (TIDE_WITH_CUDA); the standard ops on CUDA tensors do not come
// here, they go to torch's NCCL backend.
//
// Streams follow ProcessGroupNCCL's conventions: a collective is ordered after the work
// already enqueued on the caller's current stream, and that stream waits for it, so the host
// never waits for the GPU on the hot path. Work.wait() makes the then-current stream wait for
// the collective's completion event (a no-op on the issuing stream), and raises once the group
// has failed.
//
// Checks: before anything is enqueued, every rank contributes a fingerprint of its call
// (collective, sequence number, planner layout, dtypes, element counts) through the host
// communicator, so a mismatch raises on every rank, naming both calls, instead of leaving
// streams waiting on each other; a peer that never makes the call raises TimeoutError there.
// That is one meeting of the ranks' CPUs per collective (not of the GPUs), like torch's
// TORCH_DISTRIBUTED_DEBUG=DETAIL collective checks; TIDE_CUDA_CHECK_ARGS=0 skips it (the
// watchdog still turns a mismatch into an error, after the timeout).
//
// Watchdog: a thread polls each collective's completion event. One not complete within the
// group's timeout (a peer died or hung after the check) aborts the group: this rank's streams
// are released (tide::cuda::CudaGroup::abort), its poison word tells the peers, whose
// watchdogs abort too, the reason goes to stderr, and every later call and every Work.wait()
// raises DistBackendError naming the collective, the rank and every rank's flags. A
// collective that fails while being enqueued aborts the group the same way.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "NcclEngine.hpp"
#include "NcclOneSided.hpp"
#include "tide/comm.hpp"
#include "tide/plan.hpp"
#include "tide/store.hpp"

namespace tide::cuda {
class CudaGroup;
}

namespace tide::torch_backend {

class CudaPath {
 public:
  // All ranks' fingerprints, in rank order, given this rank's (a host all-gather).
  using AllGatherBytes = std::function<std::vector<std::vector<uint8_t>>(const std::vector<uint8_t>&)>;

  // A group over several nodes also passes its topology and its NCCL delegate: the CUDA
  // group is then this rank's node (its ranks map each other's memory) and the inter-node
  // rounds go over NCCL (NcclEngine).
  struct Nodes {
    tide::plan::Topology topology;
    c10::intrusive_ptr<c10d::Backend> nccl;
  };
  CudaPath(std::shared_ptr<tide::Store> store, std::string ns, int rank, int world_size,
           std::function<std::chrono::milliseconds()> timeout, AllGatherBytes all_gather_bytes,
           std::optional<Nodes> nodes = std::nullopt);
  ~CudaPath();
  CudaPath(const CudaPath&) = delete;
  CudaPath& operator=(const CudaPath&) = delete;

  // Collective at the first call (creates the group): the node's all-gather path for
  // `device` ("copy engines", or "nccl": no peer access) and why.
  std::pair<std::string, std::string> path_choice(int device);
  // (slot bytes, slots) of the group's TIDE-RS staging.
  std::pair<size_t, int> staging_geometry(int device);
  // Collective: CUDA symmetric memory (every rank's part mapped by every rank) on `device`.
  std::shared_ptr<tide::SymmetricBuffer> allocate_symmetric(size_t bytes, int device);
  // `outputs` are the tensors the collective writes (the Work's result). Both run on the
  // caller's current stream of `device`.
  c10::intrusive_ptr<c10d::Work> param_all_gather(const tide::ParamAllGather& args,
                                                  std::vector<at::Tensor> outputs, int device);
  // TIDE-AG across nodes: the storages lie in `home` (node-symmetric CUDA memory, the
  // Slot-Reuse pool) at `storage_offsets`, the same on every rank; with one-sided puts,
  // `home` is a window (registered at its first use, collectively).
  c10::intrusive_ptr<c10d::Work> param_all_gather_across_nodes(const tide::ParamAllGather& args,
                                                               const std::shared_ptr<tide::SymmetricBuffer>& home,
                                                               const std::vector<size_t>& storage_offsets,
                                                               std::vector<at::Tensor> outputs, int device);
  // What moves TIDE-AG's bytes between nodes on CUDA (for TIDE_DEBUG and tide.fsdp's log
  // lines): "nccl one-sided ..." or "nccl send-recv ..." with the reason; TIDE-RS's
  // partials always go by send-recv.
  std::string engine_description() const;
  int64_t inter_node_bytes_sent() const;
  c10::intrusive_ptr<c10d::Work> param_reduce_scatter(const tide::ParamReduceScatter& args,
                                                      std::vector<at::Tensor> outputs, int device,
                                                      tide::StagingReport* report);

  // Shared with the Works and the watchdog: the first failure, if any.
  struct Health {
    std::mutex mutex;
    std::string error;  // empty while healthy
    std::string get() {
      std::lock_guard<std::mutex> lock(mutex);
      return error;
    }
  };

 private:
  tide::cuda::CudaGroup& group(int device, const char* collective);
  // `extra`: a hash of the other arguments peers rely on (offsets, Slot-Reuse regions).
  // `required`: also with TIDE_CUDA_CHECK_ARGS=0 (where a mismatch would corrupt memory).
  void check_across_ranks(const char* collective, const tide::plan::GroupLayout& layout,
                          tide::DType from, tide::DType to, int op, uint64_t extra, bool required = false);
  // Runs the enqueueing of a collective; if it throws, aborts the group and rethrows.
  void guarded(const char* collective, const std::function<void()>& enqueue);
  void set_failed(const std::string& why);
  c10::intrusive_ptr<c10d::Work> finish(const char* collective, c10d::OpType type,
                                        std::vector<at::Tensor> outputs, int device);
  void watchdog_loop();
  // At the node group's creation: one-sided puts where every rank can make them.
  void choose_one_sided(int device);
  void one_sided_handshake();
  // The engine of a TIDE-AG over `home`: one-sided once every rank has it as a window.
  tide::Engine& all_gather_engine(const std::shared_ptr<tide::SymmetricBuffer>& home);

  std::shared_ptr<tide::Store> store_;
  std::string ns_;
  int rank_, ws_;
  std::function<std::chrono::milliseconds()> timeout_;  // the group's, as setTimeout leaves it
  AllGatherBytes all_gather_bytes_;
  std::optional<Nodes> nodes_;
  std::unique_ptr<NcclEngine> engine_;          // across nodes, on the group's device: send / recv
  std::unique_ptr<NcclOneSided> wire_;          // and one-sided puts, where every rank's NCCL has them
  std::unique_ptr<tide::OneSidedEngine> puts_;  // TIDE-AG over wire_ (the rest over engine_)
  std::string one_sided_why_;                   // why not, when not
  tide::NodeScheduleCache schedules_;
  std::unique_ptr<tide::cuda::CudaGroup> group_;
  std::shared_ptr<Health> health_ = std::make_shared<Health>();
  uint64_t seq_ = 0;

  struct Pending {
    std::shared_ptr<void> event;  // a cudaEvent_t, destroyed with its last owner
    std::chrono::steady_clock::time_point deadline;
    std::chrono::milliseconds timeout;  // what the deadline was set by
    std::string what;
  };
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace tide::torch_backend
