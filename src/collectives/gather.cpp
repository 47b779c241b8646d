// Gather to root: every other rank stages each chunk; root copies them into outs[rank].
#include "algorithms.hpp"

namespace tide::algo {

void gather(Ctx& c, const void* in, std::span<void* const> outs, size_t bytes, int root) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  if (me == root) t.copy(outs[me], in, bytes);
  if (ws == 1) return;
  const size_t chunk = t.slot_bytes();
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t n = std::min(chunk, bytes - off);
    const int slot = c.begin_step();
    if (me != root) {
      t.copy(t.local(slot), bytes_of(in) + off, n);
      t.post(Flag::ready(), c.step);
    } else {
      for (int i = 1; i < ws; ++i) {
        const int p = (me + i) % ws;
        t.wait(p, Flag::ready(), c.step);
        t.copy(bytes_of(outs[p]) + off, t.peer(p, slot), n);
      }
    }
    c.end_step();
  }
}

}  // namespace tide::algo
