// Reduce to root: every other rank stages its chunk, root reduces all of them (rank order,
// its own contribution in place) into its buffer. Other ranks' buffers stay untouched.
#include <vector>

#include "algorithms.hpp"

namespace tide::algo {

void reduce(Ctx& c, void* inout, size_t count, DType dtype, ReduceArgs op, int root) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  const size_t es = dtype_size(dtype), chunk = t.slot_bytes() / es;
  std::vector<const void*> srcs(ws);
  if (ws == 1) {
    srcs[0] = inout;
    return t.reduce(inout, dtype, srcs, dtype, count, op);
  }
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    std::byte* mine = bytes_of(inout) + off * es;
    const int slot = c.begin_step();
    if (me != root) {
      t.copy(t.local(slot), mine, n * es);
      t.post(Flag::ready(), c.step);
    } else {
      for (int p = 0; p < ws; ++p) {
        if (p != me) t.wait(p, Flag::ready(), c.step);
        srcs[p] = p == me ? static_cast<const void*>(mine) : t.peer(p, slot);
      }
      t.reduce(mine, dtype, srcs, dtype, n, op);
    }
    c.end_step();
  }
}

}  // namespace tide::algo
