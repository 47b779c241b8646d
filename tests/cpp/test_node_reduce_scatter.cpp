// TIDE-RS across nodes (node_param_reduce_scatter) on real ranks: one process per rank, each
// node's ranks on their own host communicator (shared memory within the node only), and an
// engine over the file store between nodes that refuses any message within a node. Every
// rank's sharded gradients must equal, bitwise, the documented order computed here on its
// own (each node's ranks in order into an fp32 partial, then the partials in node order;
// with one rank per node the partial travels in the gradient dtype, the same values),
// lie within a float64 bound of the exact sum, and keep their padding zero; at 1-7 nodes of
// 1-3 ranks, f32, bf16 and f16 gradients into f32 (bf16 also into bf16), sum / avg /
// premul_sum, with and without Slot-Reuse, with staging small enough that windows wrap.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>

#include "test_param_common.hpp"
#include "tide/engine.hpp"

using namespace tide;
using namespace tide::test;

namespace {

// Messages between nodes as store keys "<ns>/m/<from>/<to>/<n>": the n-th message of the pair.
class StoreEngine final : public Engine {
 public:
  StoreEngine(Store& store, std::string ns, plan::Topology topo, int rank)
      : store_(store), ns_(std::move(ns)), topo_(topo), me_(rank) {}
  const char* name() const override { return "test store"; }
  void start(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs,
             std::shared_ptr<const void>) override {
    for (const EngineSend& s : sends) {
      check_peer(s.peer);
      const auto* p = static_cast<const uint8_t*>(s.data);
      store_.set(key(me_, s.peer, sent_[s.peer]++), std::vector<uint8_t>(p, p + s.bytes));
      bytes_ += static_cast<int64_t>(s.bytes);
    }
    pending_.emplace_back(recvs.begin(), recvs.end());
  }
  void finish() override {
    TIDE_REQUIRE(!pending_.empty(), "finish() without start()");
    const std::vector<EngineRecv> recvs = std::move(pending_.front());
    pending_.pop_front();
    for (const EngineRecv& r : recvs) {
      check_peer(r.peer);
      std::vector<uint8_t> v = store_.get(key(r.peer, me_, received_[r.peer]++), std::chrono::seconds(60));
      TIDE_REQUIRE(v.size() == r.bytes, "message of ", v.size(), " bytes from rank ", r.peer, " for a receive of ",
                   r.bytes);
      std::memcpy(r.data, v.data(), v.size());
    }
  }
  int64_t bytes() const { return bytes_; }

 private:
  void check_peer(int peer) const {
    TIDE_REQUIRE(topo_.node_of(peer) != topo_.node_of(me_), "engine message from rank ", me_, " to rank ", peer,
                 " on its own node");
  }
  std::string key(int from, int to, int n) const {
    return detail::concat(ns_, "/m/", from, "/", to, "/", n);
  }
  Store& store_;
  std::string ns_;
  plan::Topology topo_;
  int me_;
  std::map<int, int> sent_, received_;
  std::deque<std::vector<EngineRecv>> pending_;  // per start(), oldest first
  int64_t bytes_ = 0;
};

// The sanitizer build runs every topology with the thinned case list below: it looks for
// memory errors, which every op and dtype pair still reach; the full list runs unsanitized.
#ifdef __SANITIZE_ADDRESS__
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

CommOptions opts() {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  o.staging_bytes = 24 << 10;  // 12 KiB slots: a piece per rank of the group, many windows
  o.num_threads = 1;
  return o;
}

// Returns its staging report (direct_bytes: what it sent straight from the gradients).
StagingReport node_rs_case(Rank& rk, Comm& node, StoreEngine& engine, const plan::Topology& topo, DType gd, DType od,
                  ReduceArgs op, uint64_t tag, bool reuse, bool from_grads) {
  const int ws = topo.world_size, me = rk.rank;
  const RsCase rc(tag, ws, me, gd);
  const auto& [params, layout, grads, out_offs, total] = std::tie(rc.params, rc.layout, rc.grads, rc.out_offs, rc.total);
  const size_t np = params.size();
  const size_t oes = dtype_size(od);
  std::vector<uint8_t> out((static_cast<size_t>(total) + 1) * oes, 0x5a);  // + a sentinel element
  ParamReduceScatter a = rc.args(out.data(), od, op);
  std::shared_ptr<SymmetricBuffer> vacated;
  std::vector<plan::Region> regions;
  if (reuse) {
    vacated = node.allocate_symmetric(64 << 10);  // symmetric within the node
    regions = {{0, 128, 40000}};
    a.reuse = vacated.get();
    a.reuse_regions = regions;
  }
  const TwoLevel nodes{topo, me, &engine};
  a.nodes = &nodes;
  if (from_grads) a.grads_alive = std::make_shared<int>(0);  // rc owns the gradients past the call
  const int64_t engine_bytes = engine.bytes();
  const StagingReport rep = node.param_reduce_scatter(a);
  // With one rank per node (not premul_sum, whose factor applies in the node phase, nor a
  // widening partial) the gradients' contiguous pieces go to the other nodes as they are.
  const bool direct = from_grads && topo.local_size == 1 && topo.num_nodes > 1 && op.op != ReduceOp::premul_sum &&
                      (dtype_size(gd) < 4 || od != DType::f64);
  const int64_t sent = engine.bytes() - engine_bytes;
  if (total > 0) {
    TIDE_REQUIRE(direct ? static_cast<int64_t>(rep.direct_bytes) <= sent : rep.direct_bytes == 0,
                 "sent ", rep.direct_bytes, " of ", sent, " bytes straight from the gradients (one rank per node: ",
                 topo.local_size == 1, ", held for the engine: ", from_grads, ")");
    TIDE_REQUIRE(rep.num_slots >= 1 && (rep.partial_bytes > 0) == (topo.num_nodes > 1), "report: ", rep.num_slots,
                 " slots, ", rep.partial_bytes, " partial bytes at ", topo.num_nodes, " nodes");
    TIDE_REQUIRE(rep.reused_slots == (reuse ? rep.num_slots : 0), rep.reused_slots, " of ", rep.num_slots,
                 " slots reused");
  }

  check_documented_order(rc, out.data(), od, op, topo, me);
  return rep;
}

void run_topology(int num_nodes, int local) {
  const plan::Topology topo{num_nodes * local, local, num_nodes};
  auto out = run_ranks(topo.world_size, [&](Rank& rk) {
    auto store = make_file_store(rk.store_dir);
    const int node_id = topo.node_of(rk.rank);
    auto node = make_host_comm(*store, detail::concat(rk.ns, "/node", node_id), topo.local_rank(rk.rank), local, opts());
    StoreEngine engine(*store, rk.ns, topo, rk.rank);
    uint64_t tag = rk.seed;
    int n = 0;
    size_t direct = 0;
    for (bool reuse : {false, true}) {
      int pair = 0;
      for (auto [gd, od] : {std::pair{DType::f32, DType::f32}, {DType::bf16, DType::f32}, {DType::f16, DType::f32},
                             {DType::bf16, DType::bf16}}) {
        int op_index = 0;
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::premul_sum}) {
          // Fewer cases at the larger topologies (every case is a full collective) and under the
          // sanitizers: one op per dtype pair, in turn, so that every op and every pair still runs.
          if ((topo.world_size > 4 || kSanitized) && op_index++ != pair % 3) continue;
          // Every other case holds the gradients for the engine (direct sends at one rank per node).
          direct += node_rs_case(rk, *node, engine, topo, gd, od, {op, 0.37}, tag = mix(tag, 11), reuse, n++ % 2 == 0)
                        .direct_bytes;
        }
        ++pair;
      }
    }
    if (num_nodes > 1) TIDE_REQUIRE(engine.bytes() > 0, "no byte went through the engine");
    if (num_nodes > 1 && local == 1) TIDE_REQUIRE(direct > 0, "no byte was sent straight from a gradient");
    // The partials' buffer, one case with gradients held and not: where no parameter is
    // Shard(1) every piece leaves straight from the gradient, and only the N - 1 received
    // partials of a window are allocated, not the 2N - 1 of the copying path. (At 2 and 3
    // nodes: two node counts show the formula, and each case is a full collective.)
    if (local == 1 && (num_nodes == 2 || num_nodes == 3)) {
      for (bool shard1 : {false, true}) {
        uint64_t t = tag;
        auto has_shard1 = [&](uint64_t c) {
          const RsCase probe(c, topo.world_size, rk.rank, DType::f32);
          return std::any_of(probe.params.begin(), probe.params.end(), [](const plan::Param& p) { return p.shard_dim == 1; });
        };
        while (has_shard1(t = mix(t, 13)) != shard1) {
        }
        const ReduceArgs sum{ReduceOp::sum, 0.37};
        const size_t held = node_rs_case(rk, *node, engine, topo, DType::f32, DType::f32, sum, t, false, true).partial_bytes;
        const size_t copied = node_rs_case(rk, *node, engine, topo, DType::f32, DType::f32, sum, t, false, false).partial_bytes;
        const size_t nn = static_cast<size_t>(num_nodes);
        // (A Shard(1) piece inside one row is contiguous too: there either size is right.)
        const bool received_only = held * (2 * nn - 1) == copied * (nn - 1);
        TIDE_REQUIRE(copied > 0 && (received_only || (shard1 && held == copied)),
                     "partial bytes ", held, " with the gradients held, ", copied, " without, at ", num_nodes,
                     " nodes", shard1 ? " (a Shard(1) parameter)" : "");
      }
    }
  }, std::chrono::seconds(120));
  EXPECT_TRUE(all_ok(out)) << num_nodes << " nodes x " << local << "\n" << describe(out);
}

TEST(NodeReduceScatter, OneRankPerNodeAtOneToSevenNodes) {
  for (int nodes = 1; nodes <= 7; ++nodes) run_topology(nodes, 1);
}

TEST(NodeReduceScatter, SeveralRanksPerNode) {
  for (auto [nodes, local] : {std::pair{1, 3}, {2, 2}, {3, 2}, {2, 3}}) run_topology(nodes, local);
}

// A rank passing a topology its communicator does not fit is refused by name, on every rank
// of the node, before any data moves.
TEST(NodeReduceScatter, RefusesATopologyThatDoesNotFitTheNode) {
  auto out = run_ranks(2, [](Rank& rk) {
    auto node = rk.comm(opts());
    const plan::Topology wrong{6, 3, 2};  // 3 ranks per node, but the communicator has 2
    auto params = random_params(rk.seed, 6, 4);
    auto layout = plan::plan_group(params, 6);
    std::vector<std::vector<uint8_t>> grads;
    std::vector<const void*> gptr;
    std::vector<int64_t> offs;
    int64_t total = 0;
    for (size_t p = 0; p < params.size(); ++p) {
      grads.push_back(random_elems(DType::f32, numel_of(params[p].shape), p));
      gptr.push_back(grads.back().data());
      offs.push_back(total);
      total += layout.params[p].padded_shard_numel;
    }
    std::vector<float> out(static_cast<size_t>(total));
    ParamReduceScatter a;
    a.layout = &layout;
    a.grads = gptr;
    a.out = out.data();
    a.out_offsets = offs;
    auto store = make_file_store(rk.store_dir);
    StoreEngine engine(*store, rk.ns, wrong, rk.rank);
    const TwoLevel nodes{wrong, rk.rank, &engine};
    a.nodes = &nodes;
    try {
      node->param_reduce_scatter(a);
    } catch (const Error& e) {
      const std::string what = e.what();
      TIDE_REQUIRE(what.find("param_reduce_scatter") != std::string::npos && what.find("topology of 2 nodes x 3") !=
                   std::string::npos, what);
      return;
    }
    TIDE_REQUIRE(false, "no error");
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

}  // namespace
