// The parameter collectives on CPU tensors (ParamCollectives.hpp): on one node the group's
// host communicator runs them; across nodes the node's communicator runs TIDE-RS with gloo
// between the nodes, and TIDE-AG's two-level schedule runs over the node's peers (their
// storages in node-symmetric memory) and gloo.
#include <ATen/ATen.h>

#include <mutex>

#include "GlooEngine.hpp"
#include "ParamCollectives.hpp"
#include "tide/engine.hpp"
#include "tide/node_memory.hpp"

namespace tide::torch_backend {
namespace {

class HostParams : public ParamCollectives {
 public:
  explicit HostParams(tide::Comm& comm) : comm_(comm) {}
  std::string why_not() const override { return ""; }
  bool on_worker() const override { return true; }
  std::shared_ptr<tide::SymmetricBuffer> allocate_symmetric(size_t bytes, int) override {
    return comm_.allocate_symmetric(bytes);
  }
  c10::intrusive_ptr<c10d::Work> all_gather(tide::ParamAllGather& args, const std::vector<at::Tensor>&) override {
    comm_.param_all_gather(args);
    return {};
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(tide::ParamReduceScatter& args, const at::Tensor&,
                                                tide::StagingReport& report) override {
    report = comm_.param_reduce_scatter(args);
    return {};
  }
  std::string all_gather_algorithm() const override { return comm_.param_all_gather_algorithm(); }
  std::string inter_node_engine() override { return ""; }
  int64_t inter_node_bytes_sent() const override { return 0; }
  std::pair<std::string, std::string> path_choice(int) override { return {"host", "CPU tensors"}; }
  std::pair<size_t, int> staging_geometry(int) override {
    TORCH_CHECK(false, "tide cuda_staging_geometry: CPU tensors stage in the host communicator");
  }
  // The group's own communicator: the group sets its timeout and aborts it.
  void set_timeout(std::chrono::milliseconds) override {}
  void abort(const std::string&) override {}

 private:
  tide::Comm& comm_;
};

class HostParamsAcrossNodes final : public ParamCollectives {
 public:
  HostParamsAcrossNodes(tide::GroupNodes nodes, int rank, Timeout timeout,
                        std::function<c10::intrusive_ptr<c10d::Backend>()> gloo)
      : nodes_(std::move(nodes)), rank_(rank), timeout_(timeout), gloo_(std::move(gloo)) {}
  std::string why_not() const override {
    if (!nodes_.topology) return "its nodes are not equal blocks of consecutive ranks (" + nodes_.topology_error + ")";
    if (!engine()) return "no inter-node engine (gloo) was set";
    return "";
  }
  bool on_worker() const override { return true; }
  std::shared_ptr<tide::SymmetricBuffer> allocate_symmetric(size_t bytes, int) override {
    return homes_.add(std::make_shared<tide::NodeSymmetric>(nodes_.node_comm->allocate_symmetric(bytes),
                                                            *nodes_.topology, rank_));
  }
  c10::intrusive_ptr<c10d::Work> all_gather(tide::ParamAllGather& args,
                                            const std::vector<at::Tensor>& storages) override {
    // Node peers read each other's storages: they lie in node-symmetric memory.
    std::vector<std::pair<const void*, size_t>> ranges;
    for (const at::Tensor& t : storages) ranges.emplace_back(t.data_ptr(), t.nbytes());
    auto [home, offsets] = homes_.find(ranges);
    TORCH_CHECK(home, "tide param_all_gather: rank ", rank_, ": across nodes, the unsharded storages must lie in "
                "memory from this group's allocate_symmetric (node peers read them)");
    two_level().param_all_gather(args, *home, std::move(offsets));
    return {};
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(tide::ParamReduceScatter& args, const at::Tensor&,
                                                tide::StagingReport& report) override {
    if (args.reuse) {  // the node's collectives index Slot-Reuse memory by local rank
      auto* node_reuse = dynamic_cast<tide::NodeSymmetric*>(args.reuse);
      TORCH_CHECK(node_reuse, "tide param_reduce_scatter: rank ", rank_,
                  ": across nodes, Slot-Reuse memory must come from this group's allocate_symmetric");
      args.reuse = node_reuse->node_memory().get();
    }
    report = two_level().param_reduce_scatter(args);
    return {};
  }
  std::string all_gather_algorithm() const override { return "two-level"; }
  std::string inter_node_engine() override { return engine() ? engine()->name() : ""; }
  int64_t inter_node_bytes_sent() const override { return engine_ ? engine_->bytes_sent() : 0; }
  std::pair<std::string, std::string> path_choice(int) override { return {"host", "CPU tensors"}; }
  std::pair<size_t, int> staging_geometry(int) override {
    TORCH_CHECK(false, "tide cuda_staging_geometry: CPU tensors stage in the node's host communicator");
  }
  // The node's communicator (TIDE-RS, TIDE-AG's node peers); gloo's exchanges read the group's.
  void set_timeout(std::chrono::milliseconds timeout) override {
    if (nodes_.node_comm) nodes_.node_comm->set_timeout(timeout);
  }
  void abort(const std::string& why) override {  // gloo's exchanges: the group aborts its delegate
    if (nodes_.node_comm) nodes_.node_comm->abort(why);
  }

 private:
  // gloo between the nodes, from the group's CPU delegate (set after the group's creation).
  GlooEngine* engine() const {
    std::lock_guard<std::mutex> lock(engine_mutex_);  // asked from the caller's thread and the worker
    if (!engine_)
      if (auto gloo = gloo_()) engine_ = std::make_unique<GlooEngine>(std::move(gloo), timeout_);
    return engine_.get();
  }
  // Both collectives' communicator, made at the first (collective) call, once gloo is set.
  tide::TwoLevelComm& two_level() {
    if (!two_level_)
      two_level_ = std::make_unique<tide::TwoLevelComm>(*nodes_.node_comm,
                                                        tide::TwoLevel{*nodes_.topology, rank_, engine()});
    return *two_level_;
  }
  tide::GroupNodes nodes_;
  int rank_;
  Timeout timeout_;
  std::function<c10::intrusive_ptr<c10d::Backend>()> gloo_;
  mutable std::mutex engine_mutex_;
  mutable std::unique_ptr<GlooEngine> engine_;
  std::unique_ptr<tide::TwoLevelComm> two_level_;
  tide::NodeHomes homes_;  // allocate_symmetric's buffers
};

}  // namespace

std::unique_ptr<ParamCollectives> make_host_params(tide::Comm& comm) { return std::make_unique<HostParams>(comm); }

std::unique_ptr<ParamCollectives> make_host_params_across_nodes(
    tide::GroupNodes nodes, int rank, Timeout timeout,
    std::function<c10::intrusive_ptr<c10d::Backend>()> gloo) {
  return std::make_unique<HostParamsAcrossNodes>(std::move(nodes), rank, timeout, std::move(gloo));
}

}  // namespace tide::torch_backend
