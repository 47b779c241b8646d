// Scatter from root: root stages piece d of each chunk for rank d; rank d copies it out.
#include "algorithms.hpp"

namespace tide::algo {

void scatter(Ctx& c, std::span<const void* const> ins, void* out, size_t bytes, int root) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  if (me == root) t.copy(out, ins[me], bytes);
  if (ws == 1) return;
  const size_t piece = c.piece_bytes();
  for (size_t off = 0; off < bytes; off += piece) {
    const size_t n = std::min(piece, bytes - off);
    const int slot = c.begin_step();
    if (me == root) {
      for (int d = 0; d < ws; ++d)
        if (d != me) t.copy(t.local(slot) + d * piece, bytes_of(ins[d]) + off, n);
      t.post(Flag::ready(), c.step);
    } else {
      t.wait(root, Flag::ready(), c.step);
      t.copy(bytes_of(out) + off, t.peer(root, slot) + me * piece, n);
    }
    c.end_step();
  }
}

}  // namespace tide::algo
