#define USE_C10D_NCCL  // ProcessGroupNCCL's declarations (torch builds with it; the header needs it)
#include "NcclOneSided.hpp"

#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <type_traits>

#include <c10/cuda/CUDAGuard.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "../../core/env.hpp"
#include "tide/error.hpp"

namespace tide::torch_backend {

// NCCL's entry points with the signatures of NCCL 2.29.7 - 2.30 (nccl.h, nccl_device/core.h),
// declared here: the headers TIDE builds against may be older than the NCCL torch loads.
struct NcclRma {
  struct WaitDesc {  // ncclWaitSignalDesc_t
    int opCnt, peer, sigIdx, ctx;
  };
  struct Properties {  // ncclCommProperties_t as of 2.29.7 (the version it is asked with)
    size_t size;
    unsigned int magic, version;
    int rank, nRanks, cudaDev, nvmlDev;
    bool deviceApiSupport, multimemSupport;
    int ginType, nLsaTeams;
    bool hostRmaSupport;
    int railedGinType;
    char reserved[256];  // room for a later NCCL that fills fields by its own layout
  };
  static constexpr int kWinCollSymmetric = 0x01;  // NCCL_WIN_COLL_SYMMETRIC
  static constexpr int kOneSidedSince = 22907;    // 2.29.7: the first with hostRmaSupport reported
  static constexpr size_t kWindowAlignment = 4096;
  static constexpr unsigned kApiMagic = 0xcafebeef;

  int (*get_version)(int*) = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*async_error)(void* comm, int* error) = nullptr;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  int (*query_properties)(void* comm, Properties* props) = nullptr;
  int (*window_register)(void* comm, void* buff, size_t size, void** win, int flags) = nullptr;
  int (*window_deregister)(void* comm, void* win) = nullptr;
  int (*put_signal)(const void* src, size_t count, int dtype, int peer, void* peer_win, size_t peer_win_offset,
                    int sig_idx, int ctx, unsigned int flags, void* comm, cudaStream_t stream) = nullptr;
  int (*signal)(int peer, int sig_idx, int ctx, unsigned int flags, void* comm, cudaStream_t stream) = nullptr;
  int (*wait_signal)(int n, WaitDesc* descs, void* comm, cudaStream_t stream) = nullptr;
  int version = 0;
  std::vector<std::string> missing_names;  // the entry points the loaded NCCL lacks
  std::string missing;                     // the same, ", "-separated

  std::string version_string() const {
    return detail::concat(version / 10000, '.', version / 100 % 100, '.', version % 100);
  }
};

namespace {

const NcclRma& rma() {
  static const NcclRma loaded = [] {
    NcclRma r;
    // The NCCL already in the process (torch's), never a second one: RTLD_NOLOAD.
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = RTLD_DEFAULT;
    auto find = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      if (fn) return;
      r.missing_names.emplace_back(symbol);
      r.missing += (r.missing.empty() ? "" : ", ") + std::string(symbol);
    };
    find(r.get_version, "ncclGetVersion");
    find(r.error_string, "ncclGetErrorString");
    find(r.async_error, "ncclCommGetAsyncError");
    find(r.group_start, "ncclGroupStart");
    find(r.group_end, "ncclGroupEnd");
    find(r.query_properties, "ncclCommQueryProperties");
    find(r.window_register, "ncclCommWindowRegister");
    find(r.window_deregister, "ncclCommWindowDeregister");
    find(r.put_signal, "ncclPutSignal");
    find(r.signal, "ncclSignal");
    find(r.wait_signal, "ncclWaitSignal");
    if (r.get_version && r.get_version(&r.version) != ncclSuccess) r.version = 0;
    return r;
  }();
  return loaded;
}

// The raw communicator of a ProcessGroupNCCL on `device` (0 if it has none yet).
void* comm_of(c10d::Backend& nccl, int device) {
  auto* pg = dynamic_cast<c10d::ProcessGroupNCCL*>(&nccl);
  TIDE_CHECK(pg, "tide: the CUDA delegate is not a ProcessGroupNCCL");
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));  // getCommPtr reads the current device
  return reinterpret_cast<void*>(static_cast<intptr_t>(pg->getCommPtr()));
}

}  // namespace

std::pair<int, std::vector<std::string>> NcclOneSided::entry_points() {
  return {rma().version, rma().missing_names};
}

std::string NcclOneSided::why_not(c10d::Backend& nccl, int device) {
  const std::string mode = env::get_string("TIDE_NCCL_ONE_SIDED", "auto");
  TIDE_CHECK(mode == "auto" || mode == "0" || mode == "1", "TIDE_NCCL_ONE_SIDED is '", mode,
             "': auto (the default), 0 or 1");
  if (mode == "0") return "TIDE_NCCL_ONE_SIDED=0";
  if (env::get_string("TIDE_CUDA_SYMMETRIC", "vmm") == "ipc")
    return "the symmetric pool is cudaMalloc memory (TIDE_CUDA_SYMMETRIC=ipc); NCCL windows need cuMem allocations";
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) (void)cudaGetLastError();
  if (driver < 12050)  // NCCL refuses host RMA calls below, at enqueue, whatever it reports
    return detail::concat("the CUDA driver is ", driver / 1000, '.', driver % 1000 / 10,
                          " (NCCL's one-sided calls need 12.5 or later)");
  const NcclRma& r = rma();
  if (r.version && r.version < NcclRma::kOneSidedSince)
    return detail::concat("the loaded NCCL is ", r.version_string(), " (one-sided puts need 2.29.7 or later)");
  if (!r.missing.empty()) return detail::concat("the loaded NCCL ", r.version_string(), " lacks ", r.missing);
  void* comm = comm_of(nccl, device);
  if (!comm) return detail::concat("the NCCL delegate has no communicator on cuda:", device);
  NcclRma::Properties props{};
  props.size = sizeof props;
  props.magic = NcclRma::kApiMagic;
  props.version = NcclRma::kOneSidedSince;  // the layout declared above
  if (const int e = r.query_properties(comm, &props); e != ncclSuccess)
    return detail::concat("ncclCommQueryProperties failed: ", r.error_string(e));
  if (!props.hostRmaSupport)
    return detail::concat("NCCL ", r.version_string(), " reports no host RMA on this communicator (it needs GPUDirect "
                          "RDMA over a GIN-capable network between the nodes, e.g. InfiniBand or RoCE)");
  return "";
}

NcclOneSided::NcclOneSided(c10::intrusive_ptr<c10d::Backend> nccl, int device, int rank)
    : rma_(rma()), nccl_(std::move(nccl)), device_(device), rank_(rank) {
  TIDE_CHECK(rma_.missing.empty(), "tide nccl one-sided: rank ", rank_, ": the loaded NCCL lacks ", rma_.missing);
  comm_ = comm_of(*nccl_, device_);
  TIDE_CHECK(comm_, "tide nccl one-sided: rank ", rank_, ": the NCCL delegate has no communicator on cuda:", device_);
}

NcclOneSided::~NcclOneSided() {
  if (leak_ || !same_communicator()) return;  // an aborted or replaced communicator: nothing to deregister with
  for (Window& w : windows_) deregister(w);
}

bool NcclOneSided::same_communicator() const {
  try {
    return comm_of(*nccl_, device_) == comm_;
  } catch (const std::exception&) {
    return false;
  }
}

void NcclOneSided::check(int result, const char* call) const {
  // A nonblocking communicator (TORCH_NCCL_USE_COMM_NONBLOCKING) may still be working on it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  while (result == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (rma_.async_error(comm_, &result) != ncclSuccess) break;
  }
  TIDE_CHECK(result == ncclSuccess, "tide nccl one-sided: rank ", rank_, ": ", call, " failed: ",
             rma_.error_string(result), " (NCCL ", rma_.version_string(), ")");
}

void NcclOneSided::deregister(Window& w) {
  if (!w.handle) return;
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device_));
  if (const int e = rma_.window_deregister(comm_, w.handle); e != ncclSuccess)
    env::log(detail::concat("nccl one-sided: rank ", rank_, ": ncclCommWindowDeregister: ", rma_.error_string(e)));
  w.handle = nullptr;
}

bool NcclOneSided::ensure_window(const std::shared_ptr<tide::SymmetricBuffer>& memory, size_t bytes) {
  for (Window& w : windows_)
    if (w.handle && w.memory.expired()) deregister(w);  // local: its collectives all completed
  for (const Window& w : windows_)
    if (w.handle && w.memory.lock() == memory) return true;
  std::byte* base = memory->local();
  TIDE_CHECK(reinterpret_cast<uintptr_t>(base) % NcclRma::kWindowAlignment == 0, "tide nccl one-sided: rank ", rank_,
             ": the symmetric pool at ", static_cast<void*>(base), " is not ", NcclRma::kWindowAlignment,
             "-byte aligned");
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device_));
  void* handle = nullptr;
  check(rma_.window_register(comm_, base, bytes, &handle, NcclRma::kWinCollSymmetric), "ncclCommWindowRegister");
  if (!handle) return false;  // NCCL without symmetric support says so with a null window
  windows_.push_back({memory, base, bytes, handle});
  env::log(detail::concat("nccl one-sided: rank ", rank_, ": window ", windows_.size() - 1, " of ", bytes,
                          " bytes (the symmetric pool)"));
  return true;
}

const NcclOneSided::Window* NcclOneSided::find(const void* p, size_t bytes) const {
  const auto* q = static_cast<const std::byte*>(p);
  for (const Window& w : windows_)
    if (w.handle && q >= w.base && q + bytes <= w.base + w.bytes && !w.memory.expired()) return &w;
  return nullptr;
}

int64_t NcclOneSided::window_offset(const void* p, size_t bytes) const {
  const Window* w = find(p, bytes);
  return w ? static_cast<const std::byte*>(p) - w->base : -1;
}

void NcclOneSided::end_group(int failed, const char* what) const {
  const int ended = rma_.group_end();  // first: NCCL keeps the open group per thread
  if (failed != ncclSuccess) check(failed, what);
  check(ended, "ncclGroupEnd");
}

void NcclOneSided::signal(std::span<const int> peers) {
  TIDE_CHECK(stream_, "tide nccl one-sided: rank ", rank_, ": no stream bound");
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device_));
  check(rma_.group_start(), "ncclGroupStart");
  int failed = ncclSuccess;
  for (int peer : peers)
    if (failed == ncclSuccess) failed = rma_.signal(peer, 0, 0, 0, comm_, stream_);
  end_group(failed, "ncclSignal");
}

void NcclOneSided::put(std::span<const Put> puts) {
  TIDE_CHECK(stream_, "tide nccl one-sided: rank ", rank_, ": no stream bound");
  std::vector<void*> windows;  // each put's window, found before the group opens
  for (const Put& p : puts) {
    const Window* w = find(p.src, p.bytes);
    TIDE_CHECK(w, "tide nccl one-sided: rank ", rank_, ": a put of ", p.bytes, " bytes to rank ", p.peer,
               " from outside every window");
    windows.push_back(w->handle);
  }
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device_));
  check(rma_.group_start(), "ncclGroupStart");
  int failed = ncclSuccess;
  for (size_t i = 0; i < puts.size() && failed == ncclSuccess; ++i) {
    const Put& p = puts[i];
    failed = rma_.put_signal(p.src, p.bytes, ncclInt8, p.peer, windows[i], p.offset, 0, 0, 0, comm_, stream_);
  }
  end_group(failed, "ncclPutSignal");
}

void NcclOneSided::wait(std::span<const Wait> waits) {
  TIDE_CHECK(stream_, "tide nccl one-sided: rank ", rank_, ": no stream bound");
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device_));
  std::vector<NcclRma::WaitDesc> descs;
  for (const Wait& w : waits) descs.push_back({w.signals, w.peer, 0, 0});
  check(rma_.wait_signal(static_cast<int>(descs.size()), descs.data(), comm_, stream_), "ncclWaitSignal");
}

}  // namespace tide::torch_backend
