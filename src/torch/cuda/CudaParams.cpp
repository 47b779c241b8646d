// The parameter collectives on CUDA tensors (../ParamCollectives.hpp) over CudaPath, created
// at the first CUDA call: on one node the node's CudaGroup; across nodes the node's
// CudaGroup with NCCL between the nodes, the storages and Slot-Reuse memory in
// node-symmetric CUDA memory (tide::NodeSymmetric).
#include "../ParamCollectives.hpp"
#include "CudaPath.hpp"
#include "tide/node_memory.hpp"

namespace tide::torch_backend {
namespace {

class CudaParams final : public ParamCollectives {
 public:
  explicit CudaParams(CudaParamsArgs args) : a_(std::move(args)) {}
  std::string why_not() const override {
    if (a_.num_nodes == 1) return "";
    if (!a_.topology) return "its nodes are not equal blocks of consecutive ranks (" + a_.topology_error + ")";
    if (!a_.nccl()) return "no inter-node engine (NCCL) was set for CUDA tensors";
    return "";
  }
  bool on_worker() const override { return false; }
  std::shared_ptr<tide::SymmetricBuffer> allocate_symmetric(size_t bytes, int device) override {
    if (!a_.topology) return path().allocate_symmetric(bytes, device);
    return homes_.add(std::make_shared<tide::NodeSymmetric>(path().allocate_symmetric(bytes, device), *a_.topology,
                                                            a_.rank));
  }
  c10::intrusive_ptr<c10d::Work> all_gather(tide::ParamAllGather& args,
                                            const std::vector<at::Tensor>& storages) override {
    const int device = args.shards->device();
    if (!a_.topology) return path().param_all_gather(args, storages, device);
    std::vector<std::pair<const void*, size_t>> ranges;
    for (const at::Tensor& t : storages) ranges.emplace_back(t.data_ptr(), t.nbytes());
    auto [home, offsets] = homes_.find(ranges);
    TORCH_CHECK(home, "tide param_all_gather: rank ", a_.rank, ": across nodes, the unsharded storages must lie in "
                "memory from this group's allocate_symmetric (node peers read them)");
    return path().param_all_gather_across_nodes(args, home, offsets, storages, device);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(tide::ParamReduceScatter& args, const at::Tensor& out,
                                                tide::StagingReport& report) override {
    if (a_.topology && args.reuse) {  // the node's group indexes Slot-Reuse memory by local rank
      auto* node_reuse = dynamic_cast<tide::NodeSymmetric*>(args.reuse);
      TORCH_CHECK(node_reuse, "tide param_reduce_scatter: rank ", a_.rank,
                  ": across nodes, Slot-Reuse memory must come from this group's allocate_symmetric");
      args.reuse = node_reuse->node_memory().get();
    }
    return path().param_reduce_scatter(args, {out}, out.device().index(), &report);
  }
  std::string all_gather_algorithm() const override { return a_.topology ? "two-level" : "copy engines"; }
  std::string inter_node_engine() override { return path().engine_description(); }
  int64_t inter_node_bytes_sent() const override { return path_ ? path_->inter_node_bytes_sent() : 0; }
  std::pair<std::string, std::string> path_choice(int device) override { return path().path_choice(device); }
  std::pair<size_t, int> staging_geometry(int device) override { return path().staging_geometry(device); }
  void set_timeout(std::chrono::milliseconds) override {}  // the path reads the group's Timeout
  // Not yet: the CUDA path's groups end only by their watchdog's timeout (docs/status.md).
  void abort(const std::string&) override {}

 private:
  CudaPath& path() {
    if (!path_) {
      std::optional<CudaPath::Nodes> nodes;
      if (a_.num_nodes > 1) {
        const std::string why = why_not();
        TORCH_CHECK(why.empty(), "tide FSDP2 on CUDA: rank ", a_.rank, ": this group spans ", a_.num_nodes,
                    " nodes and ", why);
        nodes = CudaPath::Nodes{*a_.topology, a_.nccl()};
      }
      path_ = std::make_unique<CudaPath>(a_.store, a_.ns, a_.rank, a_.world_size, a_.timeout, a_.all_gather_bytes,
                                         std::move(nodes));
    }
    return *path_;
  }
  CudaParamsArgs a_;
  std::unique_ptr<CudaPath> path_;
  tide::NodeHomes homes_;
};

}  // namespace

std::unique_ptr<ParamCollectives> make_cuda_params(CudaParamsArgs args) {
  return std::make_unique<CudaParams>(std::move(args));
}

}  // namespace tide::torch_backend
