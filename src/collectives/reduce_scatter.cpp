// Reduce-scatter, two phases per chunk: (1) each rank stages its pieces for the other ranks
// (piece d of the slot is for rank d); (2) each rank reduces its own piece from every rank,
// in rank order 0..ws-1, straight into its output (bf16/f16 accumulate in fp32; bf16 in,
// f32 out is the mixed-precision mode). Its own contribution is read in place.
#include <vector>

#include "algorithms.hpp"

namespace tide::algo {

void reduce_scatter(Ctx& c, std::span<const void* const> ins, void* out, size_t count, DType in_dtype,
                    DType out_dtype, ReduceArgs op) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  const size_t in_es = dtype_size(in_dtype), out_es = dtype_size(out_dtype);
  std::vector<const void*> srcs(ws);
  if (ws == 1) {
    srcs[0] = ins[0];
    return t.reduce(out, out_dtype, srcs, in_dtype, count, op);
  }
  const size_t piece = c.piece_bytes(), chunk = piece / in_es;
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    const int slot = c.begin_step();
    for (int d = 0; d < ws; ++d)
      if (d != me) t.copy(t.local(slot) + d * piece, bytes_of(ins[d]) + off * in_es, n * in_es);
    t.post(Flag::ready(), c.step);
    for (int p = 0; p < ws; ++p) {
      if (p == me) {
        srcs[p] = bytes_of(ins[me]) + off * in_es;
      } else {
        t.wait(p, Flag::ready(), c.step);
        srcs[p] = t.peer(p, slot) + me * piece;
      }
    }
    t.reduce(bytes_of(out) + off * out_es, out_dtype, srcs, in_dtype, n, op);
    c.end_step();
  }
}

}  // namespace tide::algo
