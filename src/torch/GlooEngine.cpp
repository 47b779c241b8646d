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
  exchanges_.start(name(), tide::peer_list(sends, recvs), [&](Exchange& exchange) {
    exchange.keep_alive = std::move(keep_alive);
    for (const tide::EngineSend& s : sends) {
      std::vector<at::Tensor> t{bytes(s.data, s.bytes)};
      exchange.works.push_back(gloo_->send(t, s.peer, kTag));
      bytes_sent_ += static_cast<int64_t>(s.bytes);
    }
    for (const tide::EngineRecv& r : recvs) {
      std::vector<at::Tensor> t{bytes(r.data, r.bytes)};
      exchange.works.push_back(gloo_->recv(t, r.peer, kTag));
    }
  });
}

void GlooEngine::finish() {
  exchanges_.finish(name(), [&](Exchange& exchange) {
    const std::chrono::milliseconds timeout = timeout_();
    for (auto& w : exchange.works) w->wait(timeout);
  });
}

void GlooEngine::abandon() { exchanges_.abandon(); }

}  // namespace tide::torch_backend
