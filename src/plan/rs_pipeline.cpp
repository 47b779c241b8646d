// TIDE-RS's two-phase pipeline. The output space of one rank is the parameters' padded
// shards back to back, as in FSDP2's foreach_reduce (flat_grad_offset into reduce_output);
// every rank cuts it into the same chunk windows, so ranks step through chunks together.
// At most max_inflight chunks hold a staging slot at once, so staging is
// max_inflight * chunk bytes per rank however many ranks contribute.
#include <algorithm>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {

RsPipeline rs_pipeline(const GroupLayout& layout, const RsPipelineOptions& options) {
  TIDE_CHECK(options.max_inflight >= 1, "rs_pipeline: max_inflight must be >= 1, got ",
             options.max_inflight);
  TIDE_CHECK(options.staging_elem_size >= 1 && options.chunk_bytes >= options.staging_elem_size,
             "rs_pipeline: a chunk of ", options.chunk_bytes, " bytes holds no element of ",
             options.staging_elem_size, " bytes (world size ", layout.world_size, ")");
  RsPipeline pipe;
  pipe.chunk_elems = options.chunk_bytes / options.staging_elem_size;

  std::vector<int64_t> param_base;  // start of each padded shard in the flat output space
  int64_t total = 0;
  for (const ParamLayout& p : layout.params) {
    param_base.push_back(total);
    total += p.padded_shard_numel;
  }

  for (int64_t begin = 0; begin < total; begin += pipe.chunk_elems) {
    RsChunk chunk;
    chunk.id = static_cast<int>(pipe.chunks.size());
    chunk.slot = chunk.id % options.max_inflight;
    chunk.begin = begin;
    chunk.end = std::min(total, begin + pipe.chunk_elems);
    for (int dst = 0; dst < layout.world_size; ++dst) {
      for (size_t i = 0; i < layout.params.size(); ++i) {
        const Shard& s = layout.params[i].shards[dst];
        // The window in this shard's coordinates, clipped to its real elements (padding
        // receives nothing).
        const int64_t lo = std::max<int64_t>(chunk.begin - param_base[i], 0);
        const int64_t hi = std::min(chunk.end - param_base[i], s.numel);
        if (lo >= hi) continue;
        chunk.pieces.push_back({static_cast<int>(i), dst, lo, hi, param_base[i] + lo - chunk.begin,
                                slice(s.placement, lo, hi)});
      }
    }
    pipe.chunks.push_back(std::move(chunk));
  }
  pipe.num_slots = static_cast<int>(std::min<int64_t>(options.max_inflight, pipe.chunks.size()));
  pipe.slot_bytes = std::min(pipe.chunk_elems, total) * options.staging_elem_size;
  return pipe;
}

}  // namespace tide::plan
