// Shared by the test_plan_*.cpp suites: random FSDP2 parameter groups and pattern expansion.
#pragma once
#include <random>
#include <vector>

#include "tide/plan.hpp"

namespace tide::plan::testing {

// Every element index a pattern covers, in pattern order.
inline std::vector<int64_t> expand(const Strided& p) {
  std::vector<int64_t> out;
  for (int64_t c = 0; c < p.count; ++c)
    for (int64_t i = 0; i < p.run; ++i) out.push_back(p.offset + c * p.stride + i);
  return out;
}

inline std::vector<int64_t> expand(const std::vector<Strided>& ps) {
  std::vector<int64_t> out;
  for (const Strided& p : ps)
    for (int64_t e : expand(p)) out.push_back(e);
  return out;
}

// 1..5 parameters of 1..3 dims with small odd sizes (zeros included, fewer rows than ranks
// common); about one in four is Shard(d > 0) with a size FSDP2 accepts.
inline std::vector<Param> random_params(std::mt19937& rng, int world_size) {
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<Param> params(uniform(1, 5));
  for (Param& p : params) {
    p.shape.resize(uniform(1, 3));
    for (int64_t& s : p.shape) s = uniform(0, 12) == 0 ? 0 : uniform(1, 11);
    p.elem_size = std::vector<int64_t>{1, 2, 4, 8}[uniform(0, 3)];
    if (p.shape.size() > 1 && uniform(0, 3) == 0) {
      p.shard_dim = uniform(1, static_cast<int>(p.shape.size()) - 1);
      p.shape[p.shard_dim] = world_size * uniform(0, 3);
    }
  }
  return params;
}

}  // namespace tide::plan::testing
