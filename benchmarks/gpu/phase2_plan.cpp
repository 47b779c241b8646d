#include "phase2_plan.hpp"

#include "tide/plan.hpp"

namespace tide::bench {

Phase2Plan qwen2_block_phase2(int64_t align_bytes) {
  Phase2Plan out;
  out.ranks = 6;
  const std::vector<plan::Param> block = {
      {{3584, 3584}, 2, 0},  {{3584}, 2, 0}, {{512, 3584}, 2, 0},   {{512}, 2, 0},
      {{512, 3584}, 2, 0},   {{512}, 2, 0},  {{3584, 3584}, 2, 0},  {{18944, 3584}, 2, 0},
      {{18944, 3584}, 2, 0}, {{3584, 18944}, 2, 0}, {{3584}, 2, 0}, {{3584}, 2, 0}};
  const plan::GroupLayout layout = plan::plan_group(block, out.ranks);
  const int64_t piece = (int64_t{32} << 20) / 2 / out.ranks / 256 * 256;
  const plan::RsPipeline pipe = plan::rs_pipeline(layout, {piece, 2, 2, align_bytes});
  out.piece_elems = piece / 2;
  std::vector<int64_t> out_off;
  for (const plan::ParamLayout& lp : layout.params) {
    out_off.push_back(out.out_numel);
    out.out_numel += lp.padded_shard_numel;
  }
  for (const plan::RsChunk& chunk : pipe.chunks)
    for (const plan::RsPiece& pc : chunk.pieces)
      if (pc.dst_rank == 0)
        out.launches.push_back({pc.staging_offset, out_off[static_cast<size_t>(pc.param)] + pc.shard_begin,
                                pc.shard_end - pc.shard_begin});
  return out;
}

}  // namespace tide::bench
