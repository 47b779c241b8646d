// A tide._C without CUDA (no tide_cuda, or a CPU-only torch): CUDA tensors' parameter
// collectives refuse by name.
#include <c10/util/Exception.h>

#include "../ParamCollectives.hpp"

namespace tide::torch_backend {
namespace {

constexpr const char* kWhy = "tide was built without CUDA";

class NoCudaParams final : public ParamCollectives {
 public:
  explicit NoCudaParams(int rank) : rank_(rank) {}
  std::string why_not() const override { return kWhy; }
  bool on_worker() const override { return false; }
  std::shared_ptr<tide::SymmetricBuffer> allocate_symmetric(size_t, int device) override {
    TORCH_CHECK(false, "tide allocate_symmetric: rank ", rank_, ": cuda:", device, " requested, but ", kWhy);
  }
  c10::intrusive_ptr<c10d::Work> all_gather(tide::ParamAllGather&, const std::vector<at::Tensor>&) override {
    TORCH_CHECK(false, "tide param_all_gather: rank ", rank_, ": CUDA tensors, but ", kWhy);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(tide::ParamReduceScatter&, const at::Tensor&,
                                                tide::StagingReport&) override {
    TORCH_CHECK(false, "tide param_reduce_scatter: rank ", rank_, ": CUDA tensors, but ", kWhy);
  }
  std::string all_gather_algorithm() const override { return "none"; }
  std::string inter_node_engine() override { return ""; }
  int64_t inter_node_bytes_sent() const override { return 0; }
  std::pair<std::string, std::string> path_choice(int) override { return {"nccl", kWhy}; }
  std::pair<size_t, int> staging_geometry(int device) override {
    TORCH_CHECK(false, "tide cuda_staging_geometry: rank ", rank_, ": ", kWhy, " (cuda:", device, ")");
  }
  void set_timeout(std::chrono::milliseconds) override {}
  void abort(const std::string&) override {}

 private:
  int rank_;
};

}  // namespace

std::unique_ptr<ParamCollectives> make_cuda_params(CudaParamsArgs args) {
  return std::make_unique<NoCudaParams>(args.rank);
}

}  // namespace tide::torch_backend
