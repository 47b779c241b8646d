// Symmetric device memory across the processes of one node: every rank allocates its own
// part and maps every peer's. Two mechanisms, chosen per group (CudaGroup, TIDE_CUDA_SYMMETRIC):
//
// vmm (default where every rank's device supports it): cuMemCreate with POSIX-fd shareable
//   handles; the fd travels to each peer over an FdChannel (SCM_RIGHTS), which imports it
//   (cuMemImportFromShareableHandle) and maps it into its own address reservation
//   (cuMemAddressReserve / cuMemMap / cuMemSetAccess). The driver keeps the physical memory
//   while any process maps it, so teardown needs no rendezvous: each rank unmaps and
//   releases on its own.
// ipc: cudaMalloc + cudaIpcGetMemHandle published through the Store, cudaIpcOpenMemHandle by
//   each peer (a process cannot open its own handle, so its own part is its own pointer).
//   Teardown closes the peers' mappings, then waits (store barrier, bounded) until every rank
//   has closed its mappings of this rank's part before freeing it; if a peer never arrives
//   the part is leaked rather than freed under a peer's feet.
// Several ranks on the SAME device in different processes work either way: handles are per
// process, not per device. A store barrier ends every allocation.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <cuda.h>

#include "tide/comm.hpp"
#include "tide/fd_channel.hpp"
#include "tide/store.hpp"

namespace tide::cuda {

// Blocks until `world_size` ranks reached `key` (Store::add), or throws TimeoutError.
void store_barrier(Store& store, const std::string& key, int world_size,
                   std::chrono::milliseconds timeout, int rank);

class CudaSymmetricBuffer final : public SymmetricBuffer {
 public:
  // Collective over the `world_size` ranks using `key` (unique per allocation, the same on
  // every rank). `bytes` is this rank's part (0 allowed). The part is zero-filled, on the
  // current device. With `fds` the vmm mechanism, without it ipc (the same on every rank).
  // `across_nodes` (vmm): memory NCCL's one-sided puts between nodes can register, i.e.
  // GPUDirect-RDMA capable and, where the device offers them (multi-node NVLink, IMEX),
  // exportable as fabric handles; inside a node POSIX fds alone are asked for.
  static std::shared_ptr<CudaSymmetricBuffer> allocate(std::shared_ptr<Store> store, const std::string& key,
                                                       int rank, int world_size, size_t bytes,
                                                       std::chrono::milliseconds timeout,
                                                       FdChannel* fds = nullptr, bool across_nodes = false);
  ~CudaSymmetricBuffer() override;
  CudaSymmetricBuffer(const CudaSymmetricBuffer&) = delete;
  CudaSymmetricBuffer& operator=(const CudaSymmetricBuffer&) = delete;

  std::byte* local() override { return ptrs_[rank_]; }
  std::byte* peer(int rank) override;
  size_t bytes(int rank) const override;
  // Device memory is not decommitted piecewise (either mechanism): the range is zero-filled
  // (synchronously) and stays resident.
  void release(size_t offset, size_t bytes) override;
  int device() const override { return device_; }
  // Leak at destruction if `*flag` is set by then (the owning group broke: a stream may
  // still use this memory, and waiting for it could hang).
  void leak_if(std::shared_ptr<std::atomic<bool>> flag) { leak_if_ = std::move(flag); }
  // The owner has synchronized every stream that used the buffer before dropping it, so the
  // vmm teardown need not wait for the whole device.
  void owner_synchronizes() { device_sync_ = false; }

 private:
  CudaSymmetricBuffer() = default;
  std::shared_ptr<Store> store_;
  std::string key_;
  int rank_ = 0, world_size_ = 1, device_ = 0;
  std::chrono::milliseconds timeout_{0};
  std::vector<std::byte*> ptrs_;
  std::vector<size_t> sizes_;
  void* own_ = nullptr;
  std::shared_ptr<std::atomic<bool>> leak_if_;
  bool leaking() const { return leak_if_ && leak_if_->load(); }
  // vmm only: per rank, the imported (or own) allocation handle and the mapped size.
  bool vmm_ = false, device_sync_ = true;
  std::vector<CUmemGenericAllocationHandle> handles_;
  std::vector<size_t> mapped_;
  void allocate_vmm(size_t bytes, FdChannel& fds, bool across_nodes);
  void destroy_vmm();
};

}  // namespace tide::cuda
