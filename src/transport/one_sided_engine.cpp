// An exchange over one-sided puts (include/tide/one_sided.hpp). Per exchange, on each rank:
//   1. a "ready" signal to every peer that puts to this rank in it (the receiver's stream
//      has reached the exchange: nothing it still needs lies where the puts land);
//   2. a wait for the "ready" of every peer this rank puts to;
//   3. the puts, straight from this rank's window into the same offsets of the peers';
//   4. what is not symmetric, over the two-sided engine;
// and finish() waits for one signal per put received, then finishes the two-sided part.
// A peer's signals to this rank arrive in the order the peer issued them: per exchange its
// "ready" (when this rank puts to it), then one per put it makes here. Both ranks derive
// those counts from the exchange's message lists, which pair up (the Engine contract), so
// `expected_` is, for every peer, the number of signals it will have sent by the end of the
// exchanges started so far, and every wait is an exact cumulative target.
#include "tide/one_sided.hpp"

#include "tide/error.hpp"

namespace tide {

OneSidedEngine::OneSidedEngine(OneSidedWire& wire, Engine& two_sided, int rank, std::string name)
    : wire_(wire), two_sided_(two_sided), rank_(rank), name_(std::move(name)) {}

void OneSidedEngine::wait_until(std::vector<OneSidedWire::Wait>& batch, int peer, uint64_t target) {
  uint64_t& waited = waited_[peer];
  if (target <= waited) return;  // an earlier wait covered it (a later exchange's ready follows its data)
  batch.push_back({peer, static_cast<int>(target - waited)});
  waited = target;
}

void OneSidedEngine::start(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs,
                           std::shared_ptr<const void> keep_alive) {
  TIDE_CHECK(!broken_, "tide inter-node exchange over ", name_, ": rank ", rank_,
             ": an earlier exchange failed, so the peers' signals no longer pair up (the group is unusable)");
  Exchange& exchange = exchanges_.start();
  exchange.keep_alive = keep_alive;
  exchange.peers = peer_list(sends, recvs);
  try {
    std::vector<EngineSend> other_sends;
    std::vector<EngineRecv> other_recvs;
    std::vector<OneSidedWire::Put> puts;
    std::map<int, int> puts_to, puts_from;  // symmetric messages per peer, in this exchange
    for (const EngineSend& s : sends) {
      if (!s.symmetric) {
        other_sends.push_back(s);
        continue;
      }
      const int64_t at = wire_.window_offset(s.data, s.bytes);
      TIDE_CHECK(at >= 0, "tide inter-node exchange over ", name_, ": rank ", rank_, ": a send of ", s.bytes,
                 " bytes to rank ", s.peer, " is marked symmetric but lies outside the registered window");
      puts.push_back({s.data, s.bytes, s.peer, static_cast<size_t>(at)});
      ++puts_to[s.peer];
    }
    for (const EngineRecv& r : recvs) {
      if (!r.symmetric) {
        other_recvs.push_back(r);
        continue;
      }
      TIDE_CHECK(wire_.window_offset(r.data, r.bytes) >= 0, "tide inter-node exchange over ", name_, ": rank ",
                 rank_, ": a receive of ", r.bytes, " bytes from rank ", r.peer,
                 " is marked symmetric but lies outside the registered window");
      ++puts_from[r.peer];
    }
    std::vector<int> ready;
    std::vector<OneSidedWire::Wait> readiness;
    for (const auto& [peer, n] : puts_from) ready.push_back(peer);
    std::map<int, int> peers = puts_from;
    for (const auto& [peer, n] : puts_to) peers.try_emplace(peer, 0);
    for (const auto& [peer, from] : peers) {
      uint64_t& expected = expected_[peer];
      const bool to = puts_to.contains(peer);
      if (to) wait_until(readiness, peer, expected + 1);  // its ready comes first
      expected += (to ? 1 : 0) + static_cast<uint64_t>(from);
      if (from > 0) exchange.data.push_back({peer, expected});
    }
    if (!ready.empty()) wire_.signal(ready);  // before waiting: a peer may wait for it
    if (!readiness.empty()) wire_.wait(readiness);
    if (!puts.empty()) wire_.put(puts);
    for (const OneSidedWire::Put& p : puts) bytes_put_ += static_cast<int64_t>(p.bytes);
    if (!other_sends.empty() || !other_recvs.empty()) {
      exchange.two_sided = true;
      two_sided_.start(other_sends, other_recvs, keep_alive);
    }
  } catch (...) {
    broken_ = true;
    exchanges_.fail_newest();
    throw;
  }
}

void OneSidedEngine::handshake(std::span<const int> to, std::span<const int> from) {
  TIDE_CHECK(!broken_ && exchanges_.empty(), "tide inter-node exchange over ", name_, ": rank ", rank_,
             ": a handshake needs an idle, healthy engine");
  try {
    std::vector<OneSidedWire::Wait> waits;
    for (int peer : from) wait_until(waits, peer, ++expected_[peer]);
    if (!to.empty()) wire_.signal(to);
    if (!waits.empty()) wire_.wait(waits);
  } catch (...) {
    broken_ = true;
    throw;
  }
}

void OneSidedEngine::finish() {
  try {
    exchanges_.finish(name_, [&](Exchange& exchange) {
      std::vector<OneSidedWire::Wait> arrived;
      for (const auto& [peer, target] : exchange.data) wait_until(arrived, peer, target);
      if (!arrived.empty()) wire_.wait(arrived);
      if (exchange.two_sided) two_sided_.finish();
    });
  } catch (...) {
    broken_ = true;
    throw;
  }
}

void OneSidedEngine::abandon() {
  if (exchanges_.abandon()) broken_ = true;
  two_sided_.abandon();
}

}  // namespace tide
