#include "CudaPath.hpp"

#include <cstring>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "../../core/env.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"
#include "tide/cuda/probe.hpp"
#include "tide/error.hpp"
#include "tide/hash.hpp"

namespace tide::torch_backend {
namespace {

std::shared_ptr<void> make_event() {
  cudaEvent_t ev = nullptr;
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return std::shared_ptr<void>(ev, [](void* e) {
    if (cudaEventDestroy(static_cast<cudaEvent_t>(e)) != cudaSuccess) (void)cudaGetLastError();
  });
}

[[noreturn]] void raise_failed(const std::string& why) { C10_THROW_ERROR(DistBackendError, why); }

// A collective's Work on CUDA: completion is an event on the issuing stream.
class WorkTideCuda : public c10d::Work {
 public:
  WorkTideCuda(c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
               std::shared_ptr<void> event, int device, std::shared_ptr<CudaPath::Health> health)
      : c10d::Work(-1, type, title),
        outputs_(std::move(outputs)),
        event_(std::move(event)),
        device_(device),
        health_(std::move(health)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()),
            std::vector<c10::Device>{c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))})) {
    // A CUDA-aware future: completing it now, on the issuing stream, records events there,
    // and its wait() makes the waiter's current stream wait for them (as WorkNCCL's).
    future_->markCompleted(c10::IValue(outputs_));
    finish();  // the host side is done: ends the profiler's record of the call
  }
  bool isCompleted() override { return !health_->get().empty() || tide::cuda::event_done(static_cast<cudaEvent_t>(event_.get())); }
  bool isSuccess() const override { return health_->get().empty(); }
  std::exception_ptr exception() const override {
    const std::string e = health_->get();
    return e.empty() ? nullptr : std::make_exception_ptr(std::runtime_error(e));
  }
  bool wait(std::chrono::milliseconds) override {
    if (const std::string e = health_->get(); !e.empty()) raise_failed(e);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream(),
        static_cast<cudaEvent_t>(event_.get()), 0));
    return true;
  }
  void synchronize() override { wait(kNoTimeout); }
  void blockCurrentStream() override { wait(kNoTimeout); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<void> event_;
  int device_;
  std::shared_ptr<CudaPath::Health> health_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// What every rank must agree on before a collective is enqueued.
struct Fingerprint {
  char collective[24];
  uint64_t seq;
  uint64_t layout_hash;
  uint64_t numel;  // elements of all parameters
  uint32_t params;
  int32_t world_size;
  int32_t op;  // reduce op, -1 for the all-gather
  uint8_t from, to;
  uint8_t pad[2];
};
static_assert(sizeof(Fingerprint) == 64);

// The other arguments peers rely on (shard offsets: peers read at this rank's offsets;
// Slot-Reuse regions: peers read staging there).
template <class Range>
uint64_t hash_values(const Range& values) {
  uint64_t h = tide::kFnvBasis;
  for (const auto& v : values) h = tide::fnv(h, static_cast<uint64_t>(v));
  return h;
}

std::string describe(const Fingerprint& f) {
  return tide::detail::concat(std::string(f.collective, strnlen(f.collective, sizeof f.collective)), " #", f.seq,
                              " (", f.params, " params, ", f.numel, " elements, ",
                              tide::dtype_name(static_cast<tide::DType>(f.from)), " -> ",
                              tide::dtype_name(static_cast<tide::DType>(f.to)), ", world size ", f.world_size,
                              f.op >= 0 ? tide::detail::concat(", reduce op ", f.op) : std::string(), ")");
}

}  // namespace

CudaPath::CudaPath(std::shared_ptr<tide::Store> store, std::string ns, int rank, int world_size,
                   std::function<std::chrono::milliseconds()> timeout, AllGatherBytes all_gather_bytes,
                   std::optional<Nodes> nodes)
    : store_(std::move(store)),
      ns_(std::move(ns)),
      rank_(rank),
      ws_(world_size),
      timeout_(std::move(timeout)),
      all_gather_bytes_(std::move(all_gather_bytes)),
      nodes_(std::move(nodes)) {
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

CudaPath::~CudaPath() {
  // Let the watchdog see the collectives in flight to their end (or abort the group at
  // their deadline) before the group is destroyed: its destructor waits for its streams.
  const auto deadline = std::chrono::steady_clock::now() + timeout_() + std::chrono::seconds(5);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (pending_.empty() || (group_ && group_->broken())) break;  // broken: it leaks, no wait
      if (std::chrono::steady_clock::now() > deadline) {  // a wedged device: leak, do not hang
        group_->abort("destroyed with collectives that never completed");
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
  // A broken group's streams may still be on their way into the windows: keep them.
  if (wire_ && (!health_->get().empty() || (group_ && group_->broken()))) wire_->leak_windows();
  // The engines before the group: the buffers they keep after a failure are freed in the
  // order of the group's streams and its memory pool.
  puts_.reset();
  wire_.reset();
  engine_.reset();
  // group_ goes last: healthy, it waits for its streams and frees its memory (ipc: together
  // with the peers); broken, it leaks what a stream may still use.
}

tide::cuda::CudaGroup& CudaPath::group(int device, const char* collective) {
  if (const std::string e = health_->get(); !e.empty()) raise_failed(e);
  if (!group_) {
    tide::cuda::CudaGroupOptions options;
    options.timeout = timeout_();
    options.blocking = false;  // stream-ordered; the watchdog enforces the timeout
    options.across_nodes = nodes_.has_value();
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) (void)cudaGetLastError();
    // Across nodes the CUDA group is this rank's node: its ranks map each other's memory.
    std::unique_ptr<tide::cuda::CudaGroup> created;
    if (nodes_) {
      const tide::plan::Topology& t = nodes_->topology;
      created = std::make_unique<tide::cuda::CudaGroup>(store_, ns_ + "/node" + std::to_string(t.node_of(rank_)),
                                                        t.local_rank(rank_), t.local_size, device, options);
      engine_ = std::make_unique<NcclEngine>(nodes_->nccl, device);
      // NCCL makes its communicator at the first call, with every rank in it; a rank with
      // nothing to move in its first exchange would skip it and leave the others waiting.
      // So every rank calls once here, at group creation (itself collective).
      c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));
      std::vector<at::Tensor> one{at::zeros({1}, at::TensorOptions().device(at::kCUDA, device))};
      nodes_->nccl->allreduce(one)->wait();
      TIDE_CUDA_CHECK(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()));
      choose_one_sided(device);
    } else {
      created = std::make_unique<tide::cuda::CudaGroup>(store_, ns_, rank_, ws_, device, options);
    }
    if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);  // the caller's, as it was
    std::lock_guard<std::mutex> lock(mutex_);  // the watchdog reads group_
    group_ = std::move(created);
  }
  TORCH_CHECK(group_->device() == device, "tide ", collective, ": rank ", rank_, ": tensors on cuda:", device,
              " but this group's CUDA collectives run on cuda:", group_->device(),
              " (one device per rank and process group)");
  group_->set_timeout(timeout_());  // its host-side waits, where stream memory operations are missing
  return *group_;
}

void CudaPath::choose_one_sided(int device) {
  const std::string why = NcclOneSided::why_not(*nodes_->nccl, device);
  // Every rank or none: a put meets no receive, and a receive no put.
  const auto all = all_gather_bytes_(std::vector<uint8_t>{static_cast<uint8_t>(why.empty())});
  int refusing = -1;
  for (int r = 0; r < static_cast<int>(all.size()) && refusing < 0; ++r)
    if (all[r].empty() || all[r][0] == 0) refusing = r;
  if (refusing < 0) {
    wire_ = std::make_unique<NcclOneSided>(nodes_->nccl, device, rank_);
    puts_ = std::make_unique<tide::OneSidedEngine>(*wire_, *engine_, rank_, "nccl one-sided");
    one_sided_handshake();
  } else {
    one_sided_why_ = refusing == rank_ ? why
                                       : tide::detail::concat("rank ", refusing, " cannot (TIDE_DEBUG there says why)");
  }
  TORCH_CHECK(puts_ || tide::env::get_string("TIDE_NCCL_ONE_SIDED", "auto") != "1", "tide: rank ", rank_,
              ": TIDE_NCCL_ONE_SIDED=1, but no one-sided puts between the nodes: ", one_sided_why_);
  tide::env::log(tide::detail::concat("cuda: rank ", rank_, ": inter-node TIDE-AG over ", engine_description()));
}

void CudaPath::one_sided_handshake() {
  // A ring along this rank's rail: NCCL's first one-sided call on a communicator sets up its
  // copy-engine path collectively (every rank's first call waits for the others'), so it
  // happens here, at group creation, rather than inside some rank's first all-gather; and a
  // wire that cannot deliver fails here, loudly, before training depends on it. On a stream
  // of its own (left behind if it never completes), waited for with the group's timeout.
  const tide::plan::Topology& t = nodes_->topology;
  const int node = t.node_of(rank_), local = t.local_rank(rank_);
  const int to = t.rank_of((node + 1) % t.num_nodes, local), from = t.rank_of((node + t.num_nodes - 1) % t.num_nodes, local);
  cudaStream_t s = nullptr;
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  wire_->bind(s);
  puts_->handshake(std::span<const int>(&to, 1), std::span<const int>(&from, 1));
  const std::chrono::milliseconds timeout = timeout_();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!tide::cuda::stream_done(s)) {
    if (std::chrono::steady_clock::now() > deadline) {
      C10_THROW_ERROR(DistBackendError,
                      tide::detail::concat("tide: cuda: rank ", rank_, ": NCCL's one-sided handshake with ranks ", to,
                                           " and ", from, " did not complete within ", timeout.count(),
                                           " ms (TIDE_NCCL_ONE_SIDED=0 uses send/recv instead)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  TIDE_CUDA_CHECK(cudaStreamDestroy(s));
}

tide::Engine& CudaPath::all_gather_engine(const std::shared_ptr<tide::SymmetricBuffer>& home) {
  if (!puts_) return *engine_;
  TORCH_CHECK(wire_->same_communicator(), "tide param_all_gather: rank ", rank_,
              ": the NCCL delegate's communicator was aborted or replaced since the one-sided window was made");
  // The window is registered at the first all-gather into this memory, on every rank at
  // once (the pool is the same program everywhere); a rank NCCL gave no window (or an
  // error) makes every rank go on over send-recv.
  const int windows = wire_->windows();
  bool ok = false;
  std::string error;
  try {
    ok = wire_->ensure_window(home, home->bytes(nodes_->topology.local_rank(rank_)));
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (ok && wire_->windows() == windows) return *puts_;  // known before: no rank registered anew
  const auto all = all_gather_bytes_(std::vector<uint8_t>{static_cast<uint8_t>(ok)});
  for (int r = 0; r < static_cast<int>(all.size()); ++r)
    if (all[r].empty() || all[r][0] == 0) {
      one_sided_why_ = r == rank_ ? tide::detail::concat("NCCL registered no window here", error.empty() ? "" : ": ", error)
                                  : tide::detail::concat("NCCL registered no window on rank ", r);
      tide::env::log(tide::detail::concat("cuda: rank ", rank_, ": one-sided puts off: ", one_sided_why_));
      puts_.reset();  // nothing in flight between collectives
      return *engine_;
    }
  return *puts_;
}

std::pair<std::string, std::string> CudaPath::path_choice(int device) {
  const auto& choice = group(device, "path_choice").allgather_path();
  return {tide::cuda::path_name(choice.path), choice.reason};
}

std::pair<size_t, int> CudaPath::staging_geometry(int device) {
  auto& g = group(device, "staging_geometry");
  return {g.slot_bytes(), g.num_slots()};
}

std::shared_ptr<tide::SymmetricBuffer> CudaPath::allocate_symmetric(size_t bytes, int device) {
  auto& g = group(device, "allocate_symmetric");  // first: it probes for a device
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return g.allocate_symmetric(bytes);
}

void CudaPath::check_across_ranks(const char* collective, const tide::plan::GroupLayout& layout,
                                  tide::DType from, tide::DType to, int op, uint64_t extra, bool required) {
  static const bool enabled = tide::env::get_int("TIDE_CUDA_CHECK_ARGS", 1) != 0;
  if (!enabled && !required) {
    ++seq_;
    return;
  }
  Fingerprint mine{};
  std::strncpy(mine.collective, collective, sizeof mine.collective - 1);
  mine.seq = seq_++;
  mine.layout_hash = tide::fnv(tide::plan::layout_hash(layout), extra);
  for (const auto& p : layout.params) mine.numel += static_cast<uint64_t>(p.numel);
  mine.params = static_cast<uint32_t>(layout.params.size());
  mine.world_size = layout.world_size;
  mine.op = op;
  mine.from = static_cast<uint8_t>(from);
  mine.to = static_cast<uint8_t>(to);
  std::vector<uint8_t> bytes(sizeof mine);
  std::memcpy(bytes.data(), &mine, sizeof mine);
  std::vector<std::vector<uint8_t>> all;
  try {
    all = all_gather_bytes_(bytes);
  } catch (const c10::Error& e) {  // a dead or silent peer: name the collective it failed
    raise_failed(tide::detail::concat("tide ", collective, ": rank ", rank_, ": checking the ranks' arguments: ",
                                      e.what_without_backtrace()));
  } catch (const std::exception& e) {
    raise_failed(tide::detail::concat("tide ", collective, ": rank ", rank_, ": checking the ranks' arguments: ",
                                      e.what()));
  }
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == bytes) continue;
    Fingerprint theirs{};
    std::memcpy(&theirs, all[r].data(), std::min(all[r].size(), sizeof theirs));
    const bool same_shape = std::memcmp(theirs.collective, mine.collective, sizeof mine.collective) == 0 &&
                            theirs.numel == mine.numel && theirs.params == mine.params;
    TORCH_CHECK(false, "tide ", collective, ": rank ", rank_, ": the ranks' calls do not match: rank ", r,
                " called ", describe(theirs), ", rank ", rank_, " called ", describe(mine),
                same_shape ? " (same sizes, different sharding or placement)" : "");
  }
}

c10::intrusive_ptr<c10d::Work> CudaPath::finish(const char* collective, c10d::OpType type,
                                                std::vector<at::Tensor> outputs, int device) {
  auto event = make_event();
  TIDE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event.get()),
                                  c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::chrono::milliseconds timeout = timeout_();
    pending_.push_back({event, std::chrono::steady_clock::now() + timeout, timeout,
                        tide::detail::concat(collective, " #", seq_ - 1)});
  }
  cv_.notify_one();
  return c10::make_intrusive<WorkTideCuda>(type, collective, std::move(outputs), std::move(event), device, health_);
}

c10::intrusive_ptr<c10d::Work> CudaPath::param_all_gather(const tide::ParamAllGather& args,
                                                          std::vector<at::Tensor> outputs, int device) {
  TORCH_CHECK(!nodes_, "tide param_all_gather: rank ", rank_, ": the group spans nodes (param_all_gather_across_nodes)");
  auto& g = group(device, "param_all_gather");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_across_ranks("param_all_gather", *args.layout, args.shard_dtype, args.storage_dtype, -1,
                     hash_values(args.shard_offsets));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  guarded("param_all_gather", [&] { tide::cuda::param_all_gather(g, args, stream); });
  if (tide::env::debug())
    tide::env::log(tide::detail::concat("cuda: rank ", rank_, ": param_all_gather #", seq_ - 1, ": ",
                                        args.layout->params.size(), " params over copy engines"));
  return finish("tide:param_all_gather", c10d::OpType::ALLGATHER, std::move(outputs), device);
}

c10::intrusive_ptr<c10d::Work> CudaPath::param_all_gather_across_nodes(const tide::ParamAllGather& args,
                                                                       const std::shared_ptr<tide::SymmetricBuffer>& home,
                                                                       const std::vector<size_t>& storage_offsets,
                                                                       std::vector<at::Tensor> outputs, int device) {
  TORCH_CHECK(nodes_, "tide param_all_gather: rank ", rank_, ": this group's CUDA path is for one node");
  auto& g = group(device, "param_all_gather");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  // Puts land at the sender's offsets in the receiver's memory: with them, the offsets (and
  // the size of the memory they lie in) are compared across ranks whatever TIDE_CUDA_CHECK_ARGS says.
  const size_t home_bytes = home->bytes(nodes_->topology.local_rank(rank_));
  check_across_ranks("param_all_gather", *args.layout, args.shard_dtype, args.storage_dtype, -1,
                     tide::fnv(tide::fnv(hash_values(args.shard_offsets), hash_values(storage_offsets)), home_bytes),
                     puts_ != nullptr);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const tide::TwoLevel group{nodes_->topology, rank_, &all_gather_engine(home)};
  tide::cuda::NodeAllGatherArgs across{&group, home.get(), storage_offsets, 0, &schedules_};
  guarded("param_all_gather", [&] {
    engine_->bind(g.copy_stream());  // NCCL ordered with the node's copies
    if (wire_) wire_->bind(g.copy_stream());
    tide::cuda::param_all_gather_across_nodes(g, args, across, stream);
  });
  if (tide::env::debug())
    tide::env::log(tide::detail::concat("cuda: rank ", rank_, ": param_all_gather #", seq_ - 1, ": ",
                                        args.layout->params.size(), " params across ", nodes_->topology.num_nodes,
                                        " nodes: inter-node over ", engine_description(),
                                        " (paced recursive doubling), node-local over copy engines"));
  return finish("tide:param_all_gather", c10d::OpType::ALLGATHER, std::move(outputs), device);
}

std::string CudaPath::engine_description() const {
  if (!nodes_) return "";
  if (puts_) return "nccl one-sided (contiguous blocks put into registered windows; packed blocks over nccl send-recv)";
  return one_sided_why_.empty() ? "nccl send-recv" : "nccl send-recv (no one-sided puts: " + one_sided_why_ + ")";
}

int64_t CudaPath::inter_node_bytes_sent() const {
  return (engine_ ? engine_->bytes_sent() : 0) + (puts_ ? puts_->bytes_put() : 0);
}

c10::intrusive_ptr<c10d::Work> CudaPath::param_reduce_scatter(const tide::ParamReduceScatter& args,
                                                              std::vector<at::Tensor> outputs, int device,
                                                              tide::StagingReport* report) {
  auto& g = group(device, "param_reduce_scatter");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  std::vector<int64_t> regions;
  for (const auto& r : args.reuse_regions) regions.insert(regions.end(), {r.offset, r.bytes});
  check_across_ranks("param_reduce_scatter", *args.layout, args.grad_dtype, args.out_dtype,
                     static_cast<int>(args.op.op), hash_values(regions));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  guarded("param_reduce_scatter", [&] {
    if (nodes_) {
      engine_->bind(g.compute_stream());  // NCCL ordered with the node's sums
      *report = tide::cuda::param_reduce_scatter_across_nodes(g, args, {nodes_->topology, rank_, engine_.get()}, stream);
    } else {
      *report = tide::cuda::param_reduce_scatter(g, args, stream);
    }
  });
  if (tide::env::debug())
    tide::env::log(tide::detail::concat(
        "cuda: rank ", rank_, ": param_reduce_scatter #", seq_ - 1, ": ", args.layout->params.size(),
        " params, copy engines + ", g.rs_ctas(), " accumulate CTAs, ", report->num_slots, " x ", report->slot_bytes,
        " B staging (", report->reused_slots, " in vacated all-gather storage)",
        nodes_ ? tide::detail::concat("; across ", nodes_->topology.num_nodes, " nodes: node-local into node partials (",
                                      report->partial_bytes, " B), inter-node over nccl send-recv")
               : std::string()));
  return finish("tide:param_reduce_scatter", c10d::OpType::REDUCE_SCATTER, std::move(outputs), device);
}

void CudaPath::guarded(const char* collective, const std::function<void()>& enqueue) {
  try {
    enqueue();
  } catch (const std::exception& e) {
    // Part of the collective may be enqueued (flags posted, epochs advanced): the ranks are
    // out of step, so the group is done for, on every rank (the poison word tells peers).
    const std::string why = tide::detail::concat(collective, " failed while being enqueued: ", e.what());
    group_->abort(why);
    set_failed(group_->broken_why());
    throw;
  }
}

void CudaPath::set_failed(const std::string& why) {
  std::lock_guard<std::mutex> h(health_->mutex);
  if (health_->error.empty()) health_->error = why;
}

void CudaPath::watchdog_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait_for(lock, std::chrono::milliseconds(50));
    if (stop_) return;
    if (!group_) continue;
    if (cudaSetDevice(group_->device()) != cudaSuccess) (void)cudaGetLastError();
    // A peer that aborted: stop too, so nothing here completes with its garbage.
    if (const int r = group_->peer_failed(); r >= 0 && !group_->broken()) {
      group_->abort(tide::detail::concat("rank ", r, " aborted the group"));
      set_failed(group_->broken_why());
    }
    // Collectives complete in issue order (one stream of work per group): the oldest first.
    while (!pending_.empty()) {
      Pending& p = pending_.front();
      bool done = false;
      try {
        done = tide::cuda::event_done(static_cast<cudaEvent_t>(p.event.get()));
      } catch (const std::exception& e) {  // the device failed (a fault): every later call must know
        group_->abort(e.what());
        set_failed(group_->broken_why());
        break;
      }
      if (done) {
        pending_.pop_front();
        continue;
      }
      if (group_->broken()) {
        group_->abort("");  // re-release: a late peer post may have lowered an inbox word
        break;
      }
      if (std::chrono::steady_clock::now() < p.deadline) break;
      group_->abort(tide::detail::concat(p.what, " did not complete within ", p.timeout.count(),
                                         " ms (a peer died or hung); the group is aborted"));
      set_failed(group_->broken_why());
      // Across nodes the work in flight also waits on NCCL (a send/recv kernel; a one-sided
      // wait, which NCCL's abort may not release): abort the communicator, as NCCL's own
      // watchdog would, so that the peers' NCCL fails too.
      if (nodes_) try {
          nodes_->nccl->abort();
        } catch (const std::exception& e) {
          tide::env::log(tide::detail::concat("cuda: rank ", rank_, ": aborting NCCL: ", e.what()));
        }
      break;
    }
  }
}

}  // namespace tide::torch_backend
