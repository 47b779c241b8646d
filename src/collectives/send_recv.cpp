// Point-to-point over the per-(sender, receiver) channel: a ring of chunks in the sender's
// segment. Each chunk starts with a header (tag, message bytes) that the receiver checks
// against its own arguments. Sends are eager: they return once the last chunk is in the
// ring, blocking only while the ring is full.
#include <cstring>

#include "algorithms.hpp"
#include "tide/error.hpp"

namespace tide::algo {
namespace {

struct alignas(64) ChunkHeader {
  int64_t tag;
  uint64_t bytes;  // of the whole message
  uint64_t index;  // chunk number within the message
};
constexpr size_t kHeader = sizeof(ChunkHeader);

size_t payload(Transport& t) { return t.channel_bytes() - kHeader; }
size_t num_chunks(Transport& t, size_t bytes) { return bytes == 0 ? 1 : (bytes + payload(t) - 1) / payload(t); }

}  // namespace

void send(Ctx& c, const void* buf, size_t bytes, int peer, int tag) {
  Transport& t = c.t;
  const int me = c.rank(), depth = t.channel_depth();
  const size_t cap = payload(t), chunks = num_chunks(t, bytes);
  for (size_t i = 0; i < chunks; ++i) {
    const uint64_t k = ++c.sent[peer];
    if (k - c.first > static_cast<uint64_t>(depth)) t.wait(peer, Flag::taken(me), k - depth);
    std::byte* ch = t.channel(me, peer, static_cast<int>(k % depth));
    ChunkHeader h{tag, bytes, i};
    std::memcpy(ch, &h, sizeof h);
    const size_t off = i * cap, n = off < bytes ? std::min(cap, bytes - off) : 0;
    if (n) t.copy(ch + kHeader, bytes_of(buf) + off, n);
    t.post(Flag::sent(peer), k);
  }
}

void recv(Ctx& c, void* buf, size_t bytes, int peer, int tag) {
  Transport& t = c.t;
  const int me = c.rank(), depth = t.channel_depth();
  const size_t cap = payload(t), chunks = num_chunks(t, bytes);
  for (size_t i = 0; i < chunks; ++i) {
    const uint64_t k = c.received[peer] + 1;
    t.wait(peer, Flag::sent(me), k);
    const std::byte* ch = t.channel(peer, me, static_cast<int>(k % depth));
    ChunkHeader h;
    std::memcpy(&h, ch, sizeof h);
    TIDE_CHECK(h.tag == tag && h.bytes == bytes, "tide recv: rank ", me, " expected ", bytes,
               " bytes with tag ", tag, " from rank ", peer, ", but rank ", peer, " sent ", h.bytes,
               " bytes with tag ", h.tag, " (sends and receives must match in order)");
    const size_t off = i * cap, n = off < bytes ? std::min(cap, bytes - off) : 0;
    if (n) t.copy(bytes_of(buf) + off, ch + kHeader, n);
    c.received[peer] = k;
    t.post(Flag::taken(peer), k);
  }
}

}  // namespace tide::algo
