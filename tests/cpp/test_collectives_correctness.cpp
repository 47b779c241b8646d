// Every collective on 1..4 ranks (one forked process per rank), every dtype x reduce op,
// sizes 0, 1, odd, and larger than the staging area (small staging here, so the pipeline
// wraps many times). Inputs are fresh random data; each rank regenerates every rank's
// inputs from the shared seed and checks its outputs against an independent reference.
#include <gtest/gtest.h>

#include <numeric>

#include "test_collectives_ref.hpp"
#include "test_host_harness.hpp"

using namespace tide;
using namespace tide::test;

namespace {

constexpr size_t kStaging = 16 << 10;  // per rank: 2 slots of 8 KiB

CommOptions small_staging() {
  CommOptions o;
  o.timeout = std::chrono::seconds(20);
  o.staging_bytes = kStaging;
  o.num_threads = 1;
  return o;
}

// 0, 1, odd, and ~3x the staging area.
std::vector<size_t> sizes_for(size_t elem_size) { return {0, 1, 7, 1001, 3 * kStaging / elem_size + 13}; }

uint64_t data_seed(const Rank& rk, int rank, uint64_t tag) { return mix(mix(rk.seed, rank), tag); }

class ByWorldSize : public ::testing::TestWithParam<int> {
 protected:
  void run(const std::function<void(Rank&)>& fn) {
    auto out = run_ranks(GetParam(), fn, std::chrono::seconds(60));
    EXPECT_TRUE(all_ok(out)) << describe(out);
    outcomes = out;
  }
  std::vector<Outcome> outcomes;
};

TEST_P(ByWorldSize, AllGather) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    const int ws = rk.world_size;
    uint64_t tag = 0;
    for (DType dt : {DType::f32, DType::bf16, DType::u8, DType::f64})
      for (size_t count : sizes_for(dtype_size(dt))) {
        ++tag;
        const size_t bytes = count * dtype_size(dt);
        auto in = random_elems(dt, count, data_seed(rk, rk.rank, tag));
        std::vector<std::vector<uint8_t>> outs(ws, std::vector<uint8_t>(bytes + 1, 0xcd));
        std::vector<void*> ptrs;
        for (auto& o : outs) ptrs.push_back(o.data());
        comm->all_gather(in.data(), ptrs, count, dt);
        for (int r = 0; r < ws; ++r) {
          auto want = random_elems(dt, count, data_seed(rk, r, tag));
          TIDE_REQUIRE(bytes == 0 || std::memcmp(outs[r].data(), want.data(), bytes) == 0, "all_gather ", dtype_name(dt), " count=",
                       count, ": wrong data from rank ", r);
          TIDE_REQUIRE(outs[r][bytes] == 0xcd, "all_gather wrote past the end of outs[", r, "]");
        }
      }
  });
}

void reduce_scatter_case(Rank& rk, Comm& comm, DType in_dt, DType out_dt, ReduceOp op, size_t count, uint64_t tag) {
  const int ws = rk.world_size;
  ReduceArgs args{op, premul_factor(in_dt)};
  // Rank r's input for destination d: seed (r, tag, d).
  auto input = [&](int r, int d) { return random_elems(in_dt, count, data_seed(rk, r, tag * 64 + d)); };
  std::vector<std::vector<uint8_t>> mine;
  std::vector<const void*> ins;
  for (int d = 0; d < ws; ++d) mine.push_back(input(rk.rank, d));
  for (auto& m : mine) ins.push_back(m.data());
  std::vector<uint8_t> out(count * dtype_size(out_dt) + 1, 0xcd);
  comm.reduce_scatter(ins, out.data(), count, in_dt, out_dt, args);
  std::vector<std::vector<uint8_t>> all;
  std::vector<const void*> srcs;
  for (int r = 0; r < ws; ++r) all.push_back(input(r, rk.rank));
  for (auto& a : all) srcs.push_back(a.data());
  std::string err = check_reduction(out.data(), out_dt, srcs, in_dt, count, args);
  TIDE_REQUIRE(err.empty(), "reduce_scatter: ", err);
  TIDE_REQUIRE(out[count * dtype_size(out_dt)] == 0xcd, "reduce_scatter wrote past the end");
}

TEST_P(ByWorldSize, ReduceScatterEveryDtypeAndOp) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    uint64_t tag = 0;
    for (DType dt : kAllDTypes)
      for (ReduceOp op : kAllOps)
        if (op_defined(dt, op))
          for (size_t count : sizes_for(dtype_size(dt))) reduce_scatter_case(rk, *comm, dt, dt, op, count, ++tag);
  });
}

TEST_P(ByWorldSize, ReduceScatterMixedPrecision) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    uint64_t tag = 1000;
    for (DType in : {DType::bf16, DType::f16})
      for (ReduceOp op : kAllOps)
        for (size_t count : sizes_for(4)) reduce_scatter_case(rk, *comm, in, DType::f32, op, count, ++tag);
  });
}

TEST_P(ByWorldSize, AllReduceEveryDtypeAndOpIdenticalOnAllRanks) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    const int ws = rk.world_size;
    uint64_t tag = 0, hash = 0;
    for (DType dt : kAllDTypes)
      for (ReduceOp op : kAllOps) {
        if (!op_defined(dt, op)) continue;
        for (size_t count : sizes_for(dtype_size(dt))) {
          ++tag;
          ReduceArgs args{op, premul_factor(dt)};
          auto buf = random_elems(dt, count, data_seed(rk, rk.rank, tag));
          buf.push_back(0xcd);
          comm->all_reduce(buf.data(), count, dt, args);
          std::vector<std::vector<uint8_t>> all;
          std::vector<const void*> srcs;
          for (int r = 0; r < ws; ++r) all.push_back(random_elems(dt, count, data_seed(rk, r, tag)));
          for (auto& a : all) srcs.push_back(a.data());
          std::string err = check_reduction(buf.data(), dt, srcs, dt, count, args);
          TIDE_REQUIRE(err.empty(), "all_reduce: ", err);
          TIDE_REQUIRE(buf.back() == 0xcd, "all_reduce wrote past the end");
          hash = fnv(buf.data(), count * dtype_size(dt), hash);
        }
      }
    rk.report("hash=" + std::to_string(hash));
  });
  // Bitwise identical results on every rank (bf16/f16 included).
  for (auto& o : outcomes) EXPECT_EQ(o.text, outcomes[0].text);
}

TEST_P(ByWorldSize, ReduceToEachRoot) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    const int ws = rk.world_size;
    uint64_t tag = 0;
    for (DType dt : {DType::f32, DType::bf16, DType::i32, DType::f64})
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg})
        for (size_t count : sizes_for(dtype_size(dt)))
          for (int root = 0; root < ws; ++root) {
            ++tag;
            ReduceArgs args{op, 1.0};
            auto orig = random_elems(dt, count, data_seed(rk, rk.rank, tag));
            auto buf = orig;
            comm->reduce(buf.data(), count, dt, args, root);
            if (rk.rank != root) {
              TIDE_REQUIRE(buf == orig, "reduce modified a non-root buffer");
              continue;
            }
            std::vector<std::vector<uint8_t>> all;
            std::vector<const void*> srcs;
            for (int r = 0; r < ws; ++r) all.push_back(random_elems(dt, count, data_seed(rk, r, tag)));
            for (auto& a : all) srcs.push_back(a.data());
            std::string err = check_reduction(buf.data(), dt, srcs, dt, count, args);
            TIDE_REQUIRE(err.empty(), "reduce root=", root, ": ", err);
          }
  });
}

TEST_P(ByWorldSize, BroadcastGatherScatterFromEachRoot) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    const int ws = rk.world_size;
    uint64_t tag = 0;
    for (size_t bytes : sizes_for(1))
      for (int root = 0; root < ws; ++root) {
        ++tag;
        // broadcast
        auto buf = random_elems(DType::u8, bytes, data_seed(rk, rk.rank, tag));
        comm->broadcast(buf.data(), bytes, root);
        TIDE_REQUIRE(buf == random_elems(DType::u8, bytes, data_seed(rk, root, tag)), "broadcast bytes=", bytes,
                     " root=", root);
        // gather
        auto in = random_elems(DType::u8, bytes, data_seed(rk, rk.rank, tag + 100000));
        std::vector<std::vector<uint8_t>> outs;
        std::vector<void*> ptrs;
        if (rk.rank == root) {
          outs.assign(ws, std::vector<uint8_t>(bytes));
          for (auto& o : outs) ptrs.push_back(o.data());
        }
        comm->gather(in.data(), ptrs, bytes, root);
        if (rk.rank == root)
          for (int r = 0; r < ws; ++r)
            TIDE_REQUIRE(outs[r] == random_elems(DType::u8, bytes, data_seed(rk, r, tag + 100000)), "gather bytes=",
                         bytes, " root=", root, " from rank ", r);
        // scatter: root's piece for rank d is seeded by (root, tag, d)
        std::vector<std::vector<uint8_t>> pieces;
        std::vector<const void*> ins;
        if (rk.rank == root) {
          for (int d = 0; d < ws; ++d) pieces.push_back(random_elems(DType::u8, bytes, data_seed(rk, root, tag * 64 + d)));
          for (auto& p : pieces) ins.push_back(p.data());
        }
        std::vector<uint8_t> out(bytes);
        comm->scatter(ins, out.data(), bytes, root);
        TIDE_REQUIRE(out == random_elems(DType::u8, bytes, data_seed(rk, root, tag * 64 + rk.rank)), "scatter bytes=",
                     bytes, " root=", root);
      }
  });
}

TEST_P(ByWorldSize, AllToAllUnevenSizes) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    const int ws = rk.world_size;
    // Bytes from s to r: varies per pair, includes 0 and sizes beyond the staging area.
    auto pair_bytes = [&](int s, int r, int round) -> size_t {
      size_t v = mix(mix(rk.seed, round), s * 16 + r) % 5;
      return std::vector<size_t>{0, 1, 333, 4097, 3 * kStaging + 5}[v];
    };
    for (int round = 0; round < 4; ++round) {
      std::vector<size_t> sb(ws), so(ws), rb(ws), ro(ws);
      size_t stot = 0, rtot = 0;
      for (int p = 0; p < ws; ++p) {
        sb[p] = pair_bytes(rk.rank, p, round);
        so[p] = stot;
        stot += sb[p] + 3;  // gaps between segments
        rb[p] = pair_bytes(p, rk.rank, round);
        ro[p] = rtot;
        rtot += rb[p] + 5;
      }
      std::vector<uint8_t> in(stot), out(rtot, 0xcd);
      for (int p = 0; p < ws; ++p) {
        auto d = random_elems(DType::u8, sb[p], data_seed(rk, rk.rank, round * 64 + p));
        std::copy(d.begin(), d.end(), in.begin() + so[p]);
      }
      comm->all_to_all(in.data(), sb, so, out.data(), rb, ro);
      for (int p = 0; p < ws; ++p) {
        auto want = random_elems(DType::u8, rb[p], data_seed(rk, p, round * 64 + rk.rank));
        TIDE_REQUIRE(std::equal(want.begin(), want.end(), out.begin() + ro[p]), "all_to_all round ", round,
                     ": wrong bytes from rank ", p);
        TIDE_REQUIRE(out[ro[p] + rb[p]] == 0xcd, "all_to_all wrote into a gap");
      }
    }
  });
}

TEST_P(ByWorldSize, SendRecvRingAndPairs) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    const int ws = rk.world_size, me = rk.rank;
    if (ws == 1) return;
    // Small messages around a ring: everyone sends first (eager sends do not block).
    for (int tag = 0; tag < 3; ++tag) {
      const size_t bytes = 100 + tag;
      auto msg = random_elems(DType::u8, bytes, data_seed(rk, me, tag));
      comm->send(msg.data(), bytes, (me + 1) % ws, tag);
      std::vector<uint8_t> got(bytes);
      const int from = (me + ws - 1) % ws;
      comm->recv(got.data(), bytes, from, tag);
      TIDE_REQUIRE(got == random_elems(DType::u8, bytes, data_seed(rk, from, tag)), "ring message ", tag);
    }
    // Every ordered pair, sizes 0, 1 and larger than the channel ring, in order per pair.
    for (int a = 0; a < ws; ++a)
      for (int b = 0; b < ws; ++b) {
        if (a == b || (me != a && me != b)) continue;
        for (size_t bytes : {size_t{0}, size_t{1}, size_t{50000}}) {
          const int tag = static_cast<int>(a * 100 + b * 10 + bytes % 7);
          if (me == a) {
            auto msg = random_elems(DType::u8, bytes, data_seed(rk, a, 1000 + b * 7 + bytes));
            comm->send(msg.data(), bytes, b, tag);
          } else {
            std::vector<uint8_t> got(bytes);
            comm->recv(got.data(), bytes, a, tag);
            TIDE_REQUIRE(got == random_elems(DType::u8, bytes, data_seed(rk, a, 1000 + b * 7 + bytes)), "pair ", a,
                         "->", b, " bytes=", bytes);
          }
        }
      }
    comm->barrier();
  });
}

// Grouped sends and receives (torch's batch_isend_irecv): each rank sends to both ring
// neighbours before receiving, messages many times the channel ring (single sends then
// receives deadlock there), several to one peer in order (at world size 2 both neighbours
// are one peer: eight in order), 0 and 1 bytes among them.
TEST_P(ByWorldSize, GroupedSendRecvBothWaysAroundTheRing) {
  run([](Rank& rk) {
    auto comm = rk.comm(small_staging());
    const int ws = rk.world_size, me = rk.rank;
    if (ws == 1) return;
    const int next = (me + 1) % ws, prev = (me + ws - 1) % ws;
    const std::vector<size_t> sizes{40 * kStaging + 3, 0, 1, 5 * kStaging};
    auto message = [&](int from, int to, size_t i) {
      return random_elems(DType::u8, sizes[i], data_seed(rk, from, 7000 + static_cast<uint64_t>(to) * 16 + i));
    };
    for (int round = 0; round < 2; ++round) {
      std::vector<std::vector<uint8_t>> out, in;
      std::vector<P2POp> ops;
      for (int to : {next, prev}) {
        for (size_t i = 0; i < sizes.size(); ++i) {
          out.push_back(message(me, to, i));
          ops.push_back({true, out.back().data(), sizes[i], to, static_cast<int>(i)});
        }
      }
      for (int from : {prev, next}) {
        for (size_t i = 0; i < sizes.size(); ++i) {
          in.emplace_back(sizes[i]);
          ops.push_back({false, in.back().data(), sizes[i], from, static_cast<int>(i)});
        }
      }
      comm->send_recv(ops);
      for (const P2POp& op : ops) {
        if (op.send) continue;
        const size_t i = static_cast<size_t>(op.tag);
        const auto* got = static_cast<const uint8_t*>(op.buf);
        TIDE_REQUIRE(std::vector<uint8_t>(got, got + op.bytes) == message(op.peer, me, i), "round ", round,
                     ": message ", i, " from rank ", op.peer);
      }
    }
    comm->barrier();
  });
}

TEST_P(ByWorldSize, SeveralCommunicatorsInterleaved) {
  run([](Rank& rk) {
    auto a = rk.comm(small_staging(), "/a");
    CommOptions big;
    big.timeout = std::chrono::seconds(20);
    big.num_threads = 2;  // exercises the thread pool
    auto b = rk.comm(big, "/b");
    const int ws = rk.world_size;
    const size_t count = (3 << 20) / 4 + 5;  // 3 MiB of f32: > one 2 MiB default slot
    for (int round = 0; round < 2; ++round) {
      auto x = random_elems(DType::f32, count, data_seed(rk, rk.rank, round));
      std::vector<std::vector<uint8_t>> outs(ws, std::vector<uint8_t>(count * 4));
      std::vector<void*> ptrs;
      for (auto& o : outs) ptrs.push_back(o.data());
      b->all_gather(x.data(), ptrs, count, DType::f32);
      auto y = x;
      a->all_reduce(y.data(), 1001, DType::f32, {});
      b->all_reduce(x.data(), count, DType::f32, {});
      std::vector<std::vector<uint8_t>> all;
      std::vector<const void*> srcs;
      for (int r = 0; r < ws; ++r) all.push_back(random_elems(DType::f32, count, data_seed(rk, r, round)));
      for (auto& s : all) srcs.push_back(s.data());
      for (int r = 0; r < ws; ++r) TIDE_REQUIRE(outs[r] == all[r], "all_gather on comm b, rank ", r);
      TIDE_REQUIRE(check_reduction(x.data(), DType::f32, srcs, DType::f32, count, {}).empty(), "all_reduce on b");
      TIDE_REQUIRE(check_reduction(y.data(), DType::f32, srcs, DType::f32, 1001, {}).empty(), "all_reduce on a");
      a->barrier();
    }
  });
}

// Large all_gather, in place (in == outs[rank]) and not, through the direct path (peers'
// inputs read with process_vm_readv, when the kernel allows it) and with it disabled.
TEST_P(ByWorldSize, AllGatherLargeDirectAndStagedInPlace) {
  for (const char* cma : {"1", "0"}) {
    run([&](Rank& rk) {
      ::setenv("TIDE_CMA", cma, 1);
      CommOptions o;
      o.timeout = std::chrono::seconds(20);
      o.staging_bytes = 256 << 10;
      auto comm = rk.comm(o);
      const int ws = rk.world_size;
      const size_t count = (1 << 20) / 2 + 3;  // 1 MiB of bf16, odd count
      for (bool in_place : {false, true}) {
        const uint64_t tag = in_place ? 7 : 8;
        std::vector<uint8_t> flat(ws * count * 2, 0xcd);
        std::vector<void*> ptrs;
        for (int r = 0; r < ws; ++r) ptrs.push_back(flat.data() + r * count * 2);
        auto mine = random_elems(DType::bf16, count, data_seed(rk, rk.rank, tag));
        const void* in = mine.data();
        if (in_place) {
          std::memcpy(ptrs[rk.rank], mine.data(), mine.size());
          in = ptrs[rk.rank];
        }
        comm->all_gather(in, ptrs, count, DType::bf16);
        for (int r = 0; r < ws; ++r) {
          auto want = random_elems(DType::bf16, count, data_seed(rk, r, tag));
          TIDE_REQUIRE(std::memcmp(ptrs[r], want.data(), want.size()) == 0, "TIDE_CMA=", cma, " in_place=", in_place,
                       ": wrong data from rank ", r);
        }
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Collectives, ByWorldSize, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

}  // namespace
