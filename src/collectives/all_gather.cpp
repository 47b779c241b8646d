// All-gather. Direct (when the transport can get() from peers' memory and the message is
// large): every rank reads each peer's input straight into outs[peer], one copy per byte,
// then a final step keeps the inputs alive until every reader is done. Staged otherwise:
// per chunk, stage mine, post, then copy every peer's staged chunk into its output.
// Peers are visited from rank+1 on, so they do not all read one rank at once.
#include "algorithms.hpp"

namespace tide::algo {

void all_gather(Ctx& c, const void* in, std::span<void* const> outs, size_t bytes,
                std::span<const uint64_t> peer_inputs) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  if (ws == 1) return t.copy(outs[me], in, bytes);
  if (!peer_inputs.empty()) {
    t.copy(outs[me], in, bytes);
    for (int i = 1; i < ws; ++i) {
      const int p = (me + i) % ws;
      t.get(p, outs[p], reinterpret_cast<const void*>(peer_inputs[p]), bytes);
    }
    c.begin_step();
    c.end_step();
    for (int p = 0; p < ws; ++p)
      if (p != me) t.wait(p, Flag::done(), c.step);
    return;
  }
  const size_t chunk = t.slot_bytes();
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t n = std::min(chunk, bytes - off);
    const int slot = c.begin_step();
    t.copy(t.local(slot), bytes_of(in) + off, n);
    t.post(Flag::ready(), c.step);
    // My own part from the slot just written: it is still in cache, `in` may not be.
    t.copy(bytes_of(outs[me]) + off, t.local(slot), n);
    for (int i = 1; i < ws; ++i) {
      const int p = (me + i) % ws;
      t.wait(p, Flag::ready(), c.step);
      t.copy(bytes_of(outs[p]) + off, t.peer(p, slot), n);
    }
    c.end_step();
  }
}

}  // namespace tide::algo
