// TIDE-AG on CUDA: copy engines move every rank's shard, once, from its owner's symmetric
// memory to the planner's placement in this rank's per-parameter storage.
//
//   [cast, only when shard dtype != storage dtype: one kernel per parameter converts this
//    rank's own shard into symmetric scratch; copy engines cannot convert]
//   post ag_ready; wait every peer's ag_ready      (every shard is final)
//   copies: peers rank+1, rank+2, ... (then self), each param's placement: one contiguous
//           copy (Shard(0)) or one 2D copy (Shard(d > 0)); batched with cudaMemcpyBatchAsync
//   post ag_done; wait every peer's ag_done        (nobody changes a shard a peer still reads)
// All on the group's copy stream; no kernel on the equal-dtype path.
#include <algorithm>

#include "../../core/env.hpp"
#include "../../transport/cuda/copies.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"
#include "tide/cuda/kernels.hpp"

namespace tide::cuda {
namespace {

bool castable(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }
size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

void param_all_gather(CudaGroup& g, const ParamAllGather& a, cudaStream_t stream) {
  const int me = g.rank(), ws = g.world_size();
  const plan::GroupLayout& layout = g.checked_layout(a.layout, "param_all_gather");
  const size_t np = layout.params.size();
  TIDE_CHECK(a.storages.size() == np && a.shard_offsets.size() == np, "tide: cuda: param_all_gather on rank ", me,
             ": ", np, " params but ", a.storages.size(), " storages and ", a.shard_offsets.size(), " shard offsets");
  auto* shards = dynamic_cast<CudaSymmetricBuffer*>(a.shards);
  TIDE_CHECK(shards, "tide: cuda: param_all_gather on rank ", me,
             ": shards must be CUDA symmetric memory (CudaGroup::allocate_symmetric)");
  const bool cast = a.shard_dtype != a.storage_dtype;
  TIDE_CHECK(!cast || (castable(a.shard_dtype) && castable(a.storage_dtype)), "tide: cuda: param_all_gather on rank ",
             me, ": no conversion from ", dtype_name(a.shard_dtype), " to ", dtype_name(a.storage_dtype),
             " (f32/bf16/f16 only)");
  const size_t ses = dtype_size(a.shard_dtype), des = dtype_size(a.storage_dtype);
  for (size_t p = 0; p < np; ++p) {
    const size_t need = a.shard_offsets[p] + static_cast<size_t>(layout.params[p].padded_shard_numel) * ses;
    for (int r = 0; r < ws; ++r)
      TIDE_CHECK(need <= shards->bytes(r), "tide: cuda: param_all_gather on rank ", me, ": param ", p,
                 "'s shard ends at byte ", need, " but rank ", r, "'s shard memory has ", shards->bytes(r));
    TIDE_CHECK(a.storages[p] || layout.params[p].storage_numel == 0, "tide: cuda: param_all_gather on rank ", me,
               ": param ", p, " has no storage");
  }

  cudaStream_t s = g.copy_stream();
  g.begin("param_all_gather", stream, {s});

  // Where each rank's shard is read from, in storage dtype.
  SymmetricBuffer* src = shards;
  std::vector<size_t> src_off(a.shard_offsets.begin(), a.shard_offsets.end());
  if (cast) {
    size_t total = 0;
    for (size_t p = 0; p < np; ++p) {
      src_off[p] = total;
      total += align256(static_cast<size_t>(layout.params[p].padded_shard_numel) * des);
    }
    CudaSymmetricBuffer& scratch = g.scratch(total);
    src = &scratch;
    for (size_t p = 0; p < np; ++p) {
      const size_t n = static_cast<size_t>(layout.params[p].shards[me].numel);
      TIDE_CUDA_CHECK(launch_cast(scratch.local() + src_off[p], a.storage_dtype, shards->local() + a.shard_offsets[p],
                                  a.shard_dtype, n, s));
    }
  }

  const uint64_t ready = g.next(CudaGroup::kAgReady);
  g.post(s, CudaGroup::kAgReady, ready);
  for (int r = 0; r < ws; ++r)
    if (r != me) g.wait(s, r, CudaGroup::kAgReady, ready);

  detail::CopyBatch batch(s, g.device());
  for (int i = 1; i <= ws; ++i) {
    const int r = (me + i) % ws;
    const std::byte* base = src->peer(r);
    for (size_t p = 0; p < np; ++p) {
      const plan::Shard& sh = layout.params[p].shards[r];
      if (sh.numel == 0) continue;
      const plan::Strided& pl = sh.placement;
      std::byte* dst = static_cast<std::byte*>(a.storages[p]) + static_cast<size_t>(pl.offset) * des;
      const size_t run = static_cast<size_t>(pl.run) * des;
      if (pl.count == 1 || pl.run == pl.stride)
        batch.add(dst, base + src_off[p], run * static_cast<size_t>(pl.count));
      else
        batch.add(dst, static_cast<size_t>(pl.stride) * des, base + src_off[p], run, run, static_cast<size_t>(pl.count));
    }
  }
  batch.flush();

  const uint64_t done = g.next(CudaGroup::kAgDone);
  g.post(s, CudaGroup::kAgDone, done);
  for (int r = 0; r < ws; ++r)
    if (r != me) g.wait(s, r, CudaGroup::kAgDone, done);
  g.end(stream, {s});
}

}  // namespace tide::cuda
