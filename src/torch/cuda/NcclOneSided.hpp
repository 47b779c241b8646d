// The one-sided wire on GPUs (include/tide/one_sided.hpp): the host-side RMA calls of the
// NCCL that torch loaded (ncclCommWindowRegister, ncclPutSignal, ncclSignal, ncclWaitSignal,
// NCCL >= 2.29.7), looked up at run time, since TIDE may be built against older headers, on
// the communicator of the group's ProcessGroupNCCL delegate, enqueued on the bound stream.
// Windows are the local parts of the symmetric pool's buffers (one cuMem allocation each,
// registered from its base: NCCL 2.29.7 - 2.30.x put to wrong addresses in windows that
// start inside an allocation, NVIDIA/nccl#2198), registered collectively at the first
// all-gather that homes storages in them. Signal index, context and flags are 0 (the only
// values these NCCLs accept); a peer's signals to this rank are one counter, whichever
// window they came with.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "tide/comm.hpp"
#include "tide/one_sided.hpp"

namespace tide::torch_backend {

struct NcclRma;  // the entry points, found with dlsym

class NcclOneSided final : public tide::OneSidedWire {
 public:
  // Why the NCCL delegate `nccl` cannot carry one-sided puts on `device` here (empty: it
  // can): TIDE_NCCL_ONE_SIDED=0, the pool in cudaMalloc memory, a CUDA driver before 12.5,
  // entry points missing from the loaded NCCL, an NCCL before 2.29.7, or a communicator
  // without host RMA (ncclCommQueryProperties: no GIN-capable
  // network between the nodes, for one). Local: the ranks must agree before use.
  static std::string why_not(c10d::Backend& nccl, int device);
  // The loaded NCCL's version code (0: none loaded) and the entry points it lacks, by name.
  static std::pair<int, std::vector<std::string>> entry_points();
  NcclOneSided(c10::intrusive_ptr<c10d::Backend> nccl, int device, int rank);
  ~NcclOneSided() override;
  NcclOneSided(const NcclOneSided&) = delete;
  NcclOneSided& operator=(const NcclOneSided&) = delete;

  // Collective over the group, in the same order on every rank: the local part of `memory`
  // (`bytes` from its base) as a window, unless it is one already. False where NCCL made no window (then no rank
  // may put: the caller agrees on that across ranks). Windows of buffers that are gone are
  // deregistered here.
  bool ensure_window(const std::shared_ptr<tide::SymmetricBuffer>& memory, size_t bytes);
  // At teardown of a broken group: keep the windows registered (a stream may still use them).
  void leak_windows() { leak_ = true; }
  int windows() const { return static_cast<int>(windows_.size()); }
  // Whether the delegate still has the communicator this wire was made on (ProcessGroupNCCL
  // drops it when it aborts).
  bool same_communicator() const;
  void bind(cudaStream_t stream) { stream_ = stream; }

  int64_t window_offset(const void* p, size_t bytes) const override;
  void signal(std::span<const int> peers) override;
  void put(std::span<const Put> puts) override;
  void wait(std::span<const Wait> waits) override;

 private:
  struct Window {
    std::weak_ptr<tide::SymmetricBuffer> memory;
    std::byte* base = nullptr;
    size_t bytes = 0;
    void* handle = nullptr;  // ncclWindow_t; null once deregistered
  };
  void check(int result, const char* call) const;
  void end_group(int failed, const char* what) const;
  void deregister(Window& w);
  const Window* find(const void* p, size_t bytes) const;

  const NcclRma& rma_;
  c10::intrusive_ptr<c10d::Backend> nccl_;
  int device_, rank_;
  void* comm_ = nullptr;  // ncclComm_t
  cudaStream_t stream_ = nullptr;
  // In registration order, the same on every rank: a put goes into the peer's window of the
  // index its source lies in (the pools are symmetric).
  std::vector<Window> windows_;
  bool leak_ = false;
};

}  // namespace tide::torch_backend
