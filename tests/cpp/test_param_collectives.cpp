// param_all_gather / param_reduce_scatter on 1..4 ranks with random FSDP2 parameter groups
// (odd sizes, 1-D, fewer rows than ranks, Shard(1), 3-D), checked against an independent
// reference of FSDP2's sharding; the reduce-scatter also bitwise against Comm::reduce_scatter
// on FSDP2's flat chunk_cat layout (stock FSDP2 over the same backend), with and without
// Slot-Reuse, with staging small enough that the pipeline wraps many times.
#include <gtest/gtest.h>

#include "test_param_common.hpp"

using namespace tide;
using namespace tide::test;

namespace {

CommOptions opts(size_t staging = 16 << 10) {
  CommOptions o;
  o.timeout = std::chrono::seconds(20);
  o.staging_bytes = staging;
  o.num_threads = 2;
  return o;
}

class ParamCollectives : public ::testing::TestWithParam<int> {
 protected:
  void run(const std::function<void(Rank&)>& fn) {
    auto out = run_ranks(GetParam(), fn, std::chrono::seconds(60));
    EXPECT_TRUE(all_ok(out)) << describe(out);
  }
};

// Three rounds of random groups into f32 / bf16 / f16 storages, every element checked
// against the reference sharding, padding bytes untouched.
// plan_elem: the element size the planner is told (0: the storage's); smaller than the
// storage's, the doubling rounds must hold fewer elements than the pace suggests.
void all_gather_cases(Rank& rk, Comm& c, int64_t plan_elem = 0) {
  Comm* comm = &c;
  const int ws = rk.world_size, me = rk.rank;
  {
    for (int round = 0; round < 3; ++round)
      for (DType st : {DType::f32, DType::bf16, DType::f16}) {
        const uint64_t tag = mix(rk.seed, round * 16 + static_cast<int>(st));
        auto params = random_params(tag, ws, plan_elem ? plan_elem : dtype_size(st), round == 0);
        auto layout = plan::plan_group(params, ws);
        const size_t np = params.size();
        // Full tensors (f32), my shards (FSDP2's chunking) in symmetric memory.
        std::vector<std::vector<float>> full(np);
        std::vector<size_t> offs(np);
        size_t bytes = 0;
        for (size_t p = 0; p < np; ++p) {
          full[p] = random_floats(numel_of(params[p].shape), mix(tag, p));
          offs[p] = bytes;
          bytes += (layout.params[p].padded_shard_numel * 4 + 63) / 64 * 64;
        }
        auto shards = comm->allocate_symmetric(bytes + 64 * me);  // sizes differ per rank
        for (size_t p = 0; p < np; ++p) {
          auto idx = shard_indices(params[p], ws, me);
          TIDE_REQUIRE(static_cast<int64_t>(idx.size()) == layout.params[p].shards[me].numel, "shard numel");
          float* s = reinterpret_cast<float*>(shards->local() + offs[p]);
          for (size_t i = 0; i < idx.size(); ++i) s[i] = full[p][idx[i]];
          for (int64_t i = idx.size(); i < layout.params[p].padded_shard_numel; ++i) s[i] = 1e30f;  // padding
        }
        const size_t es = dtype_size(st);
        std::vector<std::vector<uint8_t>> storage(np);
        std::vector<void*> ptrs;
        for (size_t p = 0; p < np; ++p) {
          storage[p].assign(layout.params[p].storage_numel * es, 0xab);  // sentinel
          ptrs.push_back(storage[p].data());
        }
        ParamAllGather a;
        a.layout = &layout;
        a.shards = shards.get();
        a.shard_offsets = offs;
        a.shard_dtype = DType::f32;
        a.storages = ptrs;
        a.storage_dtype = st;
        comm->param_all_gather(a);
        for (size_t p = 0; p < np; ++p) {
          const size_t n = full[p].size();
          for (size_t i = 0; i < n; ++i) {
            uint32_t want = 0, got = 0;
            if (st == DType::f32) want = std::bit_cast<uint32_t>(full[p][i]);
            else want = st == DType::bf16 ? ref_bf16(full[p][i]) : ref_f16(full[p][i]);
            std::memcpy(&got, storage[p].data() + i * es, es);
            TIDE_REQUIRE(got == want, "param ", p, " (", params[p].shape.size(), "-D, Shard(", params[p].shard_dim,
                         ")) element ", i, " of ", n, " to ", dtype_name(st), ": got ", got, " want ", want);
          }
          for (size_t i = n * es; i < storage[p].size(); ++i)
            TIDE_REQUIRE(storage[p][i] == 0xab, "param ", p, ": storage padding byte ", i, " was written");
        }
      }
  }
}

TEST_P(ParamCollectives, AllGather) {
  run([](Rank& rk) { all_gather_cases(rk, *rk.comm(opts())); });
}

// The inter-node algorithm on the host: a 96-byte pace makes many rounds per step, and 16 KiB
// of staging (two 8 KiB slots) makes the slots wrap many times.
CommOptions doubling(size_t pace = 96) {
  CommOptions o = opts();
  o.allgather_algorithm = "doubling";
  o.allgather_pace_bytes = pace;
  return o;
}

TEST_P(ParamCollectives, AllGatherByRecursiveDoubling) {
  run([](Rank& rk) {
    auto comm = rk.comm(doubling());
    all_gather_cases(rk, *comm);
    // Storages wider than planned, with a pace of a whole slot: only rounds cut by the
    // storage's element size fit the slot.
    all_gather_cases(rk, *rk.comm(doubling(8 << 10), "-wide"), /*plan_elem=*/1);
  });
}

TEST(ParamDoubling, NonPowerOfTwoWorldSizesAndRanksDisagreeing) {
  for (int ws : {5, 7}) {
    auto out = run_ranks(ws, [](Rank& rk) { all_gather_cases(rk, *rk.comm(doubling(4096))); },
                         std::chrono::seconds(90));
    EXPECT_TRUE(all_ok(out)) << "ws=" << ws << "\n" << describe(out);
  }
  // One rank direct, the others doubling: every rank must refuse, not deadlock.
  auto out = run_ranks(2, [](Rank& rk) {
    auto comm = rk.comm(rk.rank == 0 ? opts() : doubling());
    try {
      all_gather_cases(rk, *comm);
    } catch (const Error& e) {
      const std::string what = e.what();
      TIDE_REQUIRE(what.find("param_all_gather") != std::string::npos && !dynamic_cast<const TimeoutError*>(&e),
                   "not the mismatch error: ", what);
      return;
    }
    TIDE_REQUIRE(false, "no error");
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

// One reduce-scatter case: param path vs (a) float64 reference, (b) Comm::reduce_scatter on
// FSDP2's flat layout, bitwise.
void rs_case(Rank& rk, Comm& comm, DType gd, ReduceArgs op, uint64_t tag, int reuse_mode) {
  const int ws = rk.world_size, me = rk.rank;
  const RsCase rc(tag, ws, me, gd);
  const auto& [params, layout, grads, out_offs, total] = std::tie(rc.params, rc.layout, rc.grads, rc.out_offs, rc.total);
  const size_t np = params.size();
  std::vector<float> out(total + 1, 12345.0f);  // sentinel
  ParamReduceScatter a = rc.args(out.data(), DType::f32, op);
  std::shared_ptr<SymmetricBuffer> reuse;
  std::vector<plan::Region> regions;
  if (reuse_mode) {
    reuse = comm.allocate_symmetric(64 << 10);
    if (reuse_mode == 1) regions = {{0, 100, 5000}, {1, 20000, 40000}};  // room for the slots
    else regions = {{0, 0, 3000}};                                        // too small: fallback
    a.reuse = reuse.get();
    a.reuse_regions = regions;
  }
  StagingReport rep = comm.param_reduce_scatter(a);
  TIDE_REQUIRE(out[total] == 12345.0f, "wrote past the output");
  if (total > 0) {
    TIDE_REQUIRE(rep.num_slots >= 1 && rep.slot_bytes > 0, "report: ", rep.num_slots, " slots of ", rep.slot_bytes);
    if (reuse_mode == 1) TIDE_REQUIRE(rep.reused_slots == rep.num_slots && rep.fallback_bytes == 0, "reuse: ",
                                      rep.reused_slots, " of ", rep.num_slots, " reused, fallback ", rep.fallback_bytes);
    else TIDE_REQUIRE(rep.reused_slots == 0 && rep.fallback_bytes == rep.num_slots * rep.slot_bytes, "no reuse: ",
                      rep.reused_slots, " reused, fallback ", rep.fallback_bytes);
  }

  // (a) float64 reference, FSDP2's slicing.
  std::vector<std::vector<std::vector<uint8_t>>> all(ws);
  for (int r = 0; r < ws; ++r)
    for (size_t p = 0; p < np; ++p) all[r].push_back(r == me ? grads[p] : rc.grad_of(r, p));
  const double f = op.op == ReduceOp::premul_sum ? op.premul_factor : 1.0;
  for (size_t p = 0; p < np; ++p) {
    auto idx = shard_indices(params[p], ws, me);
    for (size_t i = 0; i < idx.size(); ++i) {
      double acc = 0, mag = 0;
      for (int r = 0; r < ws; ++r) {
        double v = value_at(gd, all[r][p].data(), idx[i]) * f;
        acc += v;
        mag += std::fabs(v);
      }
      if (op.op == ReduceOp::avg) acc /= ws;
      const double got = out[out_offs[p] + i];
      TIDE_REQUIRE(std::fabs(got - acc) <= 0x1p-21 * mag, dtype_name(gd), " ", reduce_op_name(op.op), " param ", p,
                   " element ", i, ": got ", got, " want ", acc);
    }
    for (int64_t i = idx.size(); i < layout.params[p].padded_shard_numel; ++i)
      TIDE_REQUIRE(out[out_offs[p] + i] == 0.0f, "param ", p, " padding element ", i, " is ", out[out_offs[p] + i]);
  }

  // (b) stock FSDP2 over the same backend: chunk_cat (bf16 widened to f32, zero padded),
  // then reduce_scatter f32 -> f32.
  std::vector<std::vector<float>> flat(ws, std::vector<float>(total, 0.0f));
  for (int d = 0; d < ws; ++d)
    for (size_t p = 0; p < np; ++p) {
      auto idx = shard_indices(params[p], ws, d);
      for (size_t i = 0; i < idx.size(); ++i)
        flat[d][out_offs[p] + i] = static_cast<float>(value_at(gd, grads[p].data(), idx[i]));
    }
  std::vector<const void*> ins;
  for (auto& v : flat) ins.push_back(v.data());
  std::vector<float> stock(total);
  comm.reduce_scatter(ins, stock.data(), total, DType::f32, DType::f32, op);
  TIDE_REQUIRE(total == 0 || std::memcmp(stock.data(), out.data(), total * 4) == 0, "param_reduce_scatter ",
               dtype_name(gd), " ", reduce_op_name(op.op), " differs bitwise from reduce_scatter on the flat layout");
}

TEST_P(ParamCollectives, ReduceScatter) {
  run([](Rank& rk) {
    auto comm = rk.comm(opts());
    uint64_t tag = rk.seed;
    for (int reuse_mode : {0, 1, 2})
      for (DType gd : {DType::bf16, DType::f32})
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::premul_sum})
          rs_case(rk, *comm, gd, {op, 0.37}, tag = mix(tag, 7), reuse_mode);
  });
}

TEST_P(ParamCollectives, MismatchedLayoutsFailEverywhere) {
  if (GetParam() == 1) GTEST_SKIP() << "needs two ranks";
  run([](Rank& rk) {
    const int ws = rk.world_size;
    std::vector<plan::Param> params = {{{10, 3}, 4, 0}, {{7}, 4, 0}};
    if (rk.rank == 1) params[1].shape = {8};
    auto layout = plan::plan_group(params, ws);
    for (int which = 0; which < 2; ++which) {
      auto comm = rk.comm(opts(), "-" + std::to_string(which));
      auto shards = comm->allocate_symmetric(1024);
      std::vector<size_t> offs = {0, 512};
      std::vector<std::vector<float>> st = {std::vector<float>(40), std::vector<float>(8)};
      std::vector<void*> sp = {st[0].data(), st[1].data()};
      std::vector<const void*> gp = {st[0].data(), st[1].data()};
      std::vector<int64_t> oo = {0, 16};
      std::vector<float> out(64);
      const char* name = which ? "param_reduce_scatter" : "param_all_gather";
      try {
        if (which == 0) {
          ParamAllGather a{&layout, shards.get(), offs, DType::f32, sp, DType::f32};
          comm->param_all_gather(a);
        } else {
          ParamReduceScatter a;
          a.layout = &layout;
          a.grads = gp;
          a.out = out.data();
          a.out_offsets = oo;
          comm->param_reduce_scatter(a);
        }
        TIDE_REQUIRE(false, name, " with mismatched layouts did not fail");
      } catch (const TimeoutError& e) {
        TIDE_REQUIRE(false, "expected tide::Error, got TimeoutError: ", e.what());
      } catch (const Error& e) {
        std::string m = e.what();
        TIDE_REQUIRE(m.find(name) != std::string::npos && m.find("rank 0") != std::string::npos &&
                         m.find("rank 1") != std::string::npos && m.find("numel=") != std::string::npos,
                     "message: ", m);
      }
      try {
        comm->barrier();
        TIDE_REQUIRE(false, "the communicator still works after the error");
      } catch (const Error&) {
      }
    }
  });
}

// A peer that dies mid-pipeline: the survivors get TimeoutError, and the comm stays broken.
TEST_P(ParamCollectives, DeadPeerTimesOut) {
  if (GetParam() == 1) GTEST_SKIP() << "needs two ranks";
  run([](Rank& rk) {
    const int ws = rk.world_size;
    CommOptions o = opts();
    o.timeout = std::chrono::seconds(3);
    auto comm = rk.comm(o);
    std::vector<plan::Param> params = {{{400, 300}, 2, 0}};
    auto layout = plan::plan_group(params, ws);
    auto grad = random_elems(DType::bf16, 400 * 300, rk.seed);
    std::vector<const void*> gp = {grad.data()};
    std::vector<int64_t> oo = {0};
    std::vector<float> out(layout.params[0].padded_shard_numel);
    ParamReduceScatter a;
    a.layout = &layout;
    a.grads = gp;
    a.grad_dtype = DType::bf16;
    a.out = out.data();
    a.out_offsets = oo;
    comm->param_reduce_scatter(a);  // a full one first
    if (rk.rank == ws - 1) ::_exit(0);  // dies before the second
    try {
      comm->param_reduce_scatter(a);
      TIDE_REQUIRE(false, "no error although rank ", ws - 1, " died");
    } catch (const TimeoutError& e) {
      TIDE_REQUIRE(std::string(e.what()).find("param_reduce_scatter") != std::string::npos, e.what());
    }
    try {
      comm->barrier();
      TIDE_REQUIRE(false, "the communicator still works");
    } catch (const TimeoutError&) {
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Param, ParamCollectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& i) { return "ws" + std::to_string(i.param); });

}  // namespace

// Throwaway timing (run with --gtest_also_run_disabled_tests): 2 ranks, 16 parameters of
// 1024 x 1024 (64 MiB of unsharded f32 parameters per rank), default staging and threads.
TEST(ParamBench, DISABLED_Bandwidth) {
  auto out = run_ranks(2, [](Rank& rk) {
    CommOptions o;
    o.timeout = std::chrono::seconds(60);
    auto comm = rk.comm(o);
    const int ws = rk.world_size;
    std::vector<plan::Param> params(16, plan::Param{{1024, 1024}, 4, 0});
    auto layout = plan::plan_group(params, ws);
    const size_t np = params.size(), shard = layout.params[0].padded_shard_numel, total = shard * np;
    auto shards = comm->allocate_symmetric(total * 4);
    std::memset(shards->local(), 1, total * 4);
    std::vector<size_t> offs;
    for (size_t p = 0; p < np; ++p) offs.push_back(p * shard * 4);
    auto time = [&](auto&& f) {
      f();
      comm->barrier();
      const int iters = 5;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) f();
      comm->barrier();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    };
    for (DType st : {DType::f32, DType::bf16}) {
      std::vector<std::vector<uint8_t>> storage(np, std::vector<uint8_t>(layout.params[0].storage_numel * dtype_size(st)));
      std::vector<void*> ptrs;
      for (auto& s : storage) ptrs.push_back(s.data());
      ParamAllGather a{&layout, shards.get(), offs, DType::f32, ptrs, st};
      double t = time([&] { comm->param_all_gather(a); });
      double gb = np * storage[0].size() / 1e9;
      rk.report(detail::concat("param_all_gather f32->", dtype_name(st), ": ", t * 1e3, " ms, ", gb / t,
                               " GB/s of storage written per rank"));
    }
    {  // stock: flat all_gather f32 (no copy-in/out counted)
      std::vector<float> flat_out(total * ws);
      std::vector<void*> outs = {flat_out.data(), flat_out.data() + total};
      double t = time([&] { comm->all_gather(shards->local(), outs, total, DType::f32); });
      rk.report(detail::concat("all_gather f32 flat (reference): ", t * 1e3, " ms, ", total * ws * 4 / 1e9 / t, " GB/s"));
    }
    for (DType gd : {DType::bf16, DType::f32}) {
      std::vector<std::vector<uint8_t>> grads(np, random_elems(gd, 1024 * 1024, rk.seed + rk.rank));
      std::vector<const void*> gp;
      for (auto& g : grads) gp.push_back(g.data());
      std::vector<int64_t> oo;
      for (size_t p = 0; p < np; ++p) oo.push_back(p * shard);
      std::vector<float> outv(total);
      ParamReduceScatter a;
      a.layout = &layout;
      a.grads = gp;
      a.grad_dtype = gd;
      a.out = outv.data();
      a.out_offsets = oo;
      a.op = {ReduceOp::avg, 1.0};
      double t = time([&] { comm->param_reduce_scatter(a); });
      double gb = np * grads[0].size() / 1e9;
      rk.report(detail::concat("param_reduce_scatter ", dtype_name(gd), "->f32: ", t * 1e3, " ms, ", gb / t,
                               " GB/s of gradients consumed per rank"));
    }
    {
      std::vector<float> flat(total * ws, 1.0f), o2(total);
      std::vector<const void*> ins = {flat.data(), flat.data() + total};
      double t = time([&] { comm->reduce_scatter(ins, o2.data(), total, DType::f32, DType::f32, {ReduceOp::avg, 1.0}); });
      rk.report(detail::concat("reduce_scatter f32 flat (reference, no chunk_cat): ", t * 1e3, " ms, ",
                               total * ws * 4 / 1e9 / t, " GB/s"));
    }
  }, std::chrono::seconds(120));
  EXPECT_TRUE(all_ok(out)) << describe(out);
  std::printf("%s", describe(out).c_str());
}
