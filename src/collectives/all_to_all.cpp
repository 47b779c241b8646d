// All-to-all (v): per step, each rank stages up to one piece for every other rank (piece d
// of its slot is for rank d); receivers copy their piece from each sender. Steps run until
// the longest message of any pair is through; my own part is one direct copy.
#include "algorithms.hpp"

namespace tide::algo {

void all_to_all(Ctx& c, const void* in, std::span<const size_t> send_bytes, std::span<const size_t> send_offsets,
                void* out, std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets,
                size_t max_bytes) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  if (send_bytes[me]) t.copy(bytes_of(out) + recv_offsets[me], bytes_of(in) + send_offsets[me], send_bytes[me]);
  if (ws == 1) return;
  const size_t piece = c.piece_bytes();
  auto part = [&](size_t total, size_t off) { return off < total ? std::min(piece, total - off) : size_t{0}; };
  for (size_t off = 0; off < max_bytes; off += piece) {
    const int slot = c.begin_step();
    for (int d = 0; d < ws; ++d) {
      const size_t n = part(send_bytes[d], off);
      if (d != me && n) t.copy(t.local(slot) + d * piece, bytes_of(in) + send_offsets[d] + off, n);
    }
    t.post(Flag::ready(), c.step);
    for (int i = 1; i < ws; ++i) {
      const int p = (me + i) % ws;
      const size_t n = part(recv_bytes[p], off);
      if (n == 0) continue;
      t.wait(p, Flag::ready(), c.step);
      t.copy(bytes_of(out) + recv_offsets[p] + off, t.peer(p, slot) + me * piece, n);
    }
    c.end_step();
  }
}

}  // namespace tide::algo
