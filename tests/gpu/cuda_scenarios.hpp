// What each rank process of a CUDA test does (see cuda_harness.hpp). Include in exactly one
// translation unit per binary. Every scenario regenerates every rank's data from the shared
// seed, so references are computed on the host without exchanging data; outputs are poisoned
// (0xFF bytes: NaN for floats) beforehand so unwritten bytes show.
#pragma once
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_harness.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"
#include "tide/cuda/kernels.hpp"
#include "tide/cuda/probe.hpp"
#include "tide/plan.hpp"

namespace tide::cudatest {
namespace sc {

#define TIDE_EXPECT(cond, ...)                                                                                   \
  do {                                                                                                          \
    if (!(cond))                                                                                                \
      throw std::runtime_error(::tide::detail::concat(__FILE__, ":", __LINE__, ": ", #cond, " -- ", __VA_ARGS__)); \
  } while (0)

inline uint16_t to_bf16(float f) {  // round to nearest even (no NaNs in the data)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float from_f16(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}
// Values exactly representable in f16 (and bf16): small multiples of 1/64.
inline uint16_t to_f16_exact(float v) {  // v = k/64, |k| < 1024
  if (v == 0.f) return 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  float a = std::fabs(v);
  int e;
  float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int exp = e - 1 + 15;
  const uint32_t man = static_cast<uint32_t>((m * 2.f - 1.f) * 1024.f);
  return static_cast<uint16_t>(sign | (exp << 10) | man);
}

// Element values of (rank, param) as the given dtype's bytes.
inline std::vector<uint8_t> make_data(uint64_t seed, int rank, int param, int64_t n, DType t) {
  std::mt19937_64 rng(seed ^ (uint64_t(rank + 1) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(param + 1) << 40));
  std::normal_distribution<float> dist;
  std::uniform_int_distribution<int> small(-1000, 1000);
  std::vector<uint8_t> b(static_cast<size_t>(n) * dtype_size(t));
  for (int64_t i = 0; i < n; ++i) {
    if (t == DType::f32) {
      float v = dist(rng);
      std::memcpy(&b[i * 4], &v, 4);
    } else if (t == DType::bf16) {
      uint16_t v = to_bf16(dist(rng));
      std::memcpy(&b[i * 2], &v, 2);
    } else {
      uint16_t v = to_f16_exact(static_cast<float>(small(rng)) / 64.f);
      std::memcpy(&b[i * 2], &v, 2);
    }
  }
  return b;
}
inline float value(const std::vector<uint8_t>& b, int64_t i, DType t) {
  if (t == DType::f32) {
    float v;
    std::memcpy(&v, &b[i * 4], 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, &b[i * 2], 2);
  return t == DType::bf16 ? from_bf16(h) : from_f16(h);
}
inline int64_t at(const plan::Strided& s, int64_t i) { return s.offset + (i / s.run) * s.stride + i % s.run; }

inline plan::GroupLayout test_layout(int ws, int64_t elem_size) {
  std::vector<plan::Param> ps = {
      {{37, 24}, elem_size, 0},   // uneven Shard(0)
      {{16, 12}, elem_size, 1},   // Shard(1): strided placement
      {{3, 5}, elem_size, 0},     // fewer rows than ranks at ws 4
      {{1000}, elem_size, 0},     // 1-d
      {{8, 4, 8}, elem_size, 2},  // Shard(2)
      {{129, 64}, elem_size, 0},  // bigger: several pipeline windows
  };
  return plan::plan_group(ps, ws);
}

// " [modes: flags=device copies=batched memory=vmm]": what the group actually took (the
// runner compares it with what the device must offer: --expect).
inline std::string modes(const cuda::CudaGroup& g) { return " [modes: " + g.modes() + "]"; }

struct Group {
  std::shared_ptr<Store> store;
  std::unique_ptr<cuda::CudaGroup> g;
};
inline Group make_group(const RankCtx& c, cuda::CudaGroupOptions opt = {}) {
  TIDE_CUDA_CHECK(cudaSetDevice(0));  // every rank shares device 0 (one-GPU machine)
  Group gr;
  gr.store = std::shared_ptr<Store>(make_file_store(c.dir).release());
  opt.timeout = std::chrono::milliseconds(c.timeout_ms);
  gr.g = std::make_unique<cuda::CudaGroup>(gr.store, "t", c.rank, c.ws, 0, opt);
  return gr;
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) { TIDE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T))); }
  ~DevBuf() { if (p) (void)cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
};

inline std::string scenario_symmetric(const RankCtx& c) {
  Group gr = make_group(c);
  const size_t mine = (c.rank + 1) * 4099;
  auto buf = gr.g->allocate_symmetric(mine);
  std::vector<uint8_t> pat = make_data(c.seed, c.rank, 99, static_cast<int64_t>(mine), DType::f32);
  pat.resize(mine);
  TIDE_CUDA_CHECK(cudaMemcpy(buf->local(), pat.data(), mine, cudaMemcpyHostToDevice));
  gr.g->barrier();
  for (int r = 0; r < c.ws; ++r) {
    const size_t n = (r + 1) * 4099;
    TIDE_EXPECT(buf->bytes(r) == n, "rank ", r, " part has ", buf->bytes(r), " bytes");
    std::vector<uint8_t> want = make_data(c.seed, r, 99, static_cast<int64_t>(n), DType::f32);
    want.resize(n);
    std::vector<uint8_t> got(n);
    TIDE_CUDA_CHECK(cudaMemcpy(got.data(), buf->peer(r), n, cudaMemcpyDeviceToHost));
    TIDE_EXPECT(got == want, "rank ", c.rank, " reads wrong bytes from rank ", r, "'s part");
  }
  gr.g->barrier();
  buf->release(100, 1000);
  std::vector<uint8_t> got(mine);
  TIDE_CUDA_CHECK(cudaMemcpy(got.data(), buf->local(), mine, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < mine; ++i)
    TIDE_EXPECT(got[i] == (i >= 100 && i < 1100 ? 0 : pat[i]), "byte ", i, " after release");
  gr.g->barrier();
  return "symmetric ok" + modes(*gr.g);
}

// The stream-ordered flags between rank processes, alone. Each round every rank fills its own
// symmetric part with the round's pattern on its copy stream (on one rank in turn behind a
// host callback that sleeps 50 ms, so its fill and post come late), posts ag_ready, waits for
// every peer's, copies every peer's part into private memory on the same stream, then posts
// and waits for ag_done before the next fill. A wait that did not order the copy after the
// peer's fill reads the previous round's pattern; one that did not hold the next fill back
// lets a peer copy a pattern from the future.
inline std::string scenario_flags(const RankCtx& c, int sync) {
  cuda::CudaGroupOptions opt;
  opt.sync = sync;
  Group gr = make_group(c, opt);
  cuda::CudaGroup& g = *gr.g;
  using F = cuda::CudaGroup::FlagId;
  const size_t n = size_t(1) << 20;
  auto part = g.allocate_symmetric(n);
  DevBuf<uint8_t> copied(n * static_cast<size_t>(c.ws));
  const cudaStream_t s = g.copy_stream();
  auto pattern = [](int round, int rank) { return static_cast<uint8_t>(round * 16 + rank + 1); };
  const int rounds = 2 * c.ws + 2;
  std::vector<uint8_t> host(copied.n);
  for (int round = 1; round <= rounds; ++round) {
    g.begin("flags", nullptr, {s});
    if (round % c.ws == c.rank)
      TIDE_CUDA_CHECK(cudaLaunchHostFunc(
          s, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }, nullptr));
    TIDE_CUDA_CHECK(cudaMemsetAsync(part->local(), pattern(round, c.rank), n, s));
    const uint64_t ready = g.next(F::kAgReady);
    g.post(s, F::kAgReady, ready);
    for (int p = 0; p < c.ws; ++p)
      if (p != c.rank) g.wait(s, p, F::kAgReady, ready);
    for (int p = 0; p < c.ws; ++p)
      TIDE_CUDA_CHECK(cudaMemcpyAsync(copied.p + static_cast<size_t>(p) * n, part->peer(p), n, cudaMemcpyDeviceToDevice, s));
    const uint64_t done = g.next(F::kAgDone);
    g.post(s, F::kAgDone, done);
    for (int p = 0; p < c.ws; ++p)
      if (p != c.rank) g.wait(s, p, F::kAgDone, done);
    g.end(nullptr, {s});
    TIDE_CUDA_CHECK(cudaMemcpy(host.data(), copied.p, host.size(), cudaMemcpyDeviceToHost));
    for (int p = 0; p < c.ws; ++p)
      for (size_t i = 0; i < n; i += 4093)
        TIDE_EXPECT(host[static_cast<size_t>(p) * n + i] == pattern(round, p), "round ", round, ": rank ", c.rank,
                    " read byte ", i, " of rank ", p, "'s part as ", int(host[static_cast<size_t>(p) * n + i]),
                    ", the round's pattern is ", int(pattern(round, p)));
  }
  g.barrier();
  return detail::concat("flags ok, ", rounds, " rounds", modes(g));
}

// After an all-gather: every rank's shard of every parameter (fresh data from make_data,
// cast f32 -> bf16 where the dtypes differ) at its placement in this rank's storages, and
// storage bytes outside every placement still 0xFF.
inline void expect_all_gathered(const RankCtx& c, const plan::GroupLayout& layout, DType shard_t, DType storage_t,
                                const std::vector<void*>& storages, const std::string& what) {
  TIDE_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t ses = dtype_size(shard_t), des = dtype_size(storage_t);
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const plan::ParamLayout& pl = layout.params[p];
    std::vector<uint8_t> got(static_cast<size_t>(pl.storage_bytes()));
    TIDE_CUDA_CHECK(cudaMemcpy(got.data(), storages[p], got.size(), cudaMemcpyDeviceToHost));
    std::vector<bool> covered(static_cast<size_t>(pl.storage_numel), false);
    for (int r = 0; r < c.ws; ++r) {
      const plan::Shard& sh = pl.shards[r];
      std::vector<uint8_t> d = make_data(c.seed, r, static_cast<int>(p), sh.numel, shard_t);
      for (int64_t i = 0; i < sh.numel; ++i) {
        const int64_t j = at(sh.placement, i);
        covered[j] = true;
        std::vector<uint8_t> want(des);
        if (shard_t == storage_t) {
          std::memcpy(want.data(), &d[i * ses], des);
        } else {
          TIDE_EXPECT(shard_t == DType::f32 && storage_t == DType::bf16, "test covers f32 -> bf16 casts only");
          const uint16_t h = to_bf16(value(d, i, DType::f32));
          std::memcpy(want.data(), &h, 2);
        }
        TIDE_EXPECT(std::memcmp(&got[j * des], want.data(), des) == 0, what, "param ", p, " storage element ", j,
                    " (rank ", r, "'s shard element ", i, ") wrong on rank ", c.rank);
      }
    }
    for (int64_t j = 0; j < pl.storage_numel; ++j)
      if (!covered[j])
        for (size_t k = 0; k < des; ++k)
          TIDE_EXPECT(got[j * des + k] == 0xFF, what, "param ", p, " storage element ", j,
                      " outside every placement was written");
  }
}

inline std::string scenario_all_gather(const RankCtx& c, DType shard_t, DType storage_t, int sync) {
  cuda::CudaGroupOptions opt;
  opt.sync = sync;
  Group gr = make_group(c, opt);
  const size_t ses = dtype_size(shard_t), des = dtype_size(storage_t);
  plan::GroupLayout layout = test_layout(c.ws, static_cast<int64_t>(des));
  const size_t np = layout.params.size();
  std::vector<size_t> offs(np);
  size_t total = 0;
  for (size_t p = 0; p < np; ++p) {
    offs[p] = total;
    total += (static_cast<size_t>(layout.params[p].padded_shard_numel) * ses + 255) / 256 * 256;
  }
  auto shards = gr.g->allocate_symmetric(total);
  for (size_t p = 0; p < np; ++p) {
    const int64_t n = layout.params[p].shards[c.rank].numel;
    std::vector<uint8_t> d = make_data(c.seed, c.rank, static_cast<int>(p), n, shard_t);
    if (!d.empty()) TIDE_CUDA_CHECK(cudaMemcpy(shards->local() + offs[p], d.data(), d.size(), cudaMemcpyHostToDevice));
  }
  std::vector<std::unique_ptr<DevBuf<uint8_t>>> st;
  std::vector<void*> storages;
  for (size_t p = 0; p < np; ++p) {
    st.push_back(std::make_unique<DevBuf<uint8_t>>(static_cast<size_t>(layout.params[p].storage_bytes())));
    TIDE_CUDA_CHECK(cudaMemset(st.back()->p, 0xFF, st.back()->n));
    storages.push_back(st.back()->p);
  }
  ParamAllGather a;
  a.layout = &layout;
  a.shards = shards.get();
  a.shard_offsets = offs;
  a.shard_dtype = shard_t;
  a.storages = storages;
  a.storage_dtype = storage_t;
  const uint64_t launches = cuda::kernel_launch_count();
  for (int iter = 0; iter < 2; ++iter) cuda::param_all_gather(*gr.g, a);
  const uint64_t used = cuda::kernel_launch_count() - launches;
  if (shard_t == storage_t) TIDE_EXPECT(used == 0, "equal-dtype all-gather launched ", used, " kernels");
  expect_all_gathered(c, layout, shard_t, storage_t, storages, "");
  gr.g->barrier();
  return "all-gather ok, kernels launched: " + std::to_string(used) + modes(*gr.g);
}

// The inter-node engine of the across-nodes scenarios: device bytes through the file store
// (NCCL refuses two ranks on one GPU), stream-ordered as NCCL is and no more: start() only
// marks the bound stream; the bytes are read later, on a side stream that waits for that
// mark (as NCCL reads them, whatever the host did meanwhile), and the bound stream waits
// for the receives' arrival. An executor that changed a send buffer after start(), or read
// a receive before finish(), gets wrong bytes here as it would on NCCL.
class StoreDeviceEngine final : public Engine {
 public:
  StoreDeviceEngine(Store& store, plan::Topology topo, int rank, cudaStream_t stream)
      : store_(store), topo_(topo), me_(rank), s_(stream) {
    TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  }
  ~StoreDeviceEngine() override {
    (void)cudaStreamSynchronize(side_);
    (void)cudaStreamDestroy(side_);
  }
  const char* name() const override { return "test store (device bytes)"; }
  void start(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs,
             std::shared_ptr<const void> keep_alive) override {
    for (const EngineSend& e : sends)
      TIDE_EXPECT(topo_.node_of(e.peer) != topo_.node_of(me_), "engine message from rank ", me_, " to rank ", e.peer,
                  " on its own node");
    Exchange x{std::vector<EngineSend>(sends.begin(), sends.end()), std::vector<EngineRecv>(recvs.begin(), recvs.end()),
               std::move(keep_alive), nullptr};
    TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&x.posted, cudaEventDisableTiming));
    TIDE_CUDA_CHECK(cudaEventRecord(x.posted, s_));
    pending_.push_back(std::move(x));
  }
  void finish() override {
    Exchange x = std::move(pending_.front());
    pending_.pop_front();
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(side_, x.posted, 0));
    std::vector<std::vector<uint8_t>> out;
    for (const EngineSend& e : x.sends) {
      out.emplace_back(e.bytes);
      TIDE_CUDA_CHECK(cudaMemcpyAsync(out.back().data(), e.data, e.bytes, cudaMemcpyDeviceToHost, side_));
    }
    TIDE_CUDA_CHECK(cudaStreamSynchronize(side_));
    for (size_t i = 0; i < x.sends.size(); ++i) {
      store_.set(detail::concat("m/", me_, "/", x.sends[i].peer, "/", sent_[x.sends[i].peer]++), out[i]);
      bytes_ += static_cast<int64_t>(out[i].size());
    }
    std::vector<std::vector<uint8_t>> in;
    for (const EngineRecv& e : x.recvs) {
      in.push_back(store_.get(detail::concat("m/", e.peer, "/", me_, "/", received_[e.peer]++), std::chrono::seconds(60)));
      TIDE_EXPECT(in.back().size() == e.bytes, "message of ", in.back().size(), " bytes for a receive of ", e.bytes);
      TIDE_CUDA_CHECK(cudaMemcpyAsync(e.data, in.back().data(), e.bytes, cudaMemcpyHostToDevice, side_));
    }
    cudaEvent_t arrived = nullptr;
    TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&arrived, cudaEventDisableTiming));
    TIDE_CUDA_CHECK(cudaEventRecord(arrived, side_));
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(s_, arrived, 0));
    TIDE_CUDA_CHECK(cudaStreamSynchronize(side_));  // `in` is pageable host memory, about to go
    (void)cudaEventDestroy(arrived);
    (void)cudaEventDestroy(x.posted);
  }
  int64_t bytes() const { return bytes_; }

 private:
  struct Exchange {
    std::vector<EngineSend> sends;
    std::vector<EngineRecv> recvs;
    std::shared_ptr<const void> keep_alive;
    cudaEvent_t posted;
  };
  Store& store_;
  plan::Topology topo_;
  int me_;
  cudaStream_t s_, side_ = nullptr;
  std::map<int, int> sent_, received_;
  std::deque<Exchange> pending_;
  int64_t bytes_ = 0;
};

// TIDE-AG across pseudo-nodes on one GPU: nodes of 2 ranks at world size 4 (else 1 rank),
// each node a CudaGroup of its own, the storages in the node's symmetric memory, the
// inter-node rounds over StoreDeviceEngine; every rank's storages against the host
// reference placement of every rank's shard, twice (the progress flags carry on).
inline std::string scenario_all_gather_nodes(const RankCtx& c, DType shard_t, DType storage_t) {
  TIDE_CUDA_CHECK(cudaSetDevice(0));
  const int local = c.ws >= 4 ? 2 : 1;
  const plan::Topology topo{c.ws, local, c.ws / local};
  auto store = std::shared_ptr<Store>(make_file_store(c.dir).release());
  cuda::CudaGroupOptions opt;
  opt.timeout = std::chrono::milliseconds(c.timeout_ms);
  cuda::CudaGroup g(store, detail::concat("node", topo.node_of(c.rank)), topo.local_rank(c.rank), local, 0, opt);
  const size_t ses = dtype_size(shard_t), des = dtype_size(storage_t);
  const plan::GroupLayout layout = test_layout(c.ws, static_cast<int64_t>(des));
  const size_t np = layout.params.size();
  std::vector<size_t> shard_offs(np), storage_offs(np);
  size_t shard_total = 0, storage_total = 0;
  for (size_t p = 0; p < np; ++p) {
    shard_offs[p] = shard_total;
    shard_total += (static_cast<size_t>(layout.params[p].padded_shard_numel) * ses + 255) / 256 * 256;
    storage_offs[p] = storage_total;
    storage_total += (static_cast<size_t>(layout.params[p].storage_bytes()) + 255) / 256 * 256;
  }
  auto shards = g.allocate_symmetric(shard_total);
  auto home = g.allocate_symmetric(storage_total);
  for (size_t p = 0; p < np; ++p) {
    std::vector<uint8_t> d = make_data(c.seed, c.rank, static_cast<int>(p), layout.params[p].shards[c.rank].numel, shard_t);
    if (!d.empty()) TIDE_CUDA_CHECK(cudaMemcpy(shards->local() + shard_offs[p], d.data(), d.size(), cudaMemcpyHostToDevice));
  }
  std::vector<void*> storages;
  for (size_t p = 0; p < np; ++p) storages.push_back(home->local() + storage_offs[p]);
  StoreDeviceEngine engine(*store, topo, c.rank, g.copy_stream());
  ParamAllGather a;
  a.layout = &layout;
  a.shards = shards.get();
  a.shard_offsets = shard_offs;
  a.shard_dtype = shard_t;
  a.storages = storages;
  a.storage_dtype = storage_t;
  NodeScheduleCache schedules;
  const TwoLevel group{topo, c.rank, &engine};
  const cuda::NodeAllGatherArgs nodes{&group, home.get(), storage_offs, 96, &schedules};  // paced: several rounds
  for (int iter = 0; iter < 2; ++iter) {
    TIDE_CUDA_CHECK(cudaMemset(home->local(), 0xFF, storage_total));
    TIDE_CUDA_CHECK(cudaDeviceSynchronize());
    g.barrier();  // every rank filled before any peer reads
    cuda::param_all_gather_across_nodes(g, a, nodes, nullptr);
    expect_all_gathered(c, layout, shard_t, storage_t, storages, detail::concat("iteration ", iter, ": "));
    g.barrier();  // nobody reads this rank's storages any more
  }
  TIDE_EXPECT(topo.num_nodes == 1 || engine.bytes() > 0, "nothing went through the engine");
  return detail::concat("all-gather across ", topo.num_nodes, " x ", local, " pseudo-nodes ok, ", engine.bytes(),
                        " bytes through the engine", modes(g));
}

// A TIDE-RS call's inputs on this rank (fresh gradients in device memory, an fp32 output
// filled with 0xFF) and its check: every shard element bitwise equal to want(p, j, all)
// (j: the element's index in the unsharded parameter, all: every rank's gradient of p),
// the padding zero.
struct RsCase {
  std::vector<std::unique_ptr<DevBuf<uint8_t>>> bufs;
  std::vector<const void*> grads;
  std::vector<int64_t> out_off;
  std::unique_ptr<DevBuf<float>> out;
  ParamReduceScatter args;

  RsCase(const RankCtx& c, const plan::GroupLayout& layout, DType grad_t, ReduceOp op) {
    int64_t out_n = 0;
    for (size_t p = 0; p < layout.params.size(); ++p) {
      std::vector<uint8_t> d = make_data(c.seed, c.rank, static_cast<int>(p), layout.params[p].numel, grad_t);
      bufs.push_back(std::make_unique<DevBuf<uint8_t>>(d.size()));
      TIDE_CUDA_CHECK(cudaMemcpy(bufs.back()->p, d.data(), d.size(), cudaMemcpyHostToDevice));
      grads.push_back(bufs.back()->p);
      out_off.push_back(out_n);
      out_n += layout.params[p].padded_shard_numel;
    }
    out = std::make_unique<DevBuf<float>>(static_cast<size_t>(out_n));
    TIDE_CUDA_CHECK(cudaMemset(out->p, 0xFF, out->n * sizeof(float)));
    TIDE_CUDA_CHECK(cudaDeviceSynchronize());
    args.layout = &layout;
    args.grads = grads;
    args.grad_dtype = grad_t;
    args.out = out->p;
    args.out_offsets = out_off;
    args.out_dtype = DType::f32;
    args.op.op = op;
    args.op.premul_factor = 0.37;
  }

  template <class Want>
  void check(const RankCtx& c, Want want) const {
    TIDE_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got(out->n);
    TIDE_CUDA_CHECK(cudaMemcpy(got.data(), out->p, out->n * sizeof(float), cudaMemcpyDeviceToHost));
    const plan::GroupLayout& layout = *args.layout;
    std::vector<std::vector<uint8_t>> all(c.ws);
    for (size_t p = 0; p < layout.params.size(); ++p) {
      const plan::ParamLayout& pl = layout.params[p];
      for (int r = 0; r < c.ws; ++r) all[r] = make_data(c.seed, r, static_cast<int>(p), pl.numel, args.grad_dtype);
      const plan::Shard& sh = pl.shards[c.rank];
      for (int64_t i = 0; i < pl.padded_shard_numel; ++i) {
        const float g = got[static_cast<size_t>(out_off[p] + i)];
        if (i >= sh.numel) {
          TIDE_EXPECT(g == 0.f && !std::signbit(g), "param ", p, " padding element ", i, " is ", g);
          continue;
        }
        const float w = want(at(sh.placement, i), all);
        TIDE_EXPECT(std::memcmp(&g, &w, 4) == 0, "param ", p, " shard element ", i, " on rank ", c.rank, ": got ", g,
                    " want ", w);
      }
    }
  }
};

inline std::string scenario_reduce_scatter(const RankCtx& c, DType grad_t, ReduceOp op, int sync, size_t staging) {
  cuda::CudaGroupOptions opt;
  opt.sync = sync;
  opt.staging_bytes = staging;
  opt.rs_ctas = 3;
  Group gr = make_group(c, opt);
  const plan::GroupLayout layout = test_layout(c.ws, static_cast<int64_t>(dtype_size(grad_t)));
  RsCase rc(c, layout, grad_t, op);
  StagingReport rep;
  for (int iter = 0; iter < 2; ++iter) rep = cuda::param_reduce_scatter(*gr.g, rc.args);
  const float scale = op == ReduceOp::avg ? 1.f / static_cast<float>(c.ws) : op == ReduceOp::premul_sum ? 0.37f : 1.f;
  rc.check(c, [&](int64_t j, const std::vector<std::vector<uint8_t>>& all) {
    volatile float acc = 0.f;  // rank order, fp32
    for (int r = 0; r < c.ws; ++r) acc = acc + value(all[r], j, grad_t);
    volatile float want = scale * acc;
    return static_cast<float>(want);
  });
  gr.g->barrier();
  return "reduce-scatter ok, slots " + std::to_string(rep.num_slots) + " x " + std::to_string(rep.slot_bytes) + " bytes" +
         modes(*gr.g);
}

// TIDE-RS across pseudo-nodes on one GPU (the nodes of scenario_all_gather_nodes; the
// partials over StoreDeviceEngine): bitwise against the documented order computed here, the
// node's local ranks summed in order into fp32 partials (one rank per node: its gradient in
// its own dtype, copied, not summed), then the nodes in order. Staging small enough that
// windows wrap.
inline std::string scenario_reduce_scatter_nodes(const RankCtx& c, DType grad_t, ReduceOp op) {
  TIDE_CUDA_CHECK(cudaSetDevice(0));
  const int local = c.ws >= 4 ? 2 : 1;
  const plan::Topology topo{c.ws, local, c.ws / local};
  auto store = std::shared_ptr<Store>(make_file_store(c.dir).release());
  cuda::CudaGroupOptions opt;
  opt.timeout = std::chrono::milliseconds(c.timeout_ms);
  opt.staging_bytes = static_cast<size_t>(2 * c.ws * 1024);  // 2 slots x ws pieces of 1 KiB
  opt.rs_ctas = 3;
  cuda::CudaGroup g(store, detail::concat("node", topo.node_of(c.rank)), topo.local_rank(c.rank), local, 0, opt);
  const plan::GroupLayout layout = test_layout(c.ws, static_cast<int64_t>(dtype_size(grad_t)));
  RsCase rc(c, layout, grad_t, op);
  StoreDeviceEngine engine(*store, topo, c.rank, g.compute_stream());
  StagingReport rep;
  for (int iter = 0; iter < 2; ++iter) rep = cuda::param_reduce_scatter_across_nodes(g, rc.args, {topo, c.rank, &engine});
  const float node_scale = op == ReduceOp::premul_sum ? 0.37f : 1.f;
  const float final_scale = op == ReduceOp::avg ? 1.f / static_cast<float>(c.ws) : 1.f;
  rc.check(c, [&](int64_t j, const std::vector<std::vector<uint8_t>>& all) {
    volatile float nodes_sum = 0.f;  // nodes in order of their partials (local ranks in order)
    for (int n = 0; n < topo.num_nodes; ++n) {
      volatile float node_sum = 0.f;
      for (int l = 0; l < local; ++l) node_sum = node_sum + value(all[topo.rank_of(n, l)], j, grad_t);
      volatile float partial = node_scale * node_sum;
      nodes_sum = nodes_sum + partial;
    }
    volatile float want = final_scale * nodes_sum;
    return static_cast<float>(want);
  });
  TIDE_EXPECT(topo.num_nodes == 1 || engine.bytes() > 0, "nothing went through the engine");
  g.barrier();
  return detail::concat("reduce-scatter across ", topo.num_nodes, " x ", local, " pseudo-nodes ok, ", rep.partial_bytes,
                        " B of partials, ", engine.bytes(), " bytes through the engine", modes(g));
}

inline std::string scenario_rs_errors(const RankCtx& c) {
  Group gr = make_group(c);
  plan::GroupLayout layout = test_layout(c.ws, 2);
  std::vector<const void*> grads(layout.params.size(), nullptr);
  std::vector<int64_t> offs(layout.params.size(), 0);
  ParamReduceScatter a;
  a.layout = &layout;
  a.grads = grads;
  a.out_offsets = offs;
  a.grad_dtype = DType::bf16;
  a.out_dtype = DType::bf16;
  bool threw = false;
  try {
    cuda::param_reduce_scatter(*gr.g, a);
  } catch (const Error& e) {
    threw = std::string(e.what()).find("unsupported bf16 -> bf16") != std::string::npos;
  }
  TIDE_EXPECT(threw, "bf16 -> bf16 must be refused");
  a.out_dtype = DType::f32;
  a.op.op = ReduceOp::max;
  threw = false;
  try {
    cuda::param_reduce_scatter(*gr.g, a);
  } catch (const Error& e) {
    threw = std::string(e.what()).find("max") != std::string::npos;
  }
  TIDE_EXPECT(threw, "max must be refused");
  // A checked CUDA call names the call, the rank and CUDA's error string.
  threw = false;
  try {
    TIDE_CUDA_CHECK(cudaSetDevice(12345));
  } catch (const Error& e) {
    const std::string w = e.what();
    threw = w.find("cudaSetDevice(12345)") != std::string::npos && w.find("rank " + std::to_string(c.rank)) != std::string::npos;
  }
  TIDE_EXPECT(threw, "TIDE_CUDA_CHECK message");
  gr.g->barrier();
  return "errors ok" + modes(*gr.g);
}

}  // namespace sc

inline std::vector<std::string> scenario_names() {
  return {"symmetric",     "flags",        "flags_hostsync", "ag_bf16",      "ag_f32",      "ag_cast_f32_bf16", "ag_bf16_hostsync", "rs_bf16_sum",
          "rs_bf16_avg",   "rs_f16_sum",   "rs_f32_premul", "rs_bf16_sum_hostsync", "rs_bf16_sum_bigstaging",
          "rs_errors",     "ag_nodes_bf16", "ag_nodes_cast_f32_bf16",
          "rs_nodes_bf16_sum", "rs_nodes_f32_avg", "rs_nodes_f16_premul"};
}

std::string run_scenario(const RankCtx& c) {
  using namespace sc;
  const std::string& s = c.scenario;
  if (s == "count") {  // the runtime's reason when it finds none (no driver, a mismatch, no device)
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    return e == cudaSuccess ? std::to_string(n) : "0 (" + std::string(cudaGetErrorString(e)) + ")";
  }
  if (s == "probe") {
    cuda::Capabilities caps = cuda::probe();
    TIDE_EXPECT(caps.device_count > 0, "probe found no device: ", caps.error);
    TIDE_EXPECT(caps.devices[0].sm_count > 0 && caps.devices[0].copy_engines > 0, cuda::describe(caps));
    cuda::PathChoice pc = cuda::choose_allgather_path(caps, std::vector<int>(static_cast<size_t>(c.ws), 0));
    TIDE_EXPECT(pc.path == cuda::AllGatherPath::copy_engine, "ranks sharing one device do not take the copy engines: ",
                pc.reason);
    return cuda::describe(caps) + "\n  all-gather path: " + cuda::path_name(pc.path) + " (" + pc.reason + ")";
  }
  const size_t small = static_cast<size_t>(2 * c.ws * 1024);  // 2 slots x ws pieces of 1 KiB
  if (s == "symmetric") return scenario_symmetric(c);
  if (s == "flags") return scenario_flags(c, 0);
  if (s == "flags_hostsync") return scenario_flags(c, 1);
  if (s == "ag_bf16") return scenario_all_gather(c, DType::bf16, DType::bf16, 0);
  if (s == "ag_f32") return scenario_all_gather(c, DType::f32, DType::f32, 0);
  if (s == "ag_cast_f32_bf16") return scenario_all_gather(c, DType::f32, DType::bf16, 0);
  if (s == "ag_bf16_hostsync") return scenario_all_gather(c, DType::bf16, DType::bf16, 1);
  if (s == "rs_bf16_sum") return scenario_reduce_scatter(c, DType::bf16, ReduceOp::sum, 0, small);
  if (s == "rs_bf16_avg") return scenario_reduce_scatter(c, DType::bf16, ReduceOp::avg, 0, small);
  if (s == "rs_f16_sum") return scenario_reduce_scatter(c, DType::f16, ReduceOp::sum, 0, small);
  if (s == "rs_f32_premul") return scenario_reduce_scatter(c, DType::f32, ReduceOp::premul_sum, 0, small);
  if (s == "rs_bf16_sum_hostsync") return scenario_reduce_scatter(c, DType::bf16, ReduceOp::sum, 1, small);
  if (s == "rs_bf16_sum_bigstaging") return scenario_reduce_scatter(c, DType::bf16, ReduceOp::sum, 0, 0);
  if (s == "rs_errors") return scenario_rs_errors(c);
  if (s == "ag_nodes_bf16") return scenario_all_gather_nodes(c, DType::bf16, DType::bf16);
  if (s == "ag_nodes_cast_f32_bf16") return scenario_all_gather_nodes(c, DType::f32, DType::bf16);
  if (s == "rs_nodes_bf16_sum") return scenario_reduce_scatter_nodes(c, DType::bf16, ReduceOp::sum);
  if (s == "rs_nodes_f32_avg") return scenario_reduce_scatter_nodes(c, DType::f32, ReduceOp::avg);
  if (s == "rs_nodes_f16_premul") return scenario_reduce_scatter_nodes(c, DType::f16, ReduceOp::premul_sum);
  throw std::runtime_error("unknown scenario " + s);
}

}  // namespace tide::cudatest
