// The inter-node engine on GPUs: the NCCL that torch loaded, through the group's NCCL
// delegate (a ProcessGroupNCCL on the same store). Each exchange is one NCCL group of
// ncclSend / ncclRecv (torch's coalescing, as batch_isend_irecv), straight from and into
// the callers' device byte ranges, ordered on the stream bound with bind(): NCCL starts
// after the work enqueued there, and finish() makes that stream wait for NCCL, so the host
// never waits. Where every rank's NCCL has one-sided puts, TIDE-AG's contiguous blocks go
// through NcclOneSided instead (tide::OneSidedEngine over this engine for the rest).
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

#include <cuda_runtime_api.h>

#include "tide/engine.hpp"

namespace tide::torch_backend {

class NcclEngine final : public tide::Engine {
 public:
  NcclEngine(c10::intrusive_ptr<c10d::Backend> nccl, int device) : nccl_(std::move(nccl)), device_(device) {}
  const char* name() const override { return "nccl send-recv"; }
  void bind(cudaStream_t stream) { stream_ = stream; }
  void start(std::span<const tide::EngineSend> sends, std::span<const tide::EngineRecv> recvs,
             std::shared_ptr<const void> keep_alive) override;
  void finish() override;
  void abandon() override;
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  struct Exchange {
    c10::intrusive_ptr<c10d::Work> work;  // null: nothing to move
    std::shared_ptr<const void> keep_alive;
    std::string peers;  // for the error: "2, 6"
  };
  c10::intrusive_ptr<c10d::Backend> nccl_;
  int device_;
  cudaStream_t stream_ = nullptr;
  tide::InFlight<Exchange> exchanges_;
  int64_t bytes_sent_ = 0;
};

}  // namespace tide::torch_backend
