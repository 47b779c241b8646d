// Bytes one rank allocates for a group's collectives: stock FSDP2 (foreach_all_gather,
// foreach_reduce in _fsdp_collectives.py) versus TIDE, which keeps only the per-parameter
// storages FSDP2 already has plus the reduce-scatter staging.
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {

struct Sums {
  int64_t padded_shard_numel = 0;  // one rank's all-gather input / reduce output, elements
  int64_t padded_shard_bytes = 0;  // the same in each parameter's unsharded dtype
  int64_t storage_bytes = 0;       // all per-parameter unsharded storages
  bool casts_for_all_gather = false;
};

Sums sums(const GroupLayout& layout, const DtypeSizes& dtypes) {
  Sums s;
  for (const ParamLayout& p : layout.params) {
    s.padded_shard_numel += p.padded_shard_numel;
    s.padded_shard_bytes += p.padded_shard_numel * p.elem_size;
    s.storage_bytes += p.storage_bytes();
    if (dtypes.orig_elem_size != 0 && dtypes.orig_elem_size != p.elem_size)
      s.casts_for_all_gather = true;
  }
  return s;
}

}  // namespace

BufferBytes stock_fsdp2_bytes(const GroupLayout& layout, const DtypeSizes& dtypes) {
  const Sums s = sums(layout, dtypes);
  const int64_t ws = layout.world_size;
  BufferBytes b;
  b.param_storage = s.storage_bytes;
  // _get_param_all_gather_inputs: with a param_dtype the shards are cast into one flat
  // buffer; without one, all_gather_copy_in copies them into the output's own rank slice.
  b.ag_input = s.casts_for_all_gather ? s.padded_shard_bytes : 0;
  b.ag_output = ws * s.padded_shard_bytes;  // all_gather_input_numel * world_size
  // foreach_reduce: reduce_scatter_input holds every rank's padded slice in reduce dtype,
  // reduce_output one rank's.
  b.rs_input = ws * s.padded_shard_numel * dtypes.reduce_elem_size;
  b.rs_output = s.padded_shard_numel * dtypes.reduce_elem_size;
  return b;
}

BufferBytes tide_bytes(const GroupLayout& layout, const DtypeSizes& dtypes, int rank,
                       int64_t staging_bytes) {
  TIDE_CHECK(rank >= 0 && rank < layout.world_size, "tide_bytes: rank ", rank,
             " is outside world size ", layout.world_size);
  const Sums s = sums(layout, dtypes);
  BufferBytes b;
  b.param_storage = s.storage_bytes;
  // Shards are cast straight into their own placement in the storage and sent from there;
  // gradients are reduced from their own storage straight into the sharded gradients.
  for (const ParamLayout& p : layout.params)
    b.rs_output += p.shards.at(rank).numel * dtypes.reduce_elem_size;
  b.staging = staging_bytes;
  return b;
}

}  // namespace tide::plan
