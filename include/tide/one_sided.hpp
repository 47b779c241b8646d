// One-sided puts between nodes, behind the one small interface the two-level collectives
// already use (tide::Engine). The wire is what NCCL's host-side RMA calls offer (NCCL
// >= 2.29: ncclPutSignal / ncclSignal / ncclWaitSignal into windows registered with
// ncclCommWindowRegister), stated so that a test double can stand in for it:
//   - every rank has one registered window; a put writes bytes from the sender's window
//     into the peer's window at an offset, then adds one to the peer's signal counter for
//     the sender; a bare signal only adds one;
//   - operations to one peer arrive in the order they were issued, data before its signal;
//   - wait({peer, n}) waits for n more of peer's signals than the waits issued before it
//     waited for (NCCL keeps that count on the host and compares with >=);
//   - on CUDA every call is enqueued on the bound stream, in order, like everything else.
// OneSidedEngine runs an exchange over it: a message flagged `symmetric` (it lies at the
// same window offset on both ranks: the storages of the symmetric pool) is put straight
// into the receiver's memory; every other message (packed blocks, TIDE-RS partials) goes
// through a two-sided engine. Before putting, a sender waits for the receiver's "ready"
// signal for this exchange, which the receiver sends once its stream has reached the
// exchange (its storages hold nothing it still needs); a receiver's finish() waits for one
// signal per message. Both sides count a peer's signals from the same message lists, so
// every wait names exactly the signals of this exchange, also with exchanges in flight.
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tide/engine.hpp"

namespace tide {

class OneSidedWire {
 public:
  struct Put {
    const void* src;  // in this rank's window
    size_t bytes;
    int peer;
    size_t offset;  // into the peer's window
  };
  struct Wait {
    int peer;
    int signals;  // > 0, counted past the waits issued before
  };
  virtual ~OneSidedWire() = default;
  // The offset of [p, p + bytes) in this rank's window, or -1 where it is not inside it.
  virtual int64_t window_offset(const void* p, size_t bytes) const = 0;
  // Each call is one batch: its operations may run concurrently, across peers.
  virtual void signal(std::span<const int> peers) = 0;
  virtual void put(std::span<const Put> puts) = 0;
  virtual void wait(std::span<const Wait> waits) = 0;
};

class OneSidedEngine final : public Engine {
 public:
  // `two_sided` carries what is not symmetric; `rank` names this rank in errors.
  OneSidedEngine(OneSidedWire& wire, Engine& two_sided, int rank, std::string name);
  const char* name() const override { return name_.c_str(); }
  void start(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs,
             std::shared_ptr<const void> keep_alive) override;
  void finish() override;
  void abandon() override;
  // One bare signal to each rank of `to` and a wait for one from each rank of `from`
  // (every rank's `to` the others' `from`), counted like an exchange's: a first contact that
  // proves the wire works (and lets NCCL set up what it sets up at its first call, which
  // waits for every rank) before a collective depends on it.
  void handshake(std::span<const int> to, std::span<const int> from);
  int64_t bytes_put() const { return bytes_put_; }

 private:
  struct Exchange {
    std::vector<std::pair<int, uint64_t>> data;  // per peer putting here: the signal count its puts end at
    bool two_sided = false;
    std::shared_ptr<const void> keep_alive;
    std::string peers;  // for the error: "2, 6"
  };
  // Waits, in issue order, until `peer` has sent this rank `target` signals in all.
  void wait_until(std::vector<OneSidedWire::Wait>& batch, int peer, uint64_t target);

  OneSidedWire& wire_;
  Engine& two_sided_;
  int rank_;
  std::string name_;
  std::map<int, uint64_t> expected_;  // per peer: its signals to this rank, through the exchanges started
  std::map<int, uint64_t> waited_;    // per peer: how many of them the waits issued so far cover
  InFlight<Exchange> exchanges_;  // failed ones kept: late puts may still land in their buffers
  bool broken_ = false;           // after a failure the counts no longer pair up
  int64_t bytes_put_ = 0;
};

}  // namespace tide
