// The FSDP2 parameter collectives (TIDE-AG, TIDE-RS) of a tide group for tensors of one
// device kind, each implementation one (device, topology): chosen once, on CPU when the
// group is created (one node: its host communicator; several: the node's communicator and
// gloo between nodes, HostParams.cpp), on CUDA at the first CUDA call (cuda/CudaParams.cpp,
// or NoCudaParams.cpp in a build without CUDA). ProcessGroupTide checks the tensors and
// hands these the checked arguments.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "tide/comm.hpp"
#include "tide/host_transport.hpp"
#include "tide/plan.hpp"
#include "tide/store.hpp"

namespace tide::torch_backend {

// The group's timeout as it is now (ProcessGroupTide::setTimeout changes it), read where a
// collective starts its clock.
using Timeout = std::function<std::chrono::milliseconds()>;

class ParamCollectives {
 public:
  virtual ~ParamCollectives() = default;
  // "" where the collectives run on this group, else why not.
  virtual std::string why_not() const = 0;
  // Host collectives run on the group's worker thread, in issue order with its standard
  // ops (the group's Work completes there; these return null); CUDA's are enqueued at once,
  // stream-ordered, and return their own Work.
  virtual bool on_worker() const = 0;
  // Collective: memory every rank of the node maps, indexed by group rank.
  virtual std::shared_ptr<tide::SymmetricBuffer> allocate_symmetric(size_t bytes, int device) = 0;
  // `storages` / `out`: the tensors the collective writes.
  virtual c10::intrusive_ptr<c10d::Work> all_gather(tide::ParamAllGather& args,
                                                    const std::vector<at::Tensor>& storages) = 0;
  virtual c10::intrusive_ptr<c10d::Work> reduce_scatter(tide::ParamReduceScatter& args, const at::Tensor& out,
                                                        tide::StagingReport& report) = 0;
  // For TIDE_DEBUG, tide.fsdp's log lines and the tests.
  virtual std::string all_gather_algorithm() const = 0;
  virtual std::string inter_node_engine() = 0;  // "" on one node
  virtual int64_t inter_node_bytes_sent() const = 0;
  // CUDA: the node's all-gather path on `device` and why; (slot bytes, slots) of TIDE-RS's staging.
  virtual std::pair<std::string, std::string> path_choice(int device) = 0;
  virtual std::pair<size_t, int> staging_geometry(int device) = 0;
  // The group's setTimeout, for the communicators that keep a timeout of their own (any
  // thread); the rest read the group's Timeout.
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  // The group's abort, for the communicators the group does not hold itself (any thread).
  virtual void abort(const std::string& why) = 0;
};

// CPU tensors. One node: the group's host communicator. Several nodes (tide::GroupNodes:
// this rank's node communicator, or none where the nodes do not fit the topology): gloo
// between the nodes, the group's CPU delegate once set (`gloo` reads it).
std::unique_ptr<ParamCollectives> make_host_params(tide::Comm& comm);
std::unique_ptr<ParamCollectives> make_host_params_across_nodes(
    tide::GroupNodes nodes, int rank, Timeout timeout,
    std::function<c10::intrusive_ptr<c10d::Backend>()> gloo);

// CUDA tensors. `all_gather_bytes`: every rank's bytes, in rank order, given this rank's (a host
// all-gather through the group, for the cross-rank argument checks). Across nodes:
// `topology` and the group's NCCL delegate once set (`nccl` reads it: the engine between
// nodes).
struct CudaParamsArgs {
  std::shared_ptr<tide::Store> store;
  std::string ns;
  int rank = 0, world_size = 1;
  Timeout timeout;
  std::function<std::vector<std::vector<uint8_t>>(const std::vector<uint8_t>&)> all_gather_bytes;
  int num_nodes = 1;
  std::optional<tide::plan::Topology> topology;
  std::string topology_error;
  std::function<c10::intrusive_ptr<c10d::Backend>()> nccl;
};
std::unique_ptr<ParamCollectives> make_cuda_params(CudaParamsArgs args);

}  // namespace tide::torch_backend
