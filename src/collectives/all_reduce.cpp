// All-reduce = reduce-scatter + all-gather per chunk, inside the staging slots. The chunk is
// split into ws pieces; rank d reduces piece d (rank order, so every rank ends with the same
// bits) into its own slot, and everyone copies every reduced piece back.
#include <vector>

#include "algorithms.hpp"

namespace tide::algo {

void all_reduce(Ctx& c, void* inout, size_t count, DType dtype, ReduceArgs op) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  const size_t es = dtype_size(dtype);
  std::vector<const void*> srcs(ws);
  if (ws == 1) {
    srcs[0] = inout;
    return t.reduce(inout, dtype, srcs, dtype, count, op);
  }
  const size_t piece = c.piece_bytes(), chunk = piece / es * ws;
  std::byte* data = bytes_of(inout);
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    const size_t q = (n + ws - 1) / ws;  // elements per piece; the last pieces may be short or empty
    auto first = [&](int d) { return std::min(n, d * q); };
    auto len = [&](int d) { return std::min(n, (d + 1) * q) - first(d); };
    auto user = [&](int d) { return data + (off + first(d)) * es; };
    const int slot = c.begin_step();
    for (int d = 0; d < ws; ++d)
      if (d != me) t.copy(t.local(slot) + d * piece, user(d), len(d) * es);
    t.post(Flag::ready(), c.step);
    for (int p = 0; p < ws; ++p) {
      if (p == me) {
        srcs[p] = user(me);
      } else {
        t.wait(p, Flag::ready(), c.step);
        srcs[p] = t.peer(p, slot) + me * piece;
      }
    }
    std::byte* mine = t.local(slot) + me * piece;  // nobody else reads piece `me` of my slot in phase 1
    t.reduce(mine, dtype, srcs, dtype, len(me), op);
    t.post(Flag::reduced(), c.step);
    t.copy(user(me), mine, len(me) * es);
    for (int i = 1; i < ws; ++i) {
      const int p = (me + i) % ws;
      t.wait(p, Flag::reduced(), c.step);
      t.copy(user(p), t.peer(p, slot) + p * piece, len(p) * es);
    }
    c.end_step();
  }
}

}  // namespace tide::algo
