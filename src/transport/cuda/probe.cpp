// Capability probing of the node (see include/tide/cuda/probe.hpp). Nothing here throws:
// every failing call is recorded and the probe carries on with what it learned.
#include "tide/cuda/probe.hpp"

#include <dlfcn.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <set>
#include <sstream>

#include "../../core/env.hpp"
#include "tide/cuda/driver.hpp"

namespace tide::cuda {
namespace {

// The NCCL already loaded in the process (torch's, whose communicators TIDE is handed), or
// 0: the probe never loads one itself (a second NCCL in a process is a bug waiting to happen).
int nccl_version() {
  using Fn = int (*)(int*);  // ncclResult_t ncclGetVersion(int*)
  void* h = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (!h) return 0;
  int v = 0;
  if (auto fn = reinterpret_cast<Fn>(::dlsym(h, "ncclGetVersion"))) {
    if (fn(&v) != 0) v = 0;
  }
  // Keep the handle: unloading a library torch may share is not ours to do.
  return v;
}

int attr(cudaDeviceAttr a, int dev) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, a, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return v;
}

int cu_attr(const Driver* drv, CUdevice_attribute a, CUdevice dev) {
  int v = 0;
  return drv && drv->cuDeviceGetAttribute(&v, a, dev) == CUDA_SUCCESS ? v : 0;
}

}  // namespace

Capabilities probe() {
  Capabilities c;
  c.nccl_version = nccl_version();
  (void)cudaDriverGetVersion(&c.driver_version);
  (void)cudaRuntimeGetVersion(&c.runtime_version);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n <= 0) {
    c.error = e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device";
    (void)cudaGetLastError();
    return c;
  }
  c.device_count = n;
  const Driver* drv = try_driver();  // resolved through the runtime: no libcuda link
  const bool have_driver = drv && drv->cuInit(0) == CUDA_SUCCESS;
  for (int d = 0; d < n; ++d) {
    DeviceCaps dc;
    dc.ordinal = d;
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) {
      dc.name = prop.name;
      for (size_t i = 0; i < dc.uuid.size(); ++i) dc.uuid[i] = static_cast<uint8_t>(prop.uuid.bytes[i]);
      dc.cc_major = prop.major;
      dc.cc_minor = prop.minor;
      dc.total_memory = prop.totalGlobalMem;
    } else {
      (void)cudaGetLastError();
    }
    dc.sm_count = attr(cudaDevAttrMultiProcessorCount, d);
    dc.copy_engines = attr(cudaDevAttrAsyncEngineCount, d);
    dc.unified_addressing = attr(cudaDevAttrUnifiedAddressing, d) != 0;
    dc.ipc = dc.unified_addressing;  // legacy CUDA IPC: Linux + UVA
    CUdevice cu = 0;
    if (have_driver && drv->cuDeviceGet(&cu, d) == CUDA_SUCCESS) {
      dc.vmm = cu_attr(drv, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu) != 0;
      dc.posix_fd_handles = cu_attr(drv, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cu) != 0;
      dc.multicast = cu_attr(drv, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, cu) != 0;
      // Stream memory operations are always available since CUDA 12 (the *_v2 entry
      // points); the old CAN_USE_STREAM_MEM_OPS attribute is gone. CudaGroup still falls
      // back to host-side flags if the first cuStreamWriteValue32 fails.
      dc.stream_mem_ops = c.driver_version >= 12000 && drv->cuStreamWriteValue32 && drv->cuStreamWaitValue32;
    }
    c.devices.push_back(dc);
  }
  c.peer_access.assign(n, std::vector<bool>(n, false));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      if (i == j) {
        c.peer_access[i][j] = true;
        continue;
      }
      int ok = 0;
      if (cudaDeviceCanAccessPeer(&ok, i, j) != cudaSuccess) {
        (void)cudaGetLastError();
        ok = 0;
      }
      c.peer_access[i][j] = ok != 0;
    }
  return c;
}

std::string describe(const Capabilities& c) {
  std::ostringstream os;
  os << "devices=" << c.device_count << " driver=" << c.driver_version << " runtime=" << c.runtime_version
     << " nccl=" << c.nccl_version;
  if (!c.error.empty()) os << " (" << c.error << ")";
  for (const DeviceCaps& d : c.devices)
    os << "\n  [" << d.ordinal << "] " << d.name << " sm_" << d.cc_major << d.cc_minor << " SMs=" << d.sm_count
       << " copy_engines=" << d.copy_engines << " mem=" << (d.total_memory >> 20) << "MiB"
       << " vmm=" << d.vmm << " posix_fd=" << d.posix_fd_handles << " multicast=" << d.multicast
       << " ipc=" << d.ipc << " stream_mem_ops=" << d.stream_mem_ops;
  return os.str();
}

int ordinal_of(const Capabilities& c, const DeviceUuid& uuid) {
  for (const DeviceCaps& d : c.devices)
    if (d.uuid == uuid) return d.ordinal;
  return -1;
}

const char* path_name(AllGatherPath p) {
  switch (p) {
    case AllGatherPath::copy_engine: return "copy engines";
    case AllGatherPath::nccl: return "nccl";
  }
  return "?";
}

PathChoice choose_allgather_path(const Capabilities& c, const std::vector<int>& rank_devices) {
  PathChoice pc;
  auto decide = [&](AllGatherPath p, std::string why) {
    pc.path = p;
    pc.reason = std::move(why);
    env::log("cuda: " + pc.reason + ": " + path_name(p));
    return pc;
  };
  if (c.device_count == 0) return decide(AllGatherPath::nccl, "no CUDA device (" + c.error + ")");
  for (size_t r = 0; r < rank_devices.size(); ++r) {
    const int d = rank_devices[r];
    if (d < 0)
      return decide(AllGatherPath::nccl, "the GPU of local rank " + std::to_string(r) +
                                             " is not visible in this process (a CUDA_VISIBLE_DEVICES per rank?): "
                                             "peer access cannot be checked");
    if (d >= c.device_count)
      return decide(AllGatherPath::nccl, "rank device " + std::to_string(d) + " does not exist");
  }
  const std::set<int> distinct(rank_devices.begin(), rank_devices.end());
  // Copy engines over IPC / peer memory.
  std::string ce_why;
  for (int d : distinct) {
    if (!c.devices[d].ipc) ce_why = "no CUDA IPC on device " + std::to_string(d);
    if (c.devices[d].copy_engines < 1) ce_why = "no copy engine on device " + std::to_string(d);
    for (int e : distinct)
      if (!c.peer_access[d][e]) ce_why = "no peer access from device " + std::to_string(d) + " to " + std::to_string(e);
  }
  if (!ce_why.empty()) return decide(AllGatherPath::nccl, ce_why);
  // NVSwitch multicast would deliver each shard once to every GPU; TIDE has no multicast
  // path (docs/status.md), so where it exists it is only reported.
  bool mc = rank_devices.size() > 1 && distinct.size() == rank_devices.size();
  for (int d : distinct) mc = mc && c.devices[d].multicast;
  return decide(AllGatherPath::copy_engine,
                mc ? "peer access between every rank's device (NVSwitch multicast present, unused: TIDE has no "
                     "multicast path)"
                   : "peer access between every rank's device");
}

}  // namespace tide::cuda
