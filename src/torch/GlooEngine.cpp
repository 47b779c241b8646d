#include "GlooEngine.hpp"

#include <ATen/ATen.h>

#include "tide/error.hpp"

namespace tide::torch_backend {
namespace {
// A tag of its own, so TIDE's messages never match a user's send/recv on the same gloo group.
constexpr int kTag = 0x7d1e;

at::Tensor bytes(const void* data, size_t n) {
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
}
}  // namespace

void GlooEngine::start(std::span<const tide::EngineSend> sends, std::span<const tide::EngineRecv> recvs,
                       std::shared_ptr<const void> keep_alive) {
  Exchange& exchange = in_flight_.emplace_back();
  exchange.keep_alive = std::move(keep_alive);
  std::vector<c10::intrusive_ptr<c10d::Work>>& works = exchange.works;
  exchange.peers = tide::peer_list(sends, recvs);
  for (const tide::EngineSend& s : sends) {
    std::vector<at::Tensor> t{bytes(s.data, s.bytes)};
    works.push_back(gloo_->send(t, s.peer, kTag));
    bytes_sent_ += static_cast<int64_t>(s.bytes);
  }
  for (const tide::EngineRecv& r : recvs) {
    std::vector<at::Tensor> t{bytes(r.data, r.bytes)};
    works.push_back(gloo_->recv(t, r.peer, kTag));
  }
}

void GlooEngine::finish() {
  TIDE_CHECK(!in_flight_.empty(), "tide inter-node exchange over gloo: finish() without start()");
  Exchange exchange = std::move(in_flight_.front());
  in_flight_.pop_front();
  try {
    for (auto& w : exchange.works) w->wait(timeout_);
  } catch (const std::exception& e) {
    failed_.push_back(std::move(exchange));
    throw tide::TimeoutError(detail::concat("inter-node exchange over gloo with ranks ", exchange.peers, " failed: ",
                                            e.what()));
  }
}

void GlooEngine::abandon() {
  for (Exchange& e : in_flight_) failed_.push_back(std::move(e));
  in_flight_.clear();
}

}  // namespace tide::torch_backend
