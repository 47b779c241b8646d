// Broadcast: root stages each chunk, everyone else copies it out.
#include "algorithms.hpp"

namespace tide::algo {

void broadcast(Ctx& c, void* buf, size_t bytes, int root) {
  Transport& t = c.t;
  if (c.ws() == 1) return;
  const size_t chunk = t.slot_bytes();
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t n = std::min(chunk, bytes - off);
    const int slot = c.begin_step();
    if (c.rank() == root) {
      t.copy(t.local(slot), bytes_of(buf) + off, n);
      t.post(Flag::ready(), c.step);
    } else {
      t.wait(root, Flag::ready(), c.step);
      t.copy(bytes_of(buf) + off, t.peer(root, slot), n);
    }
    c.end_step();
  }
}

}  // namespace tide::algo
