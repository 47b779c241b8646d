// A standard op that a tide group across nodes hands to its gloo delegate (CPU tensors):
// gloo's own Work, except that a failure (a dead or silent peer: gloo raises a bare
// RuntimeError, "Timed out waiting 3000ms for recv operation", "Connection closed by peer")
// reaches the caller as torch's DistBackendError naming the collective and the rank, from
// wait(), exception() and the future alike, as TIDE's own collectives fail.
#pragma once
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace tide::torch_backend {

class DelegatedWork final : public c10d::Work {
 public:
  // `what`: how the error begins ("tide allreduce: rank 3: ...").
  DelegatedWork(c10::intrusive_ptr<c10d::Work> inner, std::string what);
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override;
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::string what_;
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made at the first getFuture()
};

}  // namespace tide::torch_backend
