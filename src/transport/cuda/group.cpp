// CudaGroup: streams, symmetric control flags and staging of one rank (see group.hpp).
#include "tide/cuda/group.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "../../core/env.hpp"
#include "tide/cuda/check.hpp"
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
  TIDE_CHECK(want != "vmm" || vmm_here, "tide: cuda: rank ", rank_, ": TIDE_CUDA_SYMMETRIC=vmm but device ", device_,
             " lacks virtual memory management with POSIX fd handles");
  const std::string dkey = ns_ + "/cuda/device/";
  store_->set(dkey + std::to_string(rank_),
              std::vector<uint8_t>{static_cast<uint8_t>(device_), static_cast<uint8_t>(vmm_here)});
  std::vector<int> devices(ws_);
  bool vmm_everywhere = true;
  for (int r = 0; r < ws_; ++r) {
    std::vector<uint8_t> v = store_->get(dkey + std::to_string(r), opt_.timeout);
    TIDE_CHECK(v.size() == 2, "tide: cuda: rank ", rank_, ": bad device record of rank ", r);
    devices[r] = v[0];
    vmm_everywhere = vmm_everywhere && v[1];
  }
  ag_path_ = choose_allgather_path(caps_, devices);
  // The same decision on every rank: it depends only on what all ranks published.
  if (want != "ipc" && vmm_everywhere) fds_ = std::make_unique<FdChannel>(*store_, ns_ + "/cuda", rank_, ws_, opt_.timeout);

  opt_.staging_bytes = opt_.staging_bytes ? opt_.staging_bytes : env::get_bytes("TIDE_CUDA_STAGING_BYTES", 32u << 20);
  rs_ctas_ = opt_.rs_ctas > 0 ? opt_.rs_ctas : static_cast<int>(env::get_int("TIDE_RS_CTAS", 8));
  TIDE_CHECK(rs_ctas_ >= 1 && rs_ctas_ <= 1024, "tide: TIDE_RS_CTAS=", rs_ctas_, " out of [1, 1024]");
  num_slots_ = opt_.num_slots;
  piece_bytes_ = opt_.staging_bytes / static_cast<size_t>(num_slots_) / static_cast<size_t>(ws_) / 256 * 256;
  TIDE_CHECK(piece_bytes_ >= 256, "tide: cuda: rank ", rank_, ": staging of ", opt_.staging_bytes, " bytes is too small for ",
             num_slots_, " slots x ", ws_, " ranks x 256 bytes");
  slot_bytes_ = piece_bytes_ * static_cast<size_t>(ws_);

  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&abort_stream_, cudaStreamNonBlocking));
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_in_, cudaEventDisableTiming));
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_out_[0], cudaEventDisableTiming));
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_out_[1], cudaEventDisableTiming));

  control_ = allocate_symmetric(kNumFlags * kFlagStride);
  staging_ = allocate_symmetric(slot_bytes_ * static_cast<size_t>(num_slots_));

  if (mode_ == SyncMode::device) {
    // Stream memory operations on IPC-mapped memory: try once on our own (still zero) flag.
    const Driver& drv = driver();
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    if (drv.cuStreamWriteValue32 && drv.cuStreamWaitValue32) r = driver().cuStreamWriteValue32(reinterpret_cast<CUstream>(side_),
                                      reinterpret_cast<CUdeviceptr>(control_->local()), 0, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r == CUDA_SUCCESS) r = driver().cuStreamWaitValue32(reinterpret_cast<CUstream>(side_),
                                                   reinterpret_cast<CUdeviceptr>(control_->local()), 0,
                                                   CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) {
      TIDE_CUDA_CHECK(cudaStreamSynchronize(side_));
    } else {
      const char* s = nullptr;
      driver().cuGetErrorString(r, &s);
      env::log(detail::concat("cuda: rank ", rank_, ": stream memory operations unavailable (", s ? s : "?",
                              "): host-side flags"));
      (void)cudaGetLastError();
      mode_ = SyncMode::host;
    }
  }
  barrier();
  env::log(detail::concat("cuda: rank ", rank_, "/", ws_, " on device ", device_, ": ", slot_bytes_, "-byte slots x ",
                          num_slots_, ", ", rs_ctas_, " accumulate CTAs, ",
                          mode_ == SyncMode::device ? "device" : "host", " flags, ",
                          fds_ ? "vmm" : "ipc", " symmetric memory, all-gather path ", path_name(ag_path_.path)));
}

CudaGroup::~CudaGroup() {
  if (!broken_) {
    for (cudaStream_t s : {copy_, compute_, side_})
      if (s && cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
  } else {
    for (auto* b : {scratch_.get(), staging_.get(), control_.get()})
      if (b) b->leak_on_destroy();
  }
  // The same order on every rank: each destructor ends with a store barrier.
  scratch_.reset();
  staging_.reset();
  control_.reset();
  if (broken_) return;  // streams may still wait on peers' flags: leave them to process exit
  for (cudaEvent_t e : {ev_in_, ev_out_[0], ev_out_[1]})
    if (e) (void)cudaEventDestroy(e);
  for (cudaStream_t s : {copy_, compute_, side_, abort_stream_})
    if (s) (void)cudaStreamDestroy(s);
  (void)cudaGetLastError();
}

std::shared_ptr<CudaSymmetricBuffer> CudaGroup::allocate_symmetric(size_t bytes) {
  TIDE_CHECK(!broken_, "tide: cuda: rank ", rank_, ": group unusable after an earlier failure: ", broken_why());
  return CudaSymmetricBuffer::allocate(store_, ns_ + "/cuda/sym/" + std::to_string(alloc_seq_++), rank_, ws_, bytes,
                                       opt_.timeout, fds_.get());
}

void CudaGroup::barrier() {
  store_barrier(*store_, ns_ + "/cuda/barrier/" + std::to_string(barrier_seq_++), ws_, opt_.timeout, rank_);
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
  }
  return *scratch_;
}

void CudaGroup::post(cudaStream_t stream, FlagId f, uint32_t value) {
  std::byte* addr = control_->local() + f * kFlagStride;
  if (mode_ == SyncMode::device) {
    TIDE_CU_CHECK(driver().cuStreamWriteValue32(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value,
                                       CU_STREAM_WRITE_VALUE_DEFAULT));
    return;
  }
  host_wait_stream(stream, flag_name(f));
  TIDE_CUDA_CHECK(cudaMemcpyAsync(addr, &value, sizeof value, cudaMemcpyHostToDevice, side_));
  TIDE_CUDA_CHECK(cudaStreamSynchronize(side_));
}

void CudaGroup::wait(cudaStream_t stream, int peer, FlagId f, uint32_t value) {
  std::byte* addr = control_->peer(peer) + f * kFlagStride;
  if (mode_ == SyncMode::device) {
    TIDE_CU_CHECK(driver().cuStreamWaitValue32(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value,
                                      CU_STREAM_WAIT_VALUE_GEQ));
    return;
  }
  auto nap = std::chrono::microseconds(20);
  for (;;) {
    const uint32_t have = read_flag(peer, f);
    if (reached(have, value)) return;
    if (std::chrono::steady_clock::now() > deadline())
      fail(detail::concat("waiting for rank ", peer, "'s ", flag_name(f), " >= ", value, " (it is ", have, ")"));
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::milliseconds(1)) nap *= 2;
  }
}

uint32_t CudaGroup::read_flag(int rank, FlagId f) {
  uint32_t v = 0;
  TIDE_CUDA_CHECK(cudaMemcpyAsync(&v, control_->peer(rank) + f * kFlagStride, sizeof v, cudaMemcpyDeviceToHost, side_));
  TIDE_CUDA_CHECK(cudaStreamSynchronize(side_));
  return v;
}

std::string CudaGroup::flags_report() {
  std::string s;
  for (int r = 0; r < ws_; ++r) {
    s += detail::concat(" rank ", r, ":");
    for (uint32_t f = 0; f < kNumFlags; ++f) {
      try {
        s += detail::concat(" ", flag_name(static_cast<FlagId>(f)), "=", read_flag(r, static_cast<FlagId>(f)));
      } catch (const std::exception&) {
        s += " (unreadable)";
        break;
      }
    }
    s += ";";
  }
  s += " expected:";
  for (uint32_t f = 0; f < kNumFlags; ++f) s += detail::concat(" ", flag_name(static_cast<FlagId>(f)), "=", epoch_[f]);
  return s;
}

std::chrono::steady_clock::time_point CudaGroup::deadline() const { return started_ + opt_.timeout; }

void CudaGroup::fail(const std::string& why) {
  std::string what = detail::concat("tide: cuda: ", collective_, " on rank ", rank_, " of ", ws_, " timed out after ",
                                    opt_.timeout.count(), " ms: ", why);
  {
    std::lock_guard<std::mutex> lock(why_mutex_);
    broken_why_ = what;
  }
  broken_ = true;
  const std::string report = flags_report();
  throw TimeoutError(what + "; flags:" + report);
}

std::string CudaGroup::broken_why() const {
  std::lock_guard<std::mutex> lock(why_mutex_);
  return broken_why_;
}

void CudaGroup::abort(const std::string& why) {
  if (broken_.exchange(true)) return;
  std::string report;
  try {
    report = flags_report();
  } catch (const std::exception&) {
    report = " (unreadable)";
  }
  {
    std::lock_guard<std::mutex> lock(why_mutex_);
    broken_why_ = detail::concat("tide: cuda: rank ", rank_, " of ", ws_, ": ", why, "; flags:", report);
  }
  std::fprintf(stderr, "[tide] %s\n", broken_why().c_str());  // always: like NCCL's watchdog
  // Our streams wait for peer flag >= our own epoch of that flag (cyclic compare): writing
  // the epoch there releases every wait issued so far.
  if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  uint32_t values[kNumFlags];  // pageable: each copy is staged before cudaMemcpyAsync returns
  for (uint32_t f = 0; f < kNumFlags; ++f) values[f] = epoch_[f].load();
  for (int r = 0; r < ws_; ++r) {
    if (r == rank_) continue;
    for (uint32_t f = 0; f < kNumFlags; ++f) {
      std::byte* addr = control_->peer(r) + f * kFlagStride;
      if (cudaMemcpyAsync(addr, &values[f], sizeof(uint32_t), cudaMemcpyHostToDevice, abort_stream_) != cudaSuccess)
        (void)cudaGetLastError();  // a dead peer's mapping may be gone: nothing to release then
    }
  }
  if (cudaStreamSynchronize(abort_stream_) != cudaSuccess) (void)cudaGetLastError();
}

void CudaGroup::host_wait_stream(cudaStream_t s, const char* what) {
  TIDE_CUDA_CHECK(cudaEventRecord(ev_out_[0], s));
  auto nap = std::chrono::microseconds(5);
  for (;;) {
    cudaError_t e = cudaEventQuery(ev_out_[0]);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) TIDE_CUDA_CHECK(e);
    if (std::chrono::steady_clock::now() > deadline())
      fail(detail::concat("stream work before '", what, "' did not finish (a peer's flag never arrived?)"));
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::microseconds(500)) nap *= 2;
  }
}

void CudaGroup::begin(const char* collective, cudaStream_t caller, std::initializer_list<cudaStream_t> work) {
  TIDE_CHECK(!broken_, "tide: cuda: rank ", rank_, ": ", collective, ": group unusable after an earlier failure: ",
             broken_why());
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
      cudaError_t e = cudaEventQuery(ev_out_[k]);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) TIDE_CUDA_CHECK(e);
      if (std::chrono::steady_clock::now() > deadline()) fail("the collective's streams did not finish");
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::microseconds(500)) nap *= 2;
    }
  }
}

}  // namespace tide::cuda
