// Point-to-point over the per-(sender, receiver) channel: a ring of chunks in the sender's
// segment. Each chunk starts with a header (tag, message bytes) that the receiver checks
// against its own arguments. Sends are eager: a chunk goes as soon as the ring has room.
// A group of sends and receives (one alone included) progresses together: every chunk
// that can move moves, and only when none can does the rank wait, a slice at a time on each
// blocked operation in turn, so ranks that each send to the next before receiving from
// the previous drain each other's rings instead of all waiting in their sends.
#include <algorithm>
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

// Waiting on one of several blocked operations: a slice, then the next one's turn.
constexpr auto kSlice = std::chrono::microseconds(200);

}  // namespace

void send_recv(Ctx& c, std::span<const P2POp> ops) {
  Transport& t = c.t;
  const int me = c.rank(), ws = t.world_size();
  const uint64_t depth = static_cast<uint64_t>(t.channel_depth());
  const size_t cap = payload(t);
  std::vector<size_t> done(ops.size(), 0), chunks(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) chunks[i] = num_chunks(t, ops[i].bytes);

  // The flag op i waits for to move its next chunk: the receiver's "taken" a ring behind, or
  // the sender's "sent".
  auto awaited = [&](size_t i) -> std::pair<Flag, uint64_t> {
    const P2POp& op = ops[i];
    if (op.send) return {Flag::taken(me), c.sent[op.peer] + 1 - depth};
    return {Flag::sent(me), c.received[op.peer] + 1};
  };
  auto can_move = [&](size_t i) {
    const P2POp& op = ops[i];
    if (op.send && c.sent[op.peer] + 1 - c.first <= depth) return true;  // the ring's first lap
    auto [flag, value] = awaited(i);
    return t.wait_for(op.peer, flag, value, std::chrono::microseconds(0));
  };
  auto move_chunk = [&](size_t i) {
    const P2POp& op = ops[i];
    const size_t off = done[i] * cap, n = off < op.bytes ? std::min(cap, op.bytes - off) : 0;
    if (op.send) {
      const uint64_t k = ++c.sent[op.peer];
      std::byte* ch = t.channel(me, op.peer, static_cast<int>(k % depth));
      const ChunkHeader h{op.tag, op.bytes, done[i]};
      std::memcpy(ch, &h, sizeof h);
      if (n) t.copy(ch + kHeader, bytes_of(op.buf) + off, n);
      t.post(Flag::sent(op.peer), k);
    } else {
      const uint64_t k = ++c.received[op.peer];
      const std::byte* ch = t.channel(op.peer, me, static_cast<int>(k % depth));
      ChunkHeader h;
      std::memcpy(&h, ch, sizeof h);
      TIDE_CHECK(h.tag == op.tag && h.bytes == op.bytes, "tide recv: rank ", me, " expected ", op.bytes,
                 " bytes with tag ", op.tag, " from rank ", op.peer, ", but rank ", op.peer, " sent ", h.bytes,
                 " bytes with tag ", h.tag, " (sends and receives must match in order)");
      if (n) t.copy(bytes_of(op.buf) + off, ch + kHeader, n);
      t.post(Flag::taken(op.peer), k);
    }
    ++done[i];
  };

  // Per (peer, direction) only the first unfinished operation moves: pairs match in order.
  std::vector<uint8_t> busy(2 * static_cast<size_t>(ws));
  size_t turn = 0;  // the blocked operation whose flag is waited on next
  for (;;) {
    std::fill(busy.begin(), busy.end(), 0);
    bool moved = false, pending = false;
    std::vector<size_t> blocked;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (done[i] == chunks[i]) continue;
      uint8_t& line = busy[2 * static_cast<size_t>(ops[i].peer) + ops[i].send];
      if (line) continue;
      while (done[i] < chunks[i] && can_move(i)) {
        move_chunk(i);
        moved = true;
      }
      if (done[i] < chunks[i]) {
        line = 1;
        pending = true;
        blocked.push_back(i);
      }
    }
    if (!pending) return;
    if (moved) continue;
    const size_t i = blocked[turn++ % blocked.size()];
    auto [flag, value] = awaited(i);
    // Alone, it may wait as long as wait() would; with others, a slice before their turn.
    t.wait_for(ops[i].peer, flag, value, blocked.size() == 1 ? std::chrono::microseconds::max() : kSlice);
  }
}

}  // namespace tide::algo
