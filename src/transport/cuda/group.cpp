// CudaGroup: streams, symmetric control flags and staging of one rank (see group.hpp).
#include "tide/cuda/group.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "../../core/env.hpp"
#include "records.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/kernels.hpp"
#include "tide/cuda/driver.hpp"

namespace tide::cuda {
namespace {

bool reached(uint32_t have, uint32_t want) { return static_cast<int32_t>(have - want) >= 0; }

const char* flag_name(CudaGroup::FlagId f) {
  switch (f) {
    case CudaGroup::kAgReady: return "ag_ready";
    case CudaGroup::kAgDone: return "ag_done";
    case CudaGroup::kRsReady: return "rs_ready";
    case CudaGroup::kRsDone: return "rs_done";
    case CudaGroup::kNodeAg: return "node_ag";
    default: return "?";
  }
}

// TIDE_CUDA_SYMMETRIC: auto (vmm where every rank can), vmm, ipc.
std::string symmetric_from_env() {
  const char* v = std::getenv("TIDE_CUDA_SYMMETRIC");
  const std::string s = v && *v ? v : "auto";
  TIDE_CHECK(s == "auto" || s == "vmm" || s == "ipc", "tide: TIDE_CUDA_SYMMETRIC='", s,
             "' is not 'auto', 'vmm' or 'ipc'");
  return s;
}

SyncMode sync_from_env(int opt) {
  if (opt == 0) return SyncMode::device;
  if (opt == 1) return SyncMode::host;
  const char* v = std::getenv("TIDE_CUDA_SYNC");
  if (!v || !*v || std::strcmp(v, "device") == 0) return SyncMode::device;
  if (std::strcmp(v, "host") == 0) return SyncMode::host;
  throw Error(detail::concat("tide: TIDE_CUDA_SYNC='", v, "' is not 'device' or 'host'"));
}

}  // namespace

CudaGroup::CudaGroup(std::shared_ptr<Store> store, std::string ns, int rank, int world_size, int device,
                     CudaGroupOptions options)
    : store_(std::move(store)), ns_(std::move(ns)), rank_(rank), ws_(world_size), device_(device), opt_(options) {
  TIDE_CHECK(store_, "tide: cuda: CudaGroup needs a store");
  TIDE_CHECK(ws_ >= 1 && rank_ >= 0 && rank_ < ws_, "tide: cuda: bad rank ", rank_, " of world size ", ws_);
  TIDE_CHECK(opt_.num_slots >= 1, "tide: cuda: rank ", rank_, ": num_slots must be >= 1");
  set_error_rank(rank_);
  mode_ = sync_from_env(opt_.sync);
  // CUDA_DEVICE_MAX_CONNECTIONS below the default of 8 (1 is what Megatron-style launchers
  // set) multiplexes the process's streams onto that many hardware queues: a stream waiting
  // for a peer's flag (cuStreamWaitValue32) then holds back the compute or NCCL work queued
  // behind it on the same queue, a stall at best and, with NCCL across nodes, a cycle.
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");  // CUDA's, not ours: never throw on it
  if (const long queues = connections && *connections ? std::strtol(connections, nullptr, 10) : 8; queues < 8) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      std::fprintf(stderr,
                   "[tide] CUDA_DEVICE_MAX_CONNECTIONS=%lld: TIDE's stream waits can hold back other streams' work "
                   "that shares their hardware queue (compute, NCCL); unset it or set it to 8 or more\n",
                   static_cast<long long>(queues));
    });
  }
  caps_ = probe();
  TIDE_CHECK(caps_.device_count > 0, "tide: cuda: rank ", rank_, ": no CUDA device (", caps_.error, ")");
  TIDE_CHECK(device_ >= 0 && device_ < caps_.device_count, "tide: cuda: rank ", rank_, ": device ", device_,
             " out of range (", caps_.device_count, " devices)");
  TIDE_CUDA_CHECK(cudaSetDevice(device_));
  TIDE_CUDA_CHECK(cudaFree(nullptr));  // create the primary context: driver calls need it

  // Which device every rank is on decides the all-gather path; whether every rank's device
  // has virtual memory management with POSIX-fd handles decides the symmetric memory.
  const std::string want = symmetric_from_env();
  const DeviceCaps& dc = caps_.devices[device_];
  const bool vmm_here = dc.vmm && dc.posix_fd_handles;
  opt_.staging_bytes = opt_.staging_bytes ? opt_.staging_bytes : env::get_bytes("TIDE_CUDA_STAGING_BYTES", 32u << 20);
  rs_ctas_ = opt_.rs_ctas > 0 ? opt_.rs_ctas : accumulate_ctas();  // TIDE_RS_CTAS, else from the device
  TIDE_CHECK(rs_ctas_ >= 1 && rs_ctas_ <= 1024, "tide: TIDE_RS_CTAS=", rs_ctas_, " out of [1, 1024]");
  num_slots_ = opt_.num_slots;
  piece_bytes_ = opt_.staging_bytes / static_cast<size_t>(num_slots_) / static_cast<size_t>(ws_) / 256 * 256;
  TIDE_CHECK(piece_bytes_ >= 256, "tide: cuda: rank ", rank_, ": staging of ", opt_.staging_bytes, " bytes is too small for ",
             num_slots_, " slots x ", ws_, " ranks x 256 bytes");
  slot_bytes_ = piece_bytes_ * static_cast<size_t>(ws_);

  // What every rank must agree on travels with its device: the staging layout (peers read
  // each other's slots at the same offsets).
  // The GPU by its UUID: ordinals differ between processes whose CUDA_VISIBLE_DEVICES differ.
  struct Record {
    uint64_t staging_bytes;
    int32_t num_slots;
    uint8_t vmm, want, pad[2];  // want: TIDE_CUDA_SYMMETRIC's first letter
    DeviceUuid gpu;
  } mine{opt_.staging_bytes, num_slots_, static_cast<uint8_t>(vmm_here), static_cast<uint8_t>(want[0]), {0, 0},
         dc.uuid};
  const std::string dkey = ns_ + "/cuda/device";
  put_record(*store_, dkey, rank_, mine);
  std::vector<int> devices(ws_);
  bool vmm_everywhere = true;
  for (int r = 0; r < ws_; ++r) {
    const auto rec = get_record<Record>(*store_, dkey, r, opt_.timeout, rank_);
    TIDE_CHECK(rec.staging_bytes == mine.staging_bytes && rec.num_slots == mine.num_slots, "tide: cuda: rank ", rank_,
               ": rank ", r, " stages ", rec.staging_bytes, " bytes in ", rec.num_slots, " slots, rank ", rank_, " ",
               mine.staging_bytes, " in ", mine.num_slots, " (TIDE_CUDA_STAGING_BYTES must be the same on every rank)");
    TIDE_CHECK(rec.want == mine.want, "tide: cuda: rank ", rank_, ": TIDE_CUDA_SYMMETRIC differs between rank ", r,
               " and rank ", rank_, " ('", static_cast<char>(rec.want), "...' vs '", want,
               "'); it must be the same on every rank");
    devices[r] = ordinal_of(caps_, rec.gpu);  // -1: not visible here
    vmm_everywhere = vmm_everywhere && rec.vmm;
  }
  ag_path_ = choose_allgather_path(caps_, devices);
  // After publishing: every rank reaches this verdict, none waits for a rank that threw.
  TIDE_CHECK(want != "vmm" || vmm_everywhere, "tide: cuda: rank ", rank_,
             ": TIDE_CUDA_SYMMETRIC=vmm but a device lacks virtual memory management with POSIX fd handles");
  // The same decision on every rank: it depends only on what all ranks published.
  vmm_ = want != "ipc" && vmm_everywhere;
  fds_ = std::make_unique<FdChannel>(*store_, ns_ + "/cuda", rank_, ws_, opt_.timeout);

  // High priority, as FSDP2's own communication streams: the few CTAs of a reduce-scatter
  // that compute waits for are scheduled ahead of that compute's queued CTAs.
  int least = 0, greatest = 0;
  TIDE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  TIDE_CUDA_CHECK(cudaStreamCreateWithPriority(&copy_, cudaStreamNonBlocking, greatest));
  TIDE_CUDA_CHECK(cudaStreamCreateWithPriority(&compute_, cudaStreamNonBlocking, greatest));
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_in_, cudaEventDisableTiming));
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_out_[0], cudaEventDisableTiming));
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_out_[1], cudaEventDisableTiming));
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&phase1_, cudaEventDisableTiming));
  slot_free_.assign(static_cast<size_t>(num_slots_), nullptr);
  for (auto& e : slot_free_) TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  // The control block: a memfd rank 0 creates and sends to every peer (nothing named, so
  // nothing outlives the processes), mapped shared by all, registered for the streams.
  control_bytes_ = kFlagStride * static_cast<size_t>(ws_) * (1 + kNumFlags * static_cast<size_t>(ws_));
  control_bytes_ = (control_bytes_ + 4095) / 4096 * 4096;
  {
    const uint64_t tag = std::hash<std::string>{}(ns_ + "/cuda/control");
    int fd = -1;
    if (rank_ == 0) {
      fd = ::memfd_create("tide-cuda-control", MFD_CLOEXEC);
      TIDE_CHECK(fd >= 0 && ::ftruncate(fd, static_cast<off_t>(control_bytes_)) == 0, "tide: cuda: rank 0: memfd for ",
                 control_bytes_, " bytes of flags failed: ", std::strerror(errno));
      for (int r = 1; r < ws_; ++r) fds_->send(r, tag, fd);
    } else {
      fd = fds_->receive(0, tag);
    }
    void* p = ::mmap(nullptr, control_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    TIDE_CHECK(p != MAP_FAILED, "tide: cuda: rank ", rank_, ": mapping the flags failed: ", std::strerror(errno));
    control_ = static_cast<std::byte*>(p);
    // Streams reach it only once registered; host-side flags need no registration.
    if (cudaHostRegister(control_, control_bytes_, cudaHostRegisterMapped | cudaHostRegisterPortable) == cudaSuccess) {
      control_registered_ = true;
      void* dev = nullptr;
      TIDE_CUDA_CHECK(cudaHostGetDevicePointer(&dev, control_, 0));
      control_dev_ = static_cast<std::byte*>(dev);
    } else {
      (void)cudaGetLastError();
      env::log(detail::concat("cuda: rank ", rank_, ": cannot register the flags for streams: host-side flags"));
      mode_ = SyncMode::host;
    }
  }
  // Staging only where peers can map it: on the nccl path the group serves no TIDE collective
  // (they raise, and python/tide/fsdp.py takes FSDP2's stock path over NCCL instead).
  if (ag_path_.path != AllGatherPath::nccl) {
    staging_ = allocate_symmetric(slot_bytes_ * static_cast<size_t>(num_slots_));
    staging_->owner_synchronizes();
  }

  if (mode_ == SyncMode::device) {
    // Stream memory operations on registered host memory: try once on our own inbox (zero).
    const Driver& drv = driver();
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    const CUdeviceptr word = device_address(inbox(rank_, kAgReady, rank_));
    cudaStream_t probe_stream = copy_;
    if (drv.cuStreamWriteValue32 && drv.cuStreamWaitValue32)
      r = drv.cuStreamWriteValue32(reinterpret_cast<CUstream>(probe_stream), word, 0, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r == CUDA_SUCCESS)
      r = drv.cuStreamWaitValue32(reinterpret_cast<CUstream>(probe_stream), word, 0, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) {
      TIDE_CUDA_CHECK(cudaStreamSynchronize(probe_stream));
    } else {
      const char* msg = nullptr;
      drv.cuGetErrorString(r, &msg);
      env::log(detail::concat("cuda: rank ", rank_, ": stream memory operations on host memory unavailable (",
                              msg ? msg : "?", "): host-side flags"));
      (void)cudaGetLastError();
      mode_ = SyncMode::host;
    }
  }
  barrier();
  env::log(detail::concat("cuda: rank ", rank_, "/", ws_, " on device ", device_, ": ", slot_bytes_, "-byte slots x ",
                          num_slots_, ", ", rs_ctas_, " accumulate CTAs, ",
                          mode_ == SyncMode::device ? "device" : "host", " flags, ",
                          vmm_ ? "vmm" : "ipc", " symmetric memory, streams at priority ", greatest,
                          ", all-gather path ", path_name(ag_path_.path)));
}

CudaGroup::~CudaGroup() {
  if (!broken_) {
    for (cudaStream_t st : {copy_, compute_})
      if (st && cudaStreamSynchronize(st) != cudaSuccess) (void)cudaGetLastError();
  }  // broken: every buffer handed out leaks (leak_if), a stream may still use it
  // The same order on every rank (the ipc buffers' destructors end with a store barrier).
  scratch_.reset();
  staging_.reset();
  if (broken_) return;  // streams may still wait on the flags: leave them to process exit
  // Allocations still outstanding keep their memory until freed (cudaMemPoolDestroy).
  if (transient_pool_ && cudaMemPoolDestroy(transient_pool_) != cudaSuccess) (void)cudaGetLastError();
  if (control_registered_ && cudaHostUnregister(control_) != cudaSuccess) (void)cudaGetLastError();
  if (control_) ::munmap(control_, control_bytes_);
  for (cudaEvent_t e : {ev_in_, ev_out_[0], ev_out_[1], phase1_})
    if (e) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : slot_free_)
    if (e) (void)cudaEventDestroy(e);
  for (cudaStream_t st : {copy_, compute_})
    if (st) (void)cudaStreamDestroy(st);
  (void)cudaGetLastError();
}

std::string CudaGroup::modes() const {
  return detail::concat("flags=", mode_ == SyncMode::device ? "device" : "host",
                        " copies=", batched_copies() ? "batched" : "single",
                        " memory=", vmm_ ? "vmm" : "ipc");
}

cudaMemPool_t CudaGroup::transient_pool() {
  if (!transient_pool_) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    TIDE_CUDA_CHECK(cudaMemPoolCreate(&transient_pool_, &props));
    uint64_t keep_all = UINT64_MAX;
    TIDE_CUDA_CHECK(cudaMemPoolSetAttribute(transient_pool_, cudaMemPoolAttrReleaseThreshold, &keep_all));
  }
  return transient_pool_;
}

std::shared_ptr<CudaSymmetricBuffer> CudaGroup::allocate_symmetric(size_t bytes) {
  TIDE_CHECK(!broken_, "tide: cuda: rank ", rank_, ": group unusable after an earlier failure: ", broken_why());
  auto b = CudaSymmetricBuffer::allocate(store_, ns_ + "/cuda/sym/" + std::to_string(alloc_seq_++), rank_, ws_,
                                         bytes, opt_.timeout, vmm_ ? fds_.get() : nullptr, opt_.across_nodes);
  b->leak_if(broken_shared_);
  return b;
}

void CudaGroup::barrier() {
  store_barrier(*store_, ns_ + "/cuda/barrier/" + std::to_string(barrier_seq_++), ws_, opt_.timeout, rank_);
}

const plan::GroupLayout& CudaGroup::checked_layout(const plan::GroupLayout* layout, const char* collective) const {
  TIDE_CHECK(layout, "tide: cuda: ", collective, " on rank ", rank_, ": no layout");
  TIDE_CHECK(ag_path_.path != AllGatherPath::nccl, "tide: cuda: ", collective, " on rank ", rank_,
             ": the group's GPUs cannot map each other's memory (", ag_path_.reason, "); use NCCL");
  TIDE_CHECK(layout->world_size == ws_, "tide: cuda: ", collective, " on rank ", rank_, ": layout for world size ",
             layout->world_size, ", group has ", ws_);
  return *layout;
}

std::byte* CudaGroup::slot(int rank, int index) {
  return staging_->peer(rank) + static_cast<size_t>(index) * slot_bytes_;
}

CudaSymmetricBuffer& CudaGroup::scratch(size_t bytes) {
  if (!scratch_ || scratch_->bytes(rank_) < bytes) {
    // Every rank asks for the same size at the same call, so all reallocate together. Our
    // streams are idle first: no queued copy still reads the old scratch.
    TIDE_CUDA_CHECK(cudaStreamSynchronize(copy_));
    TIDE_CUDA_CHECK(cudaStreamSynchronize(compute_));
    scratch_.reset();
    const size_t mib = size_t(1) << 20;
    scratch_ = allocate_symmetric((bytes + mib - 1) / mib * mib);
    scratch_->owner_synchronizes();  // only our streams use it; synced above and at teardown
  }
  return *scratch_;
}

std::atomic<uint32_t>& CudaGroup::inbox(int receiver, FlagId f, int sender) const {
  const size_t line = static_cast<size_t>(ws_) + (static_cast<size_t>(receiver) * kNumFlags + f) * ws_ + sender;
  return *reinterpret_cast<std::atomic<uint32_t>*>(control_ + line * kFlagStride);
}

CUdeviceptr CudaGroup::device_address(const std::atomic<uint32_t>& word) const {
  return reinterpret_cast<CUdeviceptr>(control_dev_ + (reinterpret_cast<const std::byte*>(&word) - control_));
}

std::atomic<uint32_t>& CudaGroup::poison(int rank) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(control_ + static_cast<size_t>(rank) * kFlagStride);
}

int CudaGroup::peer_failed() const {
  for (int r = 0; r < ws_; ++r)
    if (r != rank_ && poison(r).load(std::memory_order_acquire)) return r;
  return -1;
}

void CudaGroup::post(cudaStream_t stream, FlagId f, uint64_t counter) {
  const uint32_t value = static_cast<uint32_t>(counter);
  if (broken_) throw Error(detail::concat("tide: cuda: rank ", rank_, ": ", collective_, ": ", broken_why()));
  if (mode_ == SyncMode::device) {
    for (int p = 0; p < ws_; ++p) {
      if (p == rank_) continue;
      const CUdeviceptr word = device_address(inbox(p, f, rank_));
      TIDE_CU_CHECK(driver().cuStreamWriteValue32(reinterpret_cast<CUstream>(stream), word, value,
                                                  CU_STREAM_WRITE_VALUE_DEFAULT));
    }
    return;
  }
  host_wait_stream(stream, flag_name(f));
  for (int p = 0; p < ws_; ++p)
    if (p != rank_) inbox(p, f, rank_).store(value, std::memory_order_release);
}

void CudaGroup::wait(cudaStream_t stream, int peer, FlagId f, uint64_t counter) {
  const uint32_t value = static_cast<uint32_t>(counter);
  std::atomic<uint32_t>& word = inbox(rank_, f, peer);
  if (mode_ == SyncMode::device) {
    // No lock against abort(): enqueueing may block while the stream's queue is full, and
    // only an abort would drain it. Instead: epochs advance (next) before their waits, and
    // abort reads them after setting broken_, so a wait enqueued before broken_ was seen
    // is covered by abort's release, and one that races it is released here.
    if (broken_) throw Error(detail::concat("tide: cuda: rank ", rank_, ": ", collective_, ": ", broken_why()));
    TIDE_CU_CHECK(driver().cuStreamWaitValue32(reinterpret_cast<CUstream>(stream), device_address(word), value,
                                               CU_STREAM_WAIT_VALUE_GEQ));
    if (broken_) release_own_waits();
    return;
  }
  auto nap = std::chrono::microseconds(20);
  for (;;) {
    const uint32_t have = word.load(std::memory_order_acquire);
    if (reached(have, value)) return;
    if (broken_) fail("the group was aborted");
    if (const int r = peer_failed(); r >= 0) fail(detail::concat("rank ", r, " aborted"));
    if (std::chrono::steady_clock::now() > deadline())
      fail(detail::concat("waiting for rank ", peer, "'s ", flag_name(f), " >= ", value, " (it is ", have, ")"));
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::milliseconds(1)) nap *= 2;
  }
}

std::string CudaGroup::flags_report() const {
  std::string s;
  for (int r = 0; r < ws_; ++r) {
    s += detail::concat(" rank ", r, poison(r).load() ? " (aborted)" : "", " received:");
    for (uint32_t f = 0; f < kNumFlags; ++f) {
      s += detail::concat(" ", flag_name(static_cast<FlagId>(f)), "=[");
      for (int p = 0; p < ws_; ++p)
        s += detail::concat(p ? "," : "", p == r ? std::string("-") : std::to_string(inbox(r, static_cast<FlagId>(f), p).load()));
      s += "]";
    }
    s += ";";
  }
  s += detail::concat(" rank ", rank_, " expects:");
  for (uint32_t f = 0; f < kNumFlags; ++f) s += detail::concat(" ", flag_name(static_cast<FlagId>(f)), "=", epoch_[f].load());
  // The reduce-scatter's window in flight stages in slot (rs_ready epoch) % slots.
  s += detail::concat("; reduce-scatter step ", epoch_[kRsReady].load(), " in staging slot ",
                      epoch_[kRsReady].load() % static_cast<uint64_t>(std::max(num_slots_, 1)), " of ", num_slots_);
  return s;
}

std::chrono::steady_clock::time_point CudaGroup::deadline() const { return started_ + opt_.timeout; }

void CudaGroup::fail(const std::string& why) {
  std::string what = detail::concat("tide: cuda: ", collective_, " on rank ", rank_, " of ", ws_, " failed after ",
                                    std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::steady_clock::now() - started_).count(),
                                    " ms (timeout ", opt_.timeout.count(), " ms): ", why);
  {
    std::lock_guard<std::mutex> lock(why_mutex_);
    if (broken_why_.empty()) broken_why_ = what;
  }
  broken_ = true;
  broken_shared_->store(true);
  poison(rank_).store(1, std::memory_order_release);  // peers stop rather than read our garbage
  const std::string report = flags_report();
  release_own_waits();  // our streams must not stay stuck behind this failure
  throw TimeoutError(what + "; flags:" + report);
}

std::string CudaGroup::broken_why() const {
  std::lock_guard<std::mutex> lock(why_mutex_);
  return broken_why_;
}

void CudaGroup::release_own_waits() {
  // Our waits are for "inbox >= our epoch" (cyclic): half the counter space ahead of the
  // epoch satisfies every wait issued so far, whatever a late peer post wrote meanwhile.
  for (uint32_t f = 0; f < kNumFlags; ++f) {
    const uint32_t ahead = static_cast<uint32_t>(epoch_[f].load()) + (1u << 30);
    for (int p = 0; p < ws_; ++p)
      if (p != rank_) inbox(rank_, static_cast<FlagId>(f), p).store(ahead, std::memory_order_release);
  }
}

void CudaGroup::abort(const std::string& why) {
  if (!broken_.exchange(true)) {  // seq_cst: waits enqueued after this see it (wait())
    broken_shared_->store(true);
    poison(rank_).store(1, std::memory_order_release);
    std::string what = detail::concat("tide: cuda: rank ", rank_, " of ", ws_, ": ", why, "; flags:", flags_report());
    {
      std::lock_guard<std::mutex> w(why_mutex_);
      if (broken_why_.empty()) broken_why_ = what;
    }
    std::fprintf(stderr, "[tide] %s\n", what.c_str());  // always: like NCCL's watchdog
  }
  release_own_waits();
}

void CudaGroup::host_wait_stream(cudaStream_t s, const char* what) {
  TIDE_CUDA_CHECK(cudaEventRecord(ev_out_[0], s));
  auto nap = std::chrono::microseconds(5);
  for (;;) {
    if (event_done(ev_out_[0])) return;
    if (std::chrono::steady_clock::now() > deadline())
      fail(detail::concat("stream work before '", what, "' did not finish (a peer's flag never arrived?)"));
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::microseconds(500)) nap *= 2;
  }
}

void CudaGroup::begin(const char* collective, cudaStream_t caller, std::initializer_list<cudaStream_t> work) {
  TIDE_CHECK(!broken_, "tide: cuda: rank ", rank_, ": ", collective, ": group unusable after an earlier failure: ",
             broken_why());
  if (const int r = peer_failed(); r >= 0) {
    collective_ = collective;
    fail(detail::concat("rank ", r, " aborted the group earlier"));
  }
  collective_ = collective;
  started_ = std::chrono::steady_clock::now();
  TIDE_CUDA_CHECK(cudaSetDevice(device_));
  TIDE_CUDA_CHECK(cudaEventRecord(ev_in_, caller));
  for (cudaStream_t w : work) TIDE_CUDA_CHECK(cudaStreamWaitEvent(w, ev_in_, 0));
}

void CudaGroup::end(cudaStream_t caller, std::initializer_list<cudaStream_t> work) {
  TIDE_CHECK(work.size() <= 2, "tide: cuda: at most two work streams");
  int i = 0;
  for (cudaStream_t w : work) {
    TIDE_CUDA_CHECK(cudaEventRecord(ev_out_[i], w));
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(caller, ev_out_[i], 0));
    ++i;
  }
  if (!opt_.blocking) return;
  auto nap = std::chrono::microseconds(5);
  for (int k = 0; k < i; ++k) {
    for (;;) {
      if (event_done(ev_out_[k])) break;
      if (const int r = peer_failed(); r >= 0) fail(detail::concat("rank ", r, " aborted"));
      if (std::chrono::steady_clock::now() > deadline()) fail("the collective's streams did not finish");
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::microseconds(500)) nap *= 2;
    }
  }
}

}  // namespace tide::cuda
