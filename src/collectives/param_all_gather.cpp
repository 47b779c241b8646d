// TIDE-AG on one host: every rank reads every peer's shards straight out of the peers'
// symmetric shard memory into its own parameter storages, at the planner's placement, with
// the mixed-precision cast done on the way (one copy per byte, no staging). Peers are
// visited from rank+1 on, so ranks do not all read one rank at once. The descriptor
// exchange before this is the opening barrier (every rank's shards are final); the closing
// step keeps every rank's shards unchanged until all readers are done.
#include <vector>

#include "algorithms.hpp"

namespace tide::algo {

void param_all_gather(Ctx& c, const ParamAllGather& a) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  const plan::GroupLayout& layout = *a.layout;
  std::vector<StridedCopy> ops;
  for (int i = 1; i <= ws; ++i) {
    const int r = (me + i) % ws;
    for (size_t p = 0; p < layout.params.size(); ++p) {
      const plan::Shard& s = layout.params[p].shards[r];
      if (s.numel == 0) continue;
      const plan::Strided& pl = s.placement;
      const size_t dst_es = dtype_size(a.storage_dtype);
      StridedCopy op;
      op.dst = bytes_of(a.storages[p]) + static_cast<size_t>(pl.offset) * dst_es;
      op.src = a.shards->peer(r) + a.shard_offsets[p];
      op.run = static_cast<size_t>(pl.run);
      op.count = static_cast<size_t>(pl.count);
      op.dst_stride = static_cast<size_t>(pl.stride);
      op.src_stride = op.run;
      if (op.count == 1 || pl.run == pl.stride) {  // contiguous: one run
        op.run *= op.count;
        op.count = 1;
      }
      ops.push_back(op);
    }
  }
  t.convert(ops, a.storage_dtype, a.shard_dtype);
  // Closing barrier: nobody returns (and overwrites its shards) while a peer still reads.
  c.begin_step();
  c.end_step();
  for (int p = 0; p < ws; ++p)
    if (p != me) t.wait(p, Flag::done(), c.step);
}

}  // namespace tide::algo
