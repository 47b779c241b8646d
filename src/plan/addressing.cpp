// Where each shard lands (all-gather) and which gradient slice each shard reduces
// (reduce-scatter): the shard placements of sharding.cpp, listed per (parameter, rank).
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {

std::vector<Strided> slice(const Strided& p, int64_t begin, int64_t end) {
  TIDE_CHECK(0 <= begin && begin <= end && end <= p.numel(), "slice: range [", begin, ", ", end,
             ") is outside a pattern of ", p.numel(), " elements");
  std::vector<Strided> out;
  if (begin == end) return out;
  const int64_t first_run = begin / p.run, head = begin % p.run;
  const int64_t last_run = end / p.run, tail = end % p.run;
  const auto run_start = [&](int64_t q) { return p.offset + q * p.stride; };
  if (first_run == last_run) {  // inside one run
    out.push_back({run_start(first_run) + head, end - begin, 1, p.stride});
    return out;
  }
  int64_t full_from = first_run;
  if (head != 0) {
    out.push_back({run_start(first_run) + head, p.run - head, 1, p.stride});
    ++full_from;
  }
  if (last_run > full_from)
    out.push_back({run_start(full_from), p.run, last_run - full_from, p.stride});
  if (tail != 0) out.push_back({run_start(last_run), tail, 1, p.stride});
  return out;
}

std::vector<AllGatherCopy> allgather_copies(const GroupLayout& layout) {
  std::vector<AllGatherCopy> out;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamLayout& p = layout.params[i];
    for (int r = 0; r < layout.world_size; ++r) {
      const Shard& s = p.shards[r];
      // Only real elements move; the padding tail of the storage is never read as the param.
      if (s.numel > 0) out.push_back({r, static_cast<int>(i), s.numel, s.placement});
    }
  }
  return out;
}

std::vector<ReduceScatterSlice> reduce_scatter_slices(const GroupLayout& layout) {
  // foreach_reduce: chunk_cat of the (dim-0 padded) gradient puts rank r's slice at row block
  // r; for Shard(d > 0) the gradient is first chunked along d and concatenated along 0, so
  // rank r's slice is again its shard placement.
  std::vector<ReduceScatterSlice> out;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamLayout& p = layout.params[i];
    for (int r = 0; r < layout.world_size; ++r) {
      const Shard& s = p.shards[r];
      if (s.numel > 0) out.push_back({static_cast<int>(i), r, s.numel, s.placement});
    }
  }
  return out;
}

bool contiguous(const std::vector<Strided>& patterns) {
  int64_t next = -1;
  for (const Strided& s : patterns) {
    if (s.count > 1 && s.run != s.stride) return false;
    if (next >= 0 && s.offset != next) return false;
    next = s.offset + s.numel();
  }
  return true;
}

}  // namespace tide::plan
