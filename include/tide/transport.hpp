// The one-sided transport the host collectives are written against (NVSHMEM-like). A
// transport gives every rank a symmetric staging area that peers can address, the copies
// and reductions it runs (the host's: a thread pool), per-rank counters ("flags") that
// peers wait on, and a small control exchange.
// Algorithms (src/collectives/*.cpp) only see this interface.
//
// Flags are monotonic 32-bit counters compared modulo 2^32 ("at least"), so they are never
// reset. Each rank posts only its own flags; anyone may wait on anyone's.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tide/comm.hpp"
#include "tide/dtype.hpp"
#include "tide/error.hpp"

namespace tide {

// Flag indices. The fixed ones are shared by every collective; p2p channels get one counter
// per peer on each side.
struct Flag {
  uint32_t index;
  static constexpr uint32_t kFixed = 4;
  static constexpr Flag ready() { return {0}; }    // my slot holds this step's data
  static constexpr Flag reduced() { return {1}; }  // my share of this step is reduced
  static constexpr Flag done() { return {2}; }     // I finished this step (read all I need)
  static constexpr Flag control() { return {3}; }  // reserved for the transport's exchange()
  // Sender side: chunks posted to `receiver`; receiver side: chunks taken from `sender`.
  static Flag sent(int receiver) { return {kFixed + 2 * static_cast<uint32_t>(receiver)}; }
  static Flag taken(int sender) { return {kFixed + 2 * static_cast<uint32_t>(sender) + 1}; }
};

// `count` runs of `run` elements, from src + k * src_stride to dst + k * dst_stride
// (elements of the respective dtype), for k < count.
struct StridedCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t run = 0, count = 0;
  size_t dst_stride = 0, src_stride = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Staging: num_slots() slots of slot_bytes() per rank (64-byte aligned), used round-robin
  // by pipeline steps. peer(r, s) is rank r's slot s, mapped for loads and stores;
  // local(s) == peer(rank(), s).
  virtual int num_slots() const = 0;
  virtual size_t slot_bytes() const = 0;
  virtual std::byte* peer(int rank, int slot) = 0;
  std::byte* local(int slot) { return peer(rank(), slot); }

  // Point-to-point channels: per ordered (sender, receiver) pair a ring of channel_depth()
  // chunks of channel_bytes() each, living with the sender, addressable by both.
  virtual int channel_depth() const = 0;
  virtual size_t channel_bytes() const = 0;
  virtual std::byte* channel(int sender, int receiver, int index) = 0;

  // Engines. Both block until the work is done and may split it over several workers.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // dst[i] = op over srcs[k][i] in order k = 0..n-1 (see reduce_kernels.hpp).
  virtual void reduce(void* dst, DType dst_dtype, std::span<const void* const> srcs, DType src_dtype,
                      size_t count, ReduceArgs args) = 0;

  // Batched strided copy with conversion (equal dtypes: plain copy; f32 -> bf16/f16 rounds
  // to nearest even like the reduce kernels; bf16/f16 -> f32 widens), split over the
  // engine's workers: big runs are split, small runs are batched. Blocks until done.
  virtual void convert(std::span<const StridedCopy> ops, DType dst_dtype, DType src_dtype);

  // Collective: memory every rank maps (see SymmetricBuffer in comm.hpp). Transports
  // without peer-mapped memory throw.
  virtual std::shared_ptr<SymmetricBuffer> allocate_symmetric(size_t bytes);

  // Optional one-sided get from a peer's private memory (host: Linux CMA,
  // process_vm_readv), so a collective can read a peer's user buffer directly instead of
  // through staging. `remote` is an address in the peer's address space. Only valid when
  // can_get() is true on every rank (the host transport makes it all-or-nothing).
  virtual bool can_get() const { return false; }
  virtual void get(int peer, void* dst, const void* remote, size_t bytes);

  // Set my flag to `value` (release) and wake its waiters. Counters are 64-bit; a flag holds
  // the low 32 bits and compares cyclically, so a waiter may trail by up to 2^31.
  virtual void post(Flag flag, uint64_t value) = 0;
  // Until `peer`'s flag reaches `value` (acquire). Throws TimeoutError when the current op's
  // deadline passes, or the peer died or aborted.
  virtual void wait(int peer, Flag flag, uint64_t value) = 0;
  // wait(), for at most `at_most` (zero: a look): whether the flag reached `value`. For a rank
  // waiting on several peers at once (grouped send/recv); the deadline and the peer's
  // liveness are checked as in wait().
  virtual bool wait_for(int peer, Flag flag, uint64_t value, std::chrono::microseconds at_most) = 0;
  // How long wait() spins before it sleeps.
  virtual std::chrono::microseconds wait_spin() const = 0;
  // Where every counter (pipeline steps, p2p chunks, exchanges) starts; every flag holds it
  // from creation on (CommOptions::counter_start).
  virtual uint64_t counter_start() const { return 0; }

  // All-gather of a small control record (at most the transport's record size) into
  // all[world_size * bytes]; returns once every rank has contributed (a barrier).
  virtual void exchange(const void* mine, size_t bytes, void* all) = 0;
  void barrier() { exchange(nullptr, 0, nullptr); }

  // The collective now running: its name and a short description of its arguments, used in
  // error messages, and its deadline (now + the communicator's timeout).
  virtual void begin(const char* collective, std::string detail) = 0;
  // The timeout of every collective that begins after set_timeout (the group's
  // setTimeout); any thread may call it.
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  // Give up: peers waiting on this rank fail fast with `why` instead of timing out, and so
  // does this rank's own wait in progress (any thread may call it) and every later collective.
  virtual void abort(const std::string& why) = 0;
};

inline void Transport::get(int, void*, const void*, size_t) {
  throw Error(detail::concat("tide: the ", name(), " transport cannot read peers' memory (can_get() is false)"));
}

}  // namespace tide
