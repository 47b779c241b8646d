// TIDE-RS's one executor (src/collectives/param_reduce_scatter.cpp) as CUDA runs it, on
// host threads (one per rank): an RsNode whose every call after the host's bookkeeping is
// enqueued on the rank's two Streams, as CudaRsNode enqueues on its copy and compute
// streams (staging and ready on the copy stream; the sums, the flags that free slots and
// the engine's exchanges on the compute stream; an event orders a window's staging before
// its sums). Nothing runs until the executor returned, so a host read of what a window
// produced, a slot reused before its readers finished or a partial freed while queued work
// still uses it shows up as wrong bits (scratch is poisoned) or under ASan. The same node
// also runs at once (streams off). Every rank's shard must equal, bitwise, the documented
// order (tests/cpp/test_param_common.hpp), at 1-3 nodes of 1-3 ranks, with Slot-Reuse, with
// slots small enough that windows wrap, twice in a row (counters carry on).
#include <gtest/gtest.h>

#include "test_param_common.hpp"
#include "test_stream.hpp"
#include "tide/reduce_kernels.hpp"
#include "tide/rs_node.hpp"

namespace tide::test {
namespace {

constexpr size_t kSlotBytes = 6 << 10;
constexpr int kSlots = 2;
constexpr size_t kReuseBytes = 64 << 10;

// The memory and flags every rank of the job sees.
struct World {
  explicit World(plan::Topology t)
      : topo(t), slots(static_cast<size_t>(t.world_size), std::vector<std::byte>(kSlots * kSlotBytes)),
        reuse(static_cast<size_t>(t.world_size), std::vector<std::byte>(kReuseBytes)), mail(t),
        ready(static_cast<size_t>(t.world_size)), done(static_cast<size_t>(t.world_size)) {}
  const plan::Topology topo;
  std::vector<std::vector<std::byte>> slots, reuse;  // [rank]
  Mailboxes mail;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> ready, done;  // [rank]: the last step posted
  void post(std::vector<uint64_t>& flag, int rank, uint64_t value) {
    std::lock_guard lock(mu);
    flag[static_cast<size_t>(rank)] = value;
    cv.notify_all();
  }
  void wait(const std::vector<uint64_t>& flag, int rank, uint64_t value, int waiter) {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return flag[static_cast<size_t>(rank)] >= value; }))
      throw TimeoutError(detail::concat("rank ", waiter, " waited 60 s for rank ", rank, " to reach step ", value));
  }
};

// Slot-Reuse memory: every rank's reuse buffer of the node, by local rank.
class NodeReuse final : public SymmetricBuffer {
 public:
  NodeReuse(World& w, int rank) : w_(w), me_(rank) {}
  std::byte* peer(int local) override {
    return w_.reuse[static_cast<size_t>(w_.topo.rank_of(w_.topo.node_of(me_), local))].data();
  }
  std::byte* local() override { return peer(w_.topo.local_rank(me_)); }
  size_t bytes(int) const override { return kReuseBytes; }
  void release(size_t, size_t) override {}

 private:
  World& w_;
  int me_;
};

class ThreadRsNode final : public RsNode {
 public:
  // copy, compute: the rank's streams, or null: at once.
  ThreadRsNode(World& w, int rank, Stream* copy, Stream* compute)
      : w_(w), me_(rank), copy_(copy), compute_(compute), slot_free_(kSlots, 0) {}
  int local_rank() const override { return w_.topo.local_rank(me_); }
  int local_size() const override { return w_.topo.local_size; }
  size_t slot_bytes() const override { return kSlotBytes; }
  int num_slots() const override { return kSlots; }
  size_t piece_align() const override { return 256; }
  int64_t window_align() const override { return 16; }
  uint64_t next_step() const override { return step_ + 1; }
  uint64_t begin_window() override {
    const uint64_t t = ++step_;  // host bookkeeping, as CudaGroup::next
    on(copy_, [this, t] {
      if (t <= kSlots) return;
      peers([&](int r) { w_.wait(w_.done, r, t - kSlots, me_); });
      std::unique_lock lock(w_.mu);  // the slot's event: this rank's own sums of the window before
      if (!w_.cv.wait_for(lock, std::chrono::seconds(60), [&] { return slot_free_[index(t)] >= t - kSlots; }))
        throw TimeoutError(detail::concat("rank ", me_, ": its own sums of step ", t - kSlots, " never finished"));
    });
    return t;
  }
  std::byte* slot(int local, int index) override {
    return w_.slots[static_cast<size_t>(w_.topo.rank_of(w_.topo.node_of(me_), local))].data() +
           static_cast<size_t>(index) * kSlotBytes;
  }
  void stage(std::span<const StridedCopy> copies, DType dtype) override {
    on(copy_, [v = std::vector<StridedCopy>(copies.begin(), copies.end()), es = dtype_size(dtype)] {
      for (const StridedCopy& c : v)
        for (size_t k = 0; k < c.count; ++k)
          std::memcpy(static_cast<std::byte*>(c.dst) + k * c.dst_stride * es,
                      static_cast<const std::byte*>(c.src) + k * c.src_stride * es, c.run * es);
    });
  }
  void ready(uint64_t step) override {
    on(copy_, [this, step] {
      w_.post(w_.ready, me_, step);
      std::lock_guard lock(w_.mu);  // the phase-1 event
      phase1_ = step;
      w_.cv.notify_all();
    });
  }
  void await_ready(uint64_t step) override {
    on(compute_, [this, step] {
      {
        std::unique_lock lock(w_.mu);
        if (!w_.cv.wait_for(lock, std::chrono::seconds(60), [&] { return phase1_ >= step; }))
          throw TimeoutError(detail::concat("rank ", me_, ": its own staging of step ", step, " never finished"));
      }
      peers([&](int r) { w_.wait(w_.ready, r, step, me_); });
    });
  }
  void accumulate(void* dst, DType dst_dtype, std::span<const void* const> srcs, DType src_dtype, size_t count,
                  ReduceArgs op) override {
    on(compute_, [=, v = std::vector<const void*>(srcs.begin(), srcs.end())] {
      reduce_kernel(dst, dst_dtype, v.data(), v.size(), src_dtype, count, op);
    });
  }
  void end_window(uint64_t step) override {
    on(compute_, [this, step] {
      w_.post(w_.done, me_, step);
      std::lock_guard lock(w_.mu);
      slot_free_[index(step)] = step;
      w_.cv.notify_all();
    });
  }
  void release(uint64_t step) override {
    on(compute_, [this, step] { peers([&](int r) { w_.wait(w_.done, r, step, me_); }); });
  }
  void zero(void* dst, size_t bytes) override {
    on(compute_, [dst, bytes] { std::memset(dst, 0, bytes); });
  }
  std::shared_ptr<std::byte> scratch(size_t bytes) override {
    auto* p = new std::byte[bytes];
    std::memset(p, 0xAB, bytes);  // poisoned: a read before its zeroing shows
    Stream* s = compute_;
    return std::shared_ptr<std::byte>(p, [s](std::byte* q) {
      if (s)
        s->enqueue([q] { delete[] q; });  // in queue order, as cudaFreeAsync
      else
        delete[] q;
    });
  }

 private:
  static void on(Stream* s, std::function<void()> f) {
    if (s)
      s->enqueue(std::move(f));
    else
      f();
  }
  static size_t index(uint64_t step) { return static_cast<size_t>(step % kSlots); }
  template <class F>
  void peers(F f) {
    const int node = w_.topo.node_of(me_);
    for (int l = 0; l < w_.topo.local_size; ++l)
      if (w_.topo.rank_of(node, l) != me_) f(w_.topo.rank_of(node, l));
  }
  World& w_;
  int me_;
  Stream *copy_, *compute_;
  uint64_t step_ = 0;
  uint64_t phase1_ = 0;              // under w_.mu: the last step staged
  std::vector<uint64_t> slot_free_;  // under w_.mu: the last step whose sums finished, by slot
};

void run(plan::Topology topo, bool streams, DType gd, ReduceArgs op, bool reuse, uint64_t tag) {
  World w(topo);
  std::vector<std::string> errors(static_cast<size_t>(topo.world_size));
  std::vector<std::thread> threads;
  for (int r = 0; r < topo.world_size; ++r)
    threads.emplace_back([&, r] {
      try {
        Stream copy, compute;
        ThreadRsNode node(w, r, streams ? &copy : nullptr, streams ? &compute : nullptr);
        MailEngine mail(w.mail, r);
        StreamEngine ordered(mail, compute);
        Engine* engine = topo.num_nodes == 1 ? nullptr : streams ? static_cast<Engine*>(&ordered) : &mail;
        NodeReuse vacated(w, r);
        const std::vector<plan::Region> regions{{0, 512, 20000}};
        for (int rep = 0; rep < 2; ++rep) {
          const RsCase rc(mix(tag, rep), topo.world_size, r, gd);
          std::vector<uint8_t> out(static_cast<size_t>(rc.total + 1) * 4, 0x5a);  // + a sentinel element
          ParamReduceScatter a = rc.args(out.data(), DType::f32, op);
          if (reuse) {
            a.reuse = &vacated;
            a.reuse_regions = regions;
          }
          const StagingReport rep_ = param_reduce_scatter(a, {topo, r, engine}, node);
          copy.start();
          compute.start();
          std::string error = copy.synchronize();
          if (error.empty()) error = compute.synchronize();
          TIDE_CHECK(error.empty(), error);
          TIDE_CHECK(rc.total == 0 || rep_.reused_slots == (reuse ? rep_.num_slots : 0), rep_.reused_slots, " of ",
                     rep_.num_slots, " slots reused");
          for (size_t b = 0; b < 4; ++b)
            TIDE_CHECK(out[static_cast<size_t>(rc.total) * 4 + b] == 0x5a, "wrote past the output");
          check_documented_order(rc, out.data(), DType::f32, op, topo, r);
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < topo.world_size; ++r)
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r << " of " << topo.num_nodes << " nodes x "
                                                  << topo.local_size << (streams ? ", stream-ordered" : "");
  if (topo.num_nodes > 1) EXPECT_GT(w.mail.bytes, 0);
}

TEST(RsExecutor, RunsStreamOrderedAsOnCuda) {
  uint64_t tag = 101;
  for (auto [nodes, local] : {std::pair{1, 3}, {2, 2}, {3, 1}, {2, 3}})
    for (DType gd : {DType::bf16, DType::f32})
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::premul_sum}) {
        tag = mix(tag, 3);
        run({nodes * local, local, nodes}, true, gd, {op, 0.37}, (tag & 1) != 0, tag);
        if (HasFatalFailure()) return;
      }
}

TEST(RsExecutor, RunsAtOnceOnThreads) {
  uint64_t tag = 7;
  for (auto [nodes, local] : {std::pair{1, 2}, {2, 2}, {3, 2}})
    for (bool reuse : {false, true}) {
      tag = mix(tag, 5);
      run({nodes * local, local, nodes}, false, DType::bf16, {ReduceOp::sum}, reuse, tag);
      if (HasFatalFailure()) return;
    }
}

}  // namespace
}  // namespace tide::test
