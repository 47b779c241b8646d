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

  // Staging offsets of aligned parts: congruent, modulo `align` elements, with the part's
  // first element's place in the flat output space (where the accumulation writes it), so
  // that one head of a few elements aligns the staged sources and the output together.
  TIDE_CHECK(options.align_bytes >= 0 && options.align_bytes % options.staging_elem_size == 0,
             "rs_pipeline: align_bytes ", options.align_bytes, " is not a multiple of the staged element size ",
             options.staging_elem_size);
  const int64_t align = std::max<int64_t>(1, options.align_bytes / options.staging_elem_size);
  TIDE_CHECK(align <= pipe.chunk_elems, "rs_pipeline: a chunk of ", pipe.chunk_elems, " elements is smaller than the ",
             options.align_bytes, "-byte alignment");
  // The first offset >= n congruent with `place` modulo align.
  auto align_up = [&](int64_t n, int64_t place) { return n + ((place - n) % align + align) % align; };
  size_t first = 0;  // the first parameter whose padded shard reaches past `begin`
  for (int64_t begin = 0; begin < total;) {
    RsChunk chunk;
    chunk.id = static_cast<int>(pipe.chunks.size());
    chunk.slot = chunk.id % options.max_inflight;
    chunk.begin = begin;
    // The window: parameters' parts from `begin` on, each at an aligned staging offset,
    // until the staging of one destination is full.
    std::vector<int64_t> offset(layout.params.size(), -1);  // staging offset of each param's part
    int64_t end = begin, used = 0;
    while (first < layout.params.size() && param_base[first] + layout.params[first].padded_shard_numel <= begin) ++first;
    for (size_t i = first; i < layout.params.size() && end < total; ++i) {
      const int64_t from = std::max(end, param_base[i]), to = param_base[i] + layout.params[i].padded_shard_numel;
      if (from >= to) continue;
      const int64_t at = align_up(used, from);
      if (at >= pipe.chunk_elems) break;
      const int64_t take = std::min(to - from, pipe.chunk_elems - at);
      offset[i] = at;
      used = at + take;
      end = from + take;
      if (from + take < to) break;  // the window is full inside this parameter
    }
    chunk.end = end;
    chunk.staged = used;
    for (int dst = 0; dst < layout.world_size; ++dst) {
      for (size_t i = first; i < layout.params.size(); ++i) {
        if (offset[i] < 0) continue;
        const Shard& s = layout.params[i].shards[dst];
        // The window in this shard's coordinates, clipped to its real elements (padding
        // receives nothing).
        const int64_t lo = std::max<int64_t>(chunk.begin - param_base[i], 0);
        const int64_t hi = std::min(chunk.end - param_base[i], s.numel);
        if (lo >= hi) continue;
        chunk.pieces.push_back({static_cast<int>(i), dst, lo, hi, offset[i], slice(s.placement, lo, hi)});
      }
    }
    pipe.chunks.push_back(std::move(chunk));
    begin = end;
  }
  pipe.num_slots = static_cast<int>(std::min<int64_t>(options.max_inflight, pipe.chunks.size()));
  pipe.slot_bytes = pipe.widest_window() * options.staging_elem_size;
  return pipe;
}

}  // namespace tide::plan
