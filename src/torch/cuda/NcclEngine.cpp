#include "NcclEngine.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "tide/error.hpp"

namespace tide::torch_backend {
namespace {

// A byte tensor over device memory, its device given (no cudaPointerGetAttributes per message).
at::Tensor device_bytes(const void* data, size_t n, int device) {
  const c10::Device where(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  return at::for_blob(const_cast<void*>(data), {static_cast<int64_t>(n)})
      .options(at::TensorOptions().dtype(at::kByte).device(where))
      .target_device(where)
      .make_tensor();
}

}  // namespace

void NcclEngine::start(std::span<const tide::EngineSend> sends, std::span<const tide::EngineRecv> recvs,
                       std::shared_ptr<const void> keep_alive) {
  TIDE_CHECK(stream_, "tide inter-node exchange over nccl: no stream bound");
  exchanges_.start(name(), tide::peer_list(sends, recvs), [&](Exchange& exchange) {
    exchange.keep_alive = std::move(keep_alive);
    if (sends.empty() && recvs.empty()) return;
    const auto dev = static_cast<c10::DeviceIndex>(device_);
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream_, dev));
    nccl_->startCoalescing();
    try {
      for (const tide::EngineSend& s : sends) {
        std::vector<at::Tensor> t{device_bytes(s.data, s.bytes, device_)};
        nccl_->send(t, s.peer, 0);
        bytes_sent_ += static_cast<int64_t>(s.bytes);
      }
      for (const tide::EngineRecv& r : recvs) {
        std::vector<at::Tensor> t{device_bytes(r.data, r.bytes, device_)};
        nccl_->recv(t, r.peer, 0);
      }
    } catch (...) {
      // Half a group was posted: ending the coalescing launches it, and peers would then
      // match the wrong messages on a communicator other ops share. The communicator is done
      // for: abort it (every peer's NCCL errors out too); the exchange keeps its buffers
      // (receives may land).
      try {
        (void)nccl_->endCoalescing();
      } catch (...) {
      }
      nccl_->abort();
      throw;
    }
    exchange.work = nccl_->endCoalescing();
    TIDE_CHECK(exchange.work, "the NCCL backend returned no work for a group of ", sends.size(), " sends and ",
               recvs.size(), " receives");
  });
}

void NcclEngine::finish() {
  exchanges_.finish(name(), [&](Exchange& exchange) {
    if (!exchange.work) return;
    c10::cuda::CUDAStreamGuard guard(
        c10::cuda::getStreamFromExternal(stream_, static_cast<c10::DeviceIndex>(device_)));
    exchange.work->wait();  // the bound stream waits for NCCL's (blocking only with TORCH_NCCL_BLOCKING_WAIT)
  });
}

void NcclEngine::abandon() { exchanges_.abandon(); }

}  // namespace tide::torch_backend
