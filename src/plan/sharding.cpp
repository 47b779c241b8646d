// FSDP2's sharding of a parameter group, reproduced rule for rule from torch 2.11's
// FSDPParam._init_sharded_param, _chunk_with_empty and _get_dim_chunked_size
// (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_common.py).
#include <algorithm>
#include <functional>
#include <numeric>
#include <sstream>
#include <string>

#include "tide/error.hpp"
#include "tide/hash.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

int64_t product(std::vector<int64_t>::const_iterator first,
                std::vector<int64_t>::const_iterator last) {
  return std::accumulate(first, last, int64_t{1}, std::multiplies<>());
}

// Rank `rank`'s chunk of torch.chunk(tensor, world_size, dim) padded by _chunk_with_empty.
Shard shard_of(const ParamLayout& p, int rank) {
  const int64_t dim = p.shard_dim;
  const int64_t size = p.shape[dim];
  const int64_t outer = product(p.shape.begin(), p.shape.begin() + dim);
  const int64_t inner = product(p.shape.begin() + dim + 1, p.shape.end());
  Shard s;
  s.begin = std::min(rank * p.chunk, size);
  int64_t rows = std::min(size - s.begin, p.chunk);
  // _get_dim_chunked_size: a chunk without elements reports 0 along dim, even when torch.chunk
  // gave it rows (e.g. shape (5, 0)).
  if (rows * outer * inner == 0) rows = 0;
  s.sharded_size = p.shape;
  s.sharded_size[dim] = rows;
  s.padded_sharded_size = p.shape;  // chunks[0].size(): "0th always padded"
  s.padded_sharded_size[dim] = p.chunk;
  s.numel = outer * rows * inner;
  s.padded_numel = p.padded_shard_numel;
  // all_gather_output is rank-major; for Shard(0) rank r's padded shard starts at
  // r * padded numel, which is row r * chunk. For Shard(d > 0) foreach_all_gather_copy_out
  // chunk-cats the rank blocks along dim, so each of the `outer` rows of the shard is a run.
  s.placement = {s.begin * inner, rows * inner, outer, size * inner};
  return s;
}

}  // namespace

GroupLayout plan_group(const std::vector<Param>& params, int world_size) {
  TIDE_CHECK(world_size >= 1, "plan_group: world size must be >= 1, got ", world_size);
  GroupLayout layout;
  layout.world_size = world_size;
  layout.params.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& param = params[i];
    const auto ndim = static_cast<int64_t>(param.shape.size());
    const std::string where =
        detail::concat("plan_group: parameter ", i, " of shape ", shape_str(param.shape),
                       " (world size ", world_size, ")");
    TIDE_CHECK(ndim >= 1, where, ": a 0-dim parameter cannot be sharded (FSDP2 requires dim >= 1)");
    for (int64_t s : param.shape) TIDE_CHECK(s >= 0, where, ": negative size ", s);
    TIDE_CHECK(param.elem_size >= 1, where, ": element size must be >= 1 byte, got ",
               param.elem_size);
    // FSDP2 normalizes a negative Shard(dim) from shard_placement_fn by adding ndim.
    const int64_t dim = param.shard_dim < 0 ? param.shard_dim + ndim : param.shard_dim;
    TIDE_CHECK(dim >= 0 && dim < ndim, where, ": Shard(", param.shard_dim,
               ") is out of range for a ", ndim, "-dim tensor");
    const int64_t size = param.shape[dim];
    TIDE_CHECK(dim == 0 || size % world_size == 0, where, ": FSDP2 does not support uneven ",
               "sharding on dim ", dim, " (size ", size, " is not divisible by world size ",
               world_size, ")");

    ParamLayout p;
    p.shape = param.shape;
    p.elem_size = param.elem_size;
    p.shard_dim = dim;
    p.numel = product(p.shape.begin(), p.shape.end());
    p.chunk = (size + world_size - 1) / world_size;  // torch.chunk's split size
    const int64_t other_dims = product(p.shape.begin(), p.shape.begin() + dim) *
                               product(p.shape.begin() + dim + 1, p.shape.end());
    p.padded_shard_numel = other_dims * p.chunk;
    // init_all_gather_outputs: torch.empty(numel * world_size) per all-gather input.
    p.storage_numel = p.padded_shard_numel * world_size;
    p.shards.reserve(world_size);
    for (int r = 0; r < world_size; ++r) p.shards.push_back(shard_of(p, r));
    layout.params.push_back(std::move(p));
  }
  return layout;
}

uint64_t layout_hash(const GroupLayout& layout) {
  uint64_t h = fnv(kFnvBasis, static_cast<uint64_t>(layout.world_size));
  for (const ParamLayout& p : layout.params) {
    h = fnv(h, p.shape.size());
    for (int64_t d : p.shape) h = fnv(h, static_cast<uint64_t>(d));
    h = fnv(h, static_cast<uint64_t>(p.elem_size));
    h = fnv(h, static_cast<uint64_t>(p.shard_dim));
    h = fnv(h, static_cast<uint64_t>(p.padded_shard_numel));
    h = fnv(h, static_cast<uint64_t>(p.storage_numel));
  }
  return h;
}

}  // namespace tide::plan
