// What the CUDA node offers TIDE, and which all-gather path follows from it.
// probe() never throws and never leaves an error behind: without a device (or driver) it
// returns device_count == 0 and the reason in `error`.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tide::cuda {

using DeviceUuid = std::array<uint8_t, 16>;

struct DeviceCaps {
  int ordinal = 0;
  DeviceUuid uuid{};  // what identifies the GPU across processes (ordinals depend on CUDA_VISIBLE_DEVICES)
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int copy_engines = 0;          // cudaDevAttrAsyncEngineCount
  size_t total_memory = 0;
  bool unified_addressing = false;
  bool vmm = false;              // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  bool posix_fd_handles = false; // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
  bool multicast = false;        // CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (NVSwitch multicast)
  bool ipc = false;              // legacy cudaIpc*MemHandle (Linux, unified addressing)
  bool stream_mem_ops = false;   // cuStreamWaitValue32 / cuStreamWriteValue32 usable
};

struct Capabilities {
  int device_count = 0;
  int driver_version = 0;   // cudaDriverGetVersion, e.g. 13000
  int runtime_version = 0;  // cudaRuntimeGetVersion
  int nccl_version = 0;     // ncclGetVersion of the libnccl already loaded in the process (torch's); 0: none
  std::vector<DeviceCaps> devices;
  std::vector<std::vector<bool>> peer_access;  // [i][j]: i can map j's memory (true on i == j)
  std::string error;                            // why device_count is 0, if it is
};

Capabilities probe();
std::string describe(const Capabilities& caps);

// The ordinal, in this process, of the GPU with `uuid`, or -1 when this process does not see
// it (each rank given a CUDA_VISIBLE_DEVICES of its own, say).
int ordinal_of(const Capabilities& caps, const DeviceUuid& uuid);

enum class AllGatherPath { copy_engine, nccl };
const char* path_name(AllGatherPath path);

struct PathChoice {
  AllGatherPath path = AllGatherPath::nccl;
  std::string reason;
};

// The all-gather path for ranks on `rank_devices` (one device ordinal per local rank, in this
// process's numbering (ordinal_of), -1 for a GPU this process does not see; the same device
// may repeat: several processes on one GPU): copy engines over IPC / peer
// memory where every device has IPC, a copy engine and peer access to the others, else
// NCCL. NVSwitch multicast, where every rank has its own capable device, is named in the
// reason but not used. With TIDE_DEBUG=1 logs e.g.
// "[tide] cuda: peer access between every rank's device: copy engines".
PathChoice choose_allgather_path(const Capabilities& caps, const std::vector<int>& rank_devices);

}  // namespace tide::cuda
