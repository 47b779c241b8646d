// TIDE-AG across nodes (node_param_all_gather) executed by threads, one per rank: an
// in-process mailbox stands in for the inter-node engine and refuses any message within a
// node; the node peers read each other's storages only within a node. Every rank's
// storages must end bitwise equal to the reference placement of every owner's shard, at
// 1-7 nodes of 1-3 ranks, with storages narrower and wider than the planner's elements.
// Each rank's storages lie in one buffer at the same offsets on every rank (as in the
// symmetric pool), which is also the window of the one-sided engine's runs (OneSidedEngine
// over a host double of NCCL's ncclPutSignal / ncclWaitSignal).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "test_plan_common.hpp"
#include "test_stream.hpp"
#include "tide/engine.hpp"
#include "tide/error.hpp"
#include "tide/one_sided.hpp"

namespace tide {
namespace {
using plan::testing::expand;
using test::MailEngine;
using test::Stream;
using test::StreamEngine;

// The value of element i of owner's shard of param, es bytes, never the fill byte 0xEE.
void element(int owner, int param, int64_t i, size_t es, std::byte* out) {
  for (size_t b = 0; b < es; ++b)
    out[b] = static_cast<std::byte>((owner * 131 + param * 31 + i * 7 + static_cast<int64_t>(b) * 3) % 0xE0);
}

struct World {
  const plan::GroupLayout& layout;
  const plan::Topology topo;
  const size_t es;
  std::vector<size_t> offsets;                 // [param]: where its storage lies in a rank's window
  std::vector<std::vector<std::byte>> window;  // [rank]: all of the rank's storages
  std::mutex mu;
  std::condition_variable cv;
  test::Mailboxes mail;  // the two-sided engine's
  std::map<std::pair<int, int>, uint64_t> signals;                          // (to, from): one-sided signals
  std::vector<uint64_t> progress;
  std::vector<std::unique_ptr<std::barrier<>>> node_barriers;
  std::atomic<int64_t> local_bytes{0}, put_bytes{0};

  World(const plan::GroupLayout& g, plan::Topology t, size_t elem)
      : layout(g), topo(t), es(elem), window(t.world_size), mail(t), progress(t.world_size, 0) {
    for (int n = 0; n < t.num_nodes; ++n) node_barriers.push_back(std::make_unique<std::barrier<>>(t.local_size));
    size_t at = 0;
    for (const plan::ParamLayout& p : g.params) {
      offsets.push_back(at);
      at += (static_cast<size_t>(p.storage_numel) * es + 63) / 64 * 64;
    }
    for (auto& w : window) w.assign(at, std::byte{0xEE});
  }
  std::byte* storage(int r, size_t p) { return window[r].data() + offsets[p]; }
  std::span<std::byte> storage_span(int r, size_t p) {
    return {storage(r, p), static_cast<size_t>(layout.params[p].storage_numel) * es};
  }
  // What the caller does before node_param_all_gather: its own shard to its placement.
  void place_own(int r) {
    for (size_t p = 0; p < layout.params.size(); ++p) {
      int64_t i = 0;
      for (int64_t e : expand(layout.params[p].shards[r].placement))
        element(r, static_cast<int>(p), i++, es, storage(r, p) + static_cast<size_t>(e) * es);
    }
  }
};

class ThreadPeers : public NodePeers {
 public:
  ThreadPeers(World& w, int rank) : w_(w), me_(rank) {}
  const std::byte* storage(int rank, int param) override {
    TIDE_CHECK(w_.topo.node_of(rank) == w_.topo.node_of(me_), "node-local read of rank ", rank, " by ", me_);
    if (rank != me_) w_.local_bytes += 1;
    return w_.storage(rank, static_cast<size_t>(param));
  }
  void publish(uint64_t value) override {
    std::lock_guard lock(w_.mu);
    w_.progress[me_] = value;
    w_.cv.notify_all();
  }
  void await(int rank, uint64_t value) override {
    std::unique_lock lock(w_.mu);
    w_.cv.wait(lock, [&] { return w_.progress[rank] >= value; });
  }
  void barrier() override { w_.node_barriers[w_.topo.node_of(me_)]->arrive_and_wait(); }

 private:
  World& w_;
  int me_;
};

// NCCL's one-sided model (include/tide/one_sided.hpp) on host threads: a put lands in the
// peer's window at once and adds one to the peer's count of this rank's signals; a wait
// blocks until the count reaches what this rank's waits so far add up to. Refuses peers on
// its own node, as the mailbox does.
class HostWire : public OneSidedWire {
 public:
  HostWire(World& w, int rank) : w_(w), me_(rank) {}
  int64_t window_offset(const void* p, size_t bytes) const override {
    const std::byte* base = w_.window[me_].data();
    const auto* q = static_cast<const std::byte*>(p);
    return q >= base && q + bytes <= base + w_.window[me_].size() ? q - base : -1;
  }
  void signal(std::span<const int> peers) override {
    std::lock_guard lock(w_.mu);
    for (int p : peers) ++w_.signals[{across(p), me_}];
    w_.cv.notify_all();
  }
  void put(std::span<const Put> puts) override {
    std::lock_guard lock(w_.mu);
    for (const Put& p : puts) {
      TIDE_CHECK(p.offset + p.bytes <= w_.window[across(p.peer)].size(), "a put past the peer's window");
      TIDE_CHECK(window_offset(p.src, p.bytes) >= 0, "a put from outside the window");
      std::memcpy(w_.window[p.peer].data() + p.offset, p.src, p.bytes);
      ++w_.signals[{p.peer, me_}];
      w_.put_bytes += static_cast<int64_t>(p.bytes);
    }
    w_.cv.notify_all();
  }
  void wait(std::span<const Wait> waits) override {
    std::unique_lock lock(w_.mu);
    for (const Wait& x : waits) {
      TIDE_CHECK(x.signals > 0, "a wait for ", x.signals, " signals");
      const uint64_t target = waited_[x.peer] += static_cast<uint64_t>(x.signals);
      if (!w_.cv.wait_for(lock, std::chrono::seconds(60), [&] { return w_.signals[{me_, x.peer}] >= target; }))
        throw TimeoutError(detail::concat("rank ", me_, " waited for ", target, " signals from rank ", x.peer,
                                          ", has ", w_.signals[{me_, x.peer}]));
    }
  }

 private:
  int across(int peer) const {
    TIDE_CHECK(w_.topo.node_of(peer) != w_.topo.node_of(me_), "one-sided operation within a node");
    return peer;
  }
  World& w_;
  int me_;
  std::map<int, uint64_t> waited_;
};

class StreamPeers : public NodePeers {
 public:
  StreamPeers(NodePeers& inner, Stream& s) : inner_(inner), s_(s) {}
  const std::byte* storage(int rank, int param) override { return inner_.storage(rank, param); }
  void publish(uint64_t value) override { s_.enqueue([this, value] { inner_.publish(value); }); }
  void await(int rank, uint64_t value) override { s_.enqueue([this, rank, value] { inner_.await(rank, value); }); }
  void barrier() override { s_.enqueue([this] { inner_.barrier(); }); }
  void copy(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) override {
    s_.enqueue([=, this] { inner_.copy(dst, dst_pitch, src, src_pitch, width, rows); });
  }
  std::shared_ptr<std::byte> scratch(size_t bytes) override {
    // Poisoned, and freed in queue order (as cudaFreeAsync): a read before the move into
    // it or after the free shows up as wrong bytes or under ASan.
    auto* p = new std::byte[bytes];
    std::memset(p, 0xAB, bytes);
    Stream* s = &s_;
    return std::shared_ptr<std::byte>(p, [s](std::byte* q) { s->enqueue([q] { delete[] q; }); });
  }

 private:
  NodePeers& inner_;
  Stream& s_;
};

class StreamWire : public OneSidedWire {
 public:
  StreamWire(OneSidedWire& inner, Stream& s) : inner_(inner), s_(s) {}
  int64_t window_offset(const void* p, size_t bytes) const override { return inner_.window_offset(p, bytes); }
  void signal(std::span<const int> peers) override {
    s_.enqueue([this, v = std::vector<int>(peers.begin(), peers.end())] { inner_.signal(v); });
  }
  void put(std::span<const Put> puts) override {
    s_.enqueue([this, v = std::vector<Put>(puts.begin(), puts.end())] { inner_.put(v); });
  }
  void wait(std::span<const Wait> waits) override {
    s_.enqueue([this, v = std::vector<Wait>(waits.begin(), waits.end())] { inner_.wait(v); });
  }

 private:
  OneSidedWire& inner_;
  Stream& s_;
};

// Runs the all-gather twice (progress values carry on) and checks every rank's storages;
// `streams`: every rank's moves, progress and exchanges go through a Stream.
// `cached`: each rank runs its own part of the schedule, from a NodeScheduleCache.
// `one_sided`: the engine is OneSidedEngine (contiguous blocks put into the peers' windows,
// packed ones through the mailbox); the second run's storages are refilled late on every
// other node, so a put that did not wait for its receiver's "ready" is overwritten.
void run(const plan::GroupLayout& g, plan::Topology topo, size_t es, int64_t pace_bytes, bool streams = false,
         bool cached = false, bool one_sided = false) {
  const int64_t pace = plan::planner_pace(g, pace_bytes, static_cast<int64_t>(es));
  const plan::NodeAllGatherSchedule schedule = plan::node_allgather_schedule(g, topo, pace);
  World w(g, topo, es);
  std::vector<std::string> errors(static_cast<size_t>(topo.world_size));
  std::vector<std::thread> threads;
  for (int r = 0; r < topo.world_size; ++r)
    threads.emplace_back([&, r] {
      try {
        MailEngine mail(w.mail, r);
        ThreadPeers node(w, r);
        Stream stream;
        StreamEngine queued_mail(mail, stream);
        StreamPeers queued_node(node, stream);
        HostWire wire(w, r);
        StreamWire queued_wire(wire, stream);
        Engine& two_sided = streams ? static_cast<Engine&>(queued_mail) : mail;
        OneSidedEngine puts(streams ? static_cast<OneSidedWire&>(queued_wire) : wire, two_sided, r, "test one-sided");
        Engine& engine = one_sided ? static_cast<Engine&>(puts) : two_sided;
        NodePeers& peers = streams ? static_cast<NodePeers&>(queued_node) : node;
        std::vector<void*> storages;
        for (size_t p = 0; p < g.params.size(); ++p) storages.push_back(w.storage(r, p));
        NodeScheduleCache cache;
        const plan::NodeAllGatherSchedule& mine = cached ? cache.get(g, topo, pace, r) : schedule;
        if (cached) {
          TIDE_CHECK(&cache.get(g, topo, pace, r) == &mine, "the cache planned again");
          for (const plan::NodeLocalCopy& c : mine.node_local) TIDE_CHECK(c.block.dst_rank == r, "another rank's copy");
          for (const plan::Step& step : mine.inter_node.steps)
            for (const plan::Round& round : step.rounds)
              for (const plan::Transfer& tr : round.transfers)
                TIDE_CHECK(tr.src_rank == r || tr.dst_rank == r, "another rank's transfer");
          TIDE_CHECK(mine.inter_node.steps.size() == schedule.inter_node.steps.size(), "steps dropped");
        }
        uint64_t base = 0;
        for (int rep = 0; rep < 2; ++rep) {  // the second starts from fill bytes again
          if (rep) {
            node.barrier();  // nobody reads the first result any more
            if (one_sided && topo.node_of(r) % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
            std::fill(w.window[r].begin(), w.window[r].end(), std::byte{0xEE});
            node.barrier();
          }
          w.place_own(r);
          base = node_param_all_gather({&g, &mine, r, storages, es, base, one_sided}, engine, peers);
          const std::string error = stream.synchronize();
          TIDE_CHECK(error.empty(), error);
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < topo.world_size; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  std::vector<std::byte> want(es);
  for (int r = 0; r < topo.world_size; ++r)
    for (size_t p = 0; p < g.params.size(); ++p) {
      std::vector<std::byte> ref(static_cast<size_t>(g.params[p].storage_numel) * es, std::byte{0xEE});
      for (int owner = 0; owner < topo.world_size; ++owner) {
        int64_t i = 0;
        for (int64_t e : expand(g.params[p].shards[owner].placement))
          element(owner, static_cast<int>(p), i++, es, ref.data() + static_cast<size_t>(e) * es);
      }
      const std::span<std::byte> got = w.storage_span(r, p);
      ASSERT_TRUE(std::equal(ref.begin(), ref.end(), got.begin(), got.end()))
          << "rank " << r << " param " << p << " (" << topo.num_nodes << " nodes x " << topo.local_size
          << ", " << es << "-byte storage)";
    }
  int64_t numel = 0;
  for (const plan::ParamLayout& p : g.params) numel += p.numel;
  if (numel > 0 && topo.num_nodes > 1) EXPECT_GT(w.mail.bytes + w.put_bytes.load(), 0);
  if (!one_sided) EXPECT_EQ(w.put_bytes.load(), 0);
  if (numel > 0 && topo.local_size > 1) EXPECT_GT(w.local_bytes.load(), 0);
}

TEST(NodeAllGather, MatchesTheReferenceAtOneToSevenNodes) {
  std::mt19937 rng(2026);
  for (int nodes = 1; nodes <= 7; ++nodes)
    for (int local = 1; local <= 3; ++local)
      for (size_t es : {size_t{2}, size_t{8}}) {
        const int ws = nodes * local;
        const plan::GroupLayout g = plan::plan_group(plan::testing::random_params(rng, ws), ws);
        run(g, {ws, local, nodes}, es, std::vector<int64_t>{16, 40, 1 << 20}[(nodes + local) % 3]);
        if (HasFatalFailure()) return;
      }
}

TEST(NodeAllGather, RunsStreamOrdered) {
  // The CUDA executor's situation: every move, progress word and exchange is enqueued and
  // runs later, in order, on a queue of the rank's own (Shard(1) for the packed buffers).
  std::mt19937 rng(7);
  for (auto [nodes, local] : {std::pair{2, 2}, {3, 2}, {5, 1}, {2, 3}}) {
    const int ws = nodes * local;
    const plan::GroupLayout g = plan::plan_group(plan::testing::random_params(rng, ws), ws);
    run(g, {ws, local, nodes}, 4, 40, true);
    if (HasFatalFailure()) return;
  }
  const plan::GroupLayout g = plan::plan_group({{{5, 12}, 4, 1}, {{7}, 2, 0}}, 6);
  run(g, {6, 3, 2}, 4, 1 << 20, true);  // unpaced: whole strided blocks, packed
  run(g, {6, 2, 3}, 4, 1 << 20, true);
}

TEST(NodeAllGather, EachRanksCachedPartOfTheScheduleSuffices) {
  std::mt19937 rng(11);
  for (auto [nodes, local] : {std::pair{2, 2}, {3, 2}, {5, 1}, {4, 3}, {7, 2}}) {
    const int ws = nodes * local;
    const plan::GroupLayout g = plan::plan_group(plan::testing::random_params(rng, ws), ws);
    run(g, {ws, local, nodes}, 2, 40, false, true);
    if (HasFatalFailure()) return;
  }
  const plan::GroupLayout g = plan::plan_group({{{5, 12}, 4, 1}, {{7}, 2, 0}}, 6);
  run(g, {6, 3, 2}, 4, 1 << 20, true, true);  // stream-ordered too
}

TEST(NodeAllGather, ShardOnDimOneTravelsPackedAcrossNodes) {
  // Shard(1): every block is strided in the unsharded storage.
  const plan::GroupLayout g = plan::plan_group({{{5, 12}, 4, 1}, {{7}, 2, 0}}, 6);
  run(g, {6, 2, 3}, 4, 24);
  run(g, {6, 3, 2}, 4, 1 << 20);
}

TEST(NodeAllGather, OneSidedPutsMatchTheReference) {
  // OneSidedEngine: contiguous blocks put straight into the peers' windows, with several
  // rounds per step (small paces: two exchanges in flight share each peer's signal count).
  std::mt19937 rng(29);
  for (int nodes = 1; nodes <= 7; ++nodes)
    for (int local = 1; local <= 3; local += 2) {
      const int ws = nodes * local;
      const plan::GroupLayout g = plan::plan_group(plan::testing::random_params(rng, ws), ws);
      run(g, {ws, local, nodes}, 2, std::vector<int64_t>{16, 40, 1 << 20}[(nodes + local) % 3], false, false, true);
      if (HasFatalFailure()) return;
    }
}

TEST(NodeAllGather, OneSidedPutsRunStreamOrderedBesidePackedBlocks) {
  // As on CUDA: every put, signal and wait is enqueued; Shard(1) blocks travel packed through
  // the two-sided engine in the same exchanges as the puts of the Shard(0) parameter.
  std::mt19937 rng(31);
  for (auto [nodes, local] : {std::pair{2, 2}, {3, 2}, {5, 1}}) {
    const int ws = nodes * local;
    const plan::GroupLayout g = plan::plan_group(plan::testing::random_params(rng, ws), ws);
    run(g, {ws, local, nodes}, 4, 40, true, true, true);
    if (HasFatalFailure()) return;
  }
  const plan::GroupLayout g = plan::plan_group({{{5, 12}, 4, 1}, {{7, 3}, 2, 0}}, 6);
  run(g, {6, 2, 3}, 4, 24, true, false, true);
  run(g, {6, 3, 2}, 4, 1 << 20, false, false, true);
}

// Two nodes of one rank, one parameter of 8 four-byte elements, and a rank's engine over
// the host wire (the mailbox for the rest).
struct TwoNodes {
  const plan::GroupLayout g = plan::plan_group({{{8}, 4, 0}}, 2);
  World w{g, {2, 1, 2}, 4};
};
struct OneRank {
  OneRank(World& w, int rank) : wire(w, rank), mail(w.mail, rank), engine(wire, mail, rank, "test one-sided") {}
  HostWire wire;
  MailEngine mail;
  OneSidedEngine engine;
};

TEST(OneSidedEngine, ASymmetricMessageOutsideTheWindowIsAnError) {
  TwoNodes nodes;
  OneRank rank0(nodes.w, 0);
  OneSidedEngine& engine = rank0.engine;
  std::vector<std::byte> elsewhere(16);
  const EngineSend send{1, elsewhere.data(), elsewhere.size(), true};
  try {
    engine.start(std::span<const EngineSend>(&send, 1), {}, nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0: a send of 16 bytes to rank 1 is marked symmetric but lies outside"),
              std::string::npos)
        << e.what();
  }
  // After a failure the signal counts no longer pair up: the engine refuses to go on.
  EXPECT_THROW(engine.start({}, {}, nullptr), Error);
}

TEST(OneSidedEngine, AbandonKeepsTheBuffersAndRefusesToGoOn) {
  TwoNodes nodes;
  OneRank rank0(nodes.w, 0);
  OneSidedEngine& engine = rank0.engine;
  const EngineRecv recv{1, nodes.w.storage(0, 0), 16, true};  // rank 1 never puts: a collective that failed
  auto buffers = std::make_shared<int>(0);
  engine.start({}, std::span<const EngineRecv>(&recv, 1), buffers);
  engine.abandon();
  EXPECT_EQ(buffers.use_count(), 2) << "a late put may still land: the buffers stay with the engine";
  EXPECT_THROW(engine.start({}, {}, nullptr), Error);
}

TEST(OneSidedEngine, TheHandshakeCountsLikeAnExchange) {
  // After the handshake's signal, rank 1's first put must still wait for rank 0's "ready" of
  // the exchange (the handshake's signal must not pass for it): rank 0 refills its window
  // late, and a put that came early would be overwritten.
  TwoNodes nodes;
  World& w = nodes.w;
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        OneRank me(w, r);
        OneSidedEngine& engine = me.engine;
        const int peer = 1 - r;
        engine.handshake(std::span<const int>(&peer, 1), std::span<const int>(&peer, 1));
        if (r == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          std::fill(w.window[0].begin(), w.window[0].end(), std::byte{0xEE});
        }
        std::byte* mine = w.storage(r, 0) + static_cast<size_t>(r) * 16;
        std::fill(mine, mine + 16, static_cast<std::byte>(0x10 + r));
        const EngineSend send{peer, mine, 16, true};
        const EngineRecv recv{peer, w.storage(r, 0) + static_cast<size_t>(peer) * 16, 16, true};
        engine.start(std::span<const EngineSend>(&send, 1), std::span<const EngineRecv>(&recv, 1), nullptr);
        engine.finish();
        for (size_t i = 0; i < 16; ++i)
          TIDE_CHECK(static_cast<std::byte*>(recv.data)[i] == static_cast<std::byte>(0x10 + peer), "rank ", r,
                     ": byte ", i, " of rank ", peer, "'s block is not what it put");
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(w.put_bytes.load(), 32);
}

}  // namespace
}  // namespace tide

namespace tide {
namespace {

// The engines' shared bookkeeping: a failed exchange is kept with its buffers, and its error
// names the engine and the peers (it once moved the exchange away before formatting them).
TEST(InFlight, AFailedExchangeIsKeptAndNamesItsPeers) {
  struct Exchange {
    std::shared_ptr<const void> keep_alive;
    std::string peers;
  };
  InFlight<Exchange> exchanges;
  auto buffers = std::make_shared<int>(0);
  Exchange& e = exchanges.start();
  e.keep_alive = buffers;
  e.peers = "2, 6";
  try {
    exchanges.finish("test engine", [](Exchange&) { throw Error("peer gone"); });
    FAIL() << "no error";
  } catch (const TimeoutError& err) {
    EXPECT_STREQ(err.what(), "inter-node exchange over test engine with ranks 2, 6 failed: peer gone");
  }
  EXPECT_EQ(buffers.use_count(), 2) << "a late delivery may still land: the buffers stay with the engine";
  EXPECT_TRUE(exchanges.empty());
  EXPECT_THROW(exchanges.finish("test engine", [](Exchange&) {}), Error);  // nothing in flight
}

}  // namespace
}  // namespace tide
