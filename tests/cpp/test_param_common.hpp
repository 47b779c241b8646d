// Shared pieces of the param_* tests: random FSDP2 parameter groups and an independent
// reference of FSDP2's sharding (torch.chunk along the shard dim), not the planner's.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "test_collectives_ref.hpp"
#include "test_host_harness.hpp"
#include "tide/plan.hpp"

namespace tide::test {

// Odd sizes, 1-D, fewer rows than ranks, Shard(1) (even, as FSDP2 requires), 3-D.
inline std::vector<plan::Param> random_params(uint64_t seed, int ws, int64_t elem_size, bool big = false) {
  std::mt19937_64 g(seed);
  auto u = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  std::vector<plan::Param> ps;
  const int n = static_cast<int>(u(3, 7));
  for (int i = 0; i < n; ++i) {
    plan::Param p;
    p.elem_size = elem_size;
    switch (u(0, 4)) {
      case 0: p.shape = {u(1, 3000)}; break;                         // 1-D, odd
      case 1: p.shape = {u(1, std::max(1, ws - 1)), u(1, 40)}; break;  // fewer rows than ranks
      case 2: p.shape = {ws * u(1, 9), u(1, 33)}; p.shard_dim = 1; p.shape[1] = ws * u(1, 20); break;  // Shard(1)
      case 3: p.shape = {u(1, 50), u(1, 30), u(1, 5)}; break;
      default: p.shape = {u(1, 200), u(1, 70)}; break;
    }
    ps.push_back(p);
  }
  if (big) ps.push_back({{301, 1000}, elem_size, 0});  // big enough to split over the pool
  return ps;
}

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// FSDP2's shard of rank r (torch.chunk(ceil(size / ws)) along dim d, made contiguous):
// the flat indices into the full tensor, in shard order.
inline std::vector<int64_t> shard_indices(const plan::Param& p, int ws, int r) {
  const int64_t d = p.shard_dim;
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < d; ++i) outer *= p.shape[i];
  for (size_t i = d + 1; i < p.shape.size(); ++i) inner *= p.shape[i];
  const int64_t size = p.shape[d], chunk = (size + ws - 1) / ws;
  const int64_t begin = std::min(size, r * chunk), end = std::min(size, begin + chunk);
  std::vector<int64_t> idx;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = begin; j < end; ++j)
      for (int64_t k = 0; k < inner; ++k) idx.push_back((o * size + j) * inner + k);
  return idx;
}

// Random f32 with full mantissas (so bf16 rounding matters), never zero.
inline std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> v(0.01f, 3.0f);
  std::vector<float> out(n);
  for (auto& x : out) x = (g() & 1 ? -1.0f : 1.0f) * v(g);
  return out;
}

// Independent round-to-nearest-even f32 -> bf16 / f16 (finite inputs).
inline uint16_t ref_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint32_t lsb = (u >> 16) & 1;
  return static_cast<uint16_t>((u + 0x7fff + lsb) >> 16);
}
inline uint16_t ref_f16(float f) { return std::bit_cast<uint16_t>(static_cast<_Float16>(f)); }

// A random reduce-scatter case: a group's parameters, this rank's gradients, the packed
// output offsets, and the arguments over them. Every rank can regenerate every rank's
// gradients (grad_of) for a reference. Not movable once args() has been taken.
struct RsCase {
  uint64_t tag;
  DType gd;
  std::vector<plan::Param> params;
  plan::GroupLayout layout;
  std::vector<std::vector<uint8_t>> grads;  // this rank's, one per parameter
  std::vector<const void*> gptr;
  std::vector<int64_t> out_offs;
  int64_t total = 0;  // output elements

  RsCase(uint64_t tag_, int ws, int me, DType grad_dtype)
      : tag(tag_), gd(grad_dtype), params(random_params(tag_, ws, dtype_size(grad_dtype), (tag_ & 3) == 0)),
        layout(plan::plan_group(params, ws)) {
    for (size_t p = 0; p < params.size(); ++p) {
      grads.push_back(grad_of(me, p));
      gptr.push_back(grads.back().data());
      out_offs.push_back(total);
      total += layout.params[p].padded_shard_numel;
    }
  }
  std::vector<uint8_t> grad_of(int r, size_t p) const {
    return random_elems(gd, static_cast<size_t>(numel_of(params[p].shape)), mix(mix(tag, r), p + 1000));
  }
  ParamReduceScatter args(void* out, DType out_dtype, ReduceArgs op) const {
    ParamReduceScatter a;
    a.layout = &layout;
    a.grads = gptr;
    a.grad_dtype = gd;
    a.out = out;
    a.out_offsets = out_offs;
    a.out_dtype = out_dtype;
    a.op = op;
    return a;
  }
};

// TIDE-RS's documented order, computed here: fp32 node partials over local ranks (exact in
// the gradient dtype at one rank per node, where TIDE-RS sends them so), then nodes
// (rank order on one node), premul_sum per element, avg once at the end.
inline float documented_sum(const std::vector<std::vector<uint8_t>>& grads_of_rank, DType gd, size_t i,
                            const plan::Topology& topo, ReduceArgs op) {
  const float f = op.op == ReduceOp::premul_sum ? static_cast<float>(op.premul_factor) : 1.0f;
  float total = 0;
  for (int j = 0; j < topo.num_nodes; ++j) {
    float partial = 0;
    for (int l = 0; l < topo.local_size; ++l) {
      float v = static_cast<float>(value_at(gd, grads_of_rank[static_cast<size_t>(topo.rank_of(j, l))].data(), i));
      if (op.op == ReduceOp::premul_sum) v = v * f;
      partial = l == 0 ? v : partial + v;
    }
    total = j == 0 ? partial : total + partial;
  }
  if (op.op == ReduceOp::avg) total = total / static_cast<float>(topo.world_size);
  return total;
}

// Rank me's output of TIDE-RS over rc (`out`, elements of od): bitwise the documented order
// rounded once to od, within a float64 bound of the exact sum, and zero padding.
inline void check_documented_order(const RsCase& rc, const uint8_t* out, DType od, ReduceArgs op,
                                   const plan::Topology& topo, int me) {
  const int ws = topo.world_size;
  const size_t np = rc.params.size(), oes = dtype_size(od);
  std::vector<std::vector<std::vector<uint8_t>>> all(np);  // [param][rank]
  for (size_t p = 0; p < np; ++p)
    for (int r = 0; r < ws; ++r) all[p].push_back(r == me ? rc.grads[p] : rc.grad_of(r, p));
  const double f = op.op == ReduceOp::premul_sum ? op.premul_factor : 1.0;
  for (size_t p = 0; p < np; ++p) {
    auto idx = shard_indices(rc.params[p], ws, me);
    for (size_t i = 0; i < idx.size(); ++i) {
      const uint8_t* got = out + static_cast<size_t>(rc.out_offs[p] + static_cast<int64_t>(i)) * oes;
      const float want = documented_sum(all[p], rc.gd, static_cast<size_t>(idx[i]), topo, op);
      uint32_t want_bits = std::bit_cast<uint32_t>(want), got_bits = 0;
      if (od == DType::bf16) want_bits = ref_bf16(want);
      std::memcpy(&got_bits, got, oes);
      TIDE_REQUIRE(got_bits == want_bits, dtype_name(rc.gd), "->", dtype_name(od), " ", reduce_op_name(op.op),
                   " param ", p, " element ", i, ": got ", value_at(od, got, 0), " want ", want, " (",
                   topo.num_nodes, " nodes x ", topo.local_size, ")");
      double acc = 0, mag = 0;
      for (int r = 0; r < ws; ++r) {
        const double v = value_at(rc.gd, all[p][static_cast<size_t>(r)].data(), static_cast<size_t>(idx[i])) * f;
        acc += v;
        mag += std::fabs(v);
      }
      if (op.op == ReduceOp::avg) acc /= ws;
      const double tol = (od == DType::bf16 ? 0x1p-8 * std::fabs(acc) : 0.0) + 0x1p-21 * mag;
      TIDE_REQUIRE(std::fabs(value_at(od, got, 0) - acc) <= tol, "param ", p, " element ", i, ": ",
                   value_at(od, got, 0), " is far from the exact ", acc);
    }
    for (int64_t i = static_cast<int64_t>(idx.size()); i < rc.layout.params[p].padded_shard_numel; ++i)
      TIDE_REQUIRE(value_at(od, out, static_cast<size_t>(rc.out_offs[p] + i)) == 0.0, "param ", p,
                   " padding element ", i, " is not zero");
  }
}

}  // namespace tide::test
