// The inter-node engine on CPUs: torch's own gloo backend (the group's CPU delegate across
// nodes). Sends and receives go straight from and into the caller's byte ranges.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <vector>

#include "tide/engine.hpp"

namespace tide::torch_backend {

class GlooEngine final : public tide::Engine {
 public:
  // `timeout`: the group's, read at each finish() (the group's setTimeout changes it).
  GlooEngine(c10::intrusive_ptr<c10d::Backend> gloo, std::function<std::chrono::milliseconds()> timeout)
      : gloo_(std::move(gloo)), timeout_(std::move(timeout)) {}
  const char* name() const override { return "gloo"; }
  void start(std::span<const tide::EngineSend> sends, std::span<const tide::EngineRecv> recvs,
             std::shared_ptr<const void> keep_alive) override;
  void finish() override;
  void abandon() override;
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  struct Exchange {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::shared_ptr<const void> keep_alive;
    std::string peers;  // for the error: "2, 6"
  };
  c10::intrusive_ptr<c10d::Backend> gloo_;
  tide::InFlight<Exchange> exchanges_;
  std::function<std::chrono::milliseconds()> timeout_;
  int64_t bytes_sent_ = 0;
};

}  // namespace tide::torch_backend
