// Symmetric device memory across the processes of one node (include/tide/cuda/symmetric.hpp).
#include "tide/cuda/symmetric.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>

#include "../../core/env.hpp"
#include "records.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/driver.hpp"

namespace tide::cuda {
namespace {

// Zeros device memory and returns once they are there: cudaMemset on device memory does not
// wait for the host, and our streams are non-blocking, so nothing else would order it
// before a peer (or one of our streams) looks.
void zero_fill(void* p, size_t n) {
  cudaStream_t s = nullptr;
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const cudaError_t set = cudaMemsetAsync(p, 0, n, s);
  const cudaError_t done = set == cudaSuccess ? cudaStreamSynchronize(s) : set;
  (void)cudaStreamDestroy(s);
  TIDE_CUDA_CHECK(done);
}

// What a rank publishes for its part.
struct PartRecord {
  cudaIpcMemHandle_t handle;
  uint64_t bytes;
  int32_t pid;  // two ranks in one process cannot open each other's handles
  int32_t pad;
};

}  // namespace

void store_barrier(Store& store, const std::string& key, int world_size, std::chrono::milliseconds timeout,
                   int rank) {
  store.add(key, 1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto nap = std::chrono::microseconds(50);
  for (;;) {
    const int64_t n = store.add(key, 0);
    if (n >= world_size) return;
    if (std::chrono::steady_clock::now() > deadline)
      throw TimeoutError(detail::concat("tide: cuda: rank ", rank, ": barrier '", key, "' timed out after ",
                                        timeout.count(), " ms with ", n, " of ", world_size, " ranks"));
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::milliseconds(2)) nap *= 2;
  }
}

std::shared_ptr<CudaSymmetricBuffer> CudaSymmetricBuffer::allocate(std::shared_ptr<Store> store,
                                                                   const std::string& key, int rank,
                                                                   int world_size, size_t bytes,
                                                                   std::chrono::milliseconds timeout,
                                                                   FdChannel* fds, bool across_nodes) {
  TIDE_CHECK(store && world_size >= 1 && rank >= 0 && rank < world_size, "tide: cuda: rank ", rank,
             ": bad symmetric allocation arguments (world size ", world_size, ")");
  std::shared_ptr<CudaSymmetricBuffer> b(new CudaSymmetricBuffer());
  b->store_ = store;
  b->key_ = key;
  b->rank_ = rank;
  b->world_size_ = world_size;
  b->timeout_ = timeout;
  b->ptrs_.assign(world_size, nullptr);
  b->sizes_.assign(world_size, 0);
  int dev = 0;
  TIDE_CUDA_CHECK(cudaGetDevice(&dev));
  b->device_ = dev;
  if (fds) {
    b->allocate_vmm(bytes, *fds, across_nodes);
    return b;
  }
  // Always allocate something (a zero-byte part still needs a handle to exchange).
  const size_t alloc = bytes ? bytes : 256;
  void* p = nullptr;
  TIDE_CUDA_CHECK(cudaMalloc(&p, alloc));
  b->own_ = p;
  b->ptrs_[rank] = static_cast<std::byte*>(p);
  b->sizes_[rank] = bytes;
  zero_fill(p, alloc);
  PartRecord mine{};
  TIDE_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, p));
  mine.bytes = bytes;
  mine.pid = static_cast<int32_t>(::getpid());
  put_record(*store, key + "/part", rank, mine);
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    const auto rec = get_record<PartRecord>(*store, key + "/part", r, timeout, rank);
    TIDE_CHECK(rec.pid != mine.pid, "tide: cuda: rank ", rank, " and rank ", r,
               " are the same process; CUDA IPC needs one rank per process");
    void* q = nullptr;
    // Same device, other process: fine. Other device: LazyEnablePeerAccess maps it over
    // NVLink / PCIe (needs peer access, see probe()).
    TIDE_CUDA_CHECK(cudaIpcOpenMemHandle(&q, rec.handle, cudaIpcMemLazyEnablePeerAccess));
    b->ptrs_[r] = static_cast<std::byte*>(q);
    b->sizes_[r] = rec.bytes;
  }
  store_barrier(*store, key + "/opened", world_size, timeout, rank);
  env::log(detail::concat("cuda: rank ", rank, ": symmetric '", key, "' ", bytes, " bytes on device ", dev,
                          " mapped by ", world_size, " ranks"));
  return b;
}

// What a rank publishes for its vmm part (the fd goes through the FdChannel).
struct VmmRecord {
  uint64_t bytes;    // the part's size as asked
  uint64_t mapped;   // rounded up to the allocation granularity
};

void CudaSymmetricBuffer::allocate_vmm(size_t bytes, FdChannel& fds, bool across_nodes) {
  const Driver& drv = driver();
  TIDE_CHECK(drv.cuMemCreate && drv.cuMemGetAllocationGranularity && drv.cuMemExportToShareableHandle &&
                 drv.cuMemImportFromShareableHandle && drv.cuMemMap && drv.cuMemSetAccess && drv.cuMemAddressReserve,
             "tide: cuda: rank ", rank_, ": the driver lacks the virtual memory entry points (TIDE_CUDA_SYMMETRIC=ipc)");
  vmm_ = true;
  handles_.assign(world_size_, 0);
  mapped_.assign(world_size_, 0);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  // Across nodes, GPUDirect RDMA where the device has it for cuMem memory, as ncclMemAlloc
  // asks: NCCL's one-sided puts between nodes register the pool with the NIC.
  CUdevice cu_device = 0;
  const bool queried = drv.cuDeviceGet && drv.cuDeviceGetAttribute && drv.cuDeviceGet(&cu_device, device_) == CUDA_SUCCESS;
  auto has = [&](CUdevice_attribute a) {
    int v = 0;
    return queried && drv.cuDeviceGetAttribute(&v, a, cu_device) == CUDA_SUCCESS && v != 0;
  };
  if (across_nodes && has(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED))
    prop.allocFlags.gpuDirectRDMACapable = 1;
  size_t gran = 0;
  TIDE_CU_CHECK(drv.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;  // this rank's device reads and writes every part
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  auto map = [&](int r, CUmemGenericAllocationHandle h, size_t size) {
    handles_[r] = h;  // owned from here: destroy_vmm releases it
    CUdeviceptr va = 0;
    TIDE_CU_CHECK(drv.cuMemAddressReserve(&va, size, gran, 0, 0));
    if (const CUresult m = drv.cuMemMap(va, size, 0, h, 0); m != CUDA_SUCCESS) {
      (void)drv.cuMemAddressFree(va, size);
      TIDE_CU_CHECK(m);
    }
    ptrs_[r] = reinterpret_cast<std::byte*>(va);
    mapped_[r] = size;  // mapped and reserved: destroy_vmm unmaps and frees both
    TIDE_CU_CHECK(drv.cuMemSetAccess(va, size, &access, 1));
  };

  const size_t size = (std::max<size_t>(bytes, 1) + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle own = 0;
  // Across nodes, fabric handles too where the device has them (multi-node NVLink), as
  // ncclMemAlloc asks: NCCL exports a window's memory with the handle type of its own
  // choice. Without an IMEX channel the driver refuses them: then POSIX fds alone. Inside a
  // node the ranks exchange POSIX fds only, and nothing else is asked of the driver.
  if (across_nodes && has(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)) {
    CUmemAllocationProp with_fabric = prop;
    with_fabric.requestedHandleTypes =
        static_cast<CUmemAllocationHandleType>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC);
    if (drv.cuMemCreate(&own, size, &with_fabric, 0) != CUDA_SUCCESS) own = 0;
  }
  if (!own) TIDE_CU_CHECK(drv.cuMemCreate(&own, size, &prop, 0));
  map(rank_, own, size);
  sizes_[rank_] = bytes;
  zero_fill(ptrs_[rank_], size);

  VmmRecord mine{bytes, size};
  put_record(*store_, key_ + "/vmm", rank_, mine);
  const uint64_t tag = std::hash<std::string>{}(key_);
  if (world_size_ > 1) {
    int fd = -1;
    TIDE_CU_CHECK(drv.cuMemExportToShareableHandle(&fd, own, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    try {
      for (int r = 0; r < world_size_; ++r)
        if (r != rank_) fds.send(r, tag, fd);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const auto rec = get_record<VmmRecord>(*store_, key_ + "/vmm", r, timeout_, rank_);
    const int pfd = fds.receive(r, tag);
    CUmemGenericAllocationHandle h = 0;
    const CUresult imported = drv.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(pfd)),
                                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    ::close(pfd);  // the handle holds the memory now
    TIDE_CU_CHECK(imported);
    map(r, h, rec.mapped);
    sizes_[r] = rec.bytes;
  }
  store_barrier(*store_, key_ + "/opened", world_size_, timeout_, rank_);
  env::log(detail::concat("cuda: rank ", rank_, ": symmetric '", key_, "' ", bytes, " bytes (vmm, ", size,
                          " mapped) on device ", device_, " mapped by ", world_size_, " ranks"));
}

void CudaSymmetricBuffer::destroy_vmm() {
  const Driver* d = try_driver();
  if (!d) return;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) (void)cudaGetLastError();
  if (previous != device_ && cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  // Any stream of this process may still read or write these mappings (FSDP2's optimizer
  // writes shards on its own stream): wait for the device, as cudaFree would. Owners that
  // synchronized the only streams using the buffer say so (device_sync_ false).
  if (device_sync_ && cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
  for (int r = 0; r < world_size_; ++r) {
    const auto va = reinterpret_cast<CUdeviceptr>(ptrs_[r]);
    if (va && mapped_[r]) {
      (void)d->cuMemUnmap(va, mapped_[r]);
      (void)d->cuMemAddressFree(va, mapped_[r]);
    }
    if (handles_[r]) (void)d->cuMemRelease(handles_[r]);  // physical memory goes with the last holder
  }
  if (previous >= 0 && previous != device_ && cudaSetDevice(previous) != cudaSuccess) (void)cudaGetLastError();
}

CudaSymmetricBuffer::~CudaSymmetricBuffer() {
  // Never throws.
  if (vmm_) {
    if (!leaking()) destroy_vmm();  // after an abort a stream may still use this memory
    return;
  }
  // ipc: close what we opened, then free our part once every peer closed theirs. Leaking:
  // nothing at all (a released stream may still copy through the mappings).
  if (leaking()) return;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_ || !ptrs_[r]) continue;
    if (cudaIpcCloseMemHandle(ptrs_[r]) != cudaSuccess) (void)cudaGetLastError();
  }
  if (!own_) return;
  bool all_closed = world_size_ == 1;
  if (!all_closed) {
    try {
      store_barrier(*store_, key_ + "/closed", world_size_, std::min(timeout_, std::chrono::milliseconds(60000)),
                    rank_);
      all_closed = true;
    } catch (const std::exception& e) {
      env::log(detail::concat("cuda: rank ", rank_, ": leaking symmetric '", key_, "': ", e.what()));
    }
  }
  if (all_closed && cudaFree(own_) != cudaSuccess) (void)cudaGetLastError();
}

std::byte* CudaSymmetricBuffer::peer(int rank) {
  TIDE_CHECK(rank >= 0 && rank < world_size_, "tide: cuda: rank ", rank_, ": symmetric peer ", rank,
             " out of range (world size ", world_size_, ")");
  return ptrs_[rank];
}

size_t CudaSymmetricBuffer::bytes(int rank) const {
  TIDE_CHECK(rank >= 0 && rank < world_size_, "tide: cuda: rank ", rank_, ": symmetric peer ", rank,
             " out of range (world size ", world_size_, ")");
  return sizes_[rank];
}

void CudaSymmetricBuffer::release(size_t offset, size_t n) {
  const size_t size = sizes_[rank_];
  TIDE_CHECK(offset <= size && n <= size - offset, "tide: cuda: SymmetricBuffer::release: rank ", rank_,
             ": range [", offset, ", ", offset + n, ") outside the ", size, "-byte part");
  if (n) zero_fill(ptrs_[rank_] + offset, n);
}

}  // namespace tide::cuda
