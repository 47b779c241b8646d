// The collective algorithms, one per file, written once against tide::Transport. Arguments
// are already checked (locally and across ranks) by the communicator that calls them.
//
// Pipelining: a collective moves its data in steps; step s uses slot s % num_slots on every
// rank. Before reusing a slot, a rank waits until every peer posted done >= s - num_slots
// (all readers of the slot's previous contents are finished); every rank posts done = s at
// the end of each step, whether or not it wrote. Step numbers run on across collectives and
// are identical on all ranks because every rank splits the same agreed sizes the same way.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tide/comm.hpp"
#include "tide/rs_node.hpp"
#include "tide/transport.hpp"

namespace tide::algo {

struct Ctx {
  Transport& t;
  const uint64_t first;                     // where the counters started
  uint64_t step;                            // the current (last begun) pipeline step
  std::vector<uint64_t> sent, received;     // p2p chunks per peer (send_recv.cpp)
  // TIDE-RS's node partials across nodes (host_rs_node.cpp), kept from call to call: a fresh
  // buffer each call cost its page faults and zeroing at every reduce-scatter.
  std::shared_ptr<std::byte> partials;
  size_t partial_bytes = 0;

  explicit Ctx(Transport& transport)
      : t(transport), first(transport.counter_start()), step(first),
        sent(transport.world_size(), first), received(transport.world_size(), first) {}
  int rank() const { return t.rank(); }
  int ws() const { return t.world_size(); }

  // Starts the next step and returns its slot, free for writing.
  int begin_step() {
    ++step;
    const uint64_t n = static_cast<uint64_t>(t.num_slots());
    if (step - first > n)
      for (int p = 0; p < ws(); ++p)
        if (p != rank()) t.wait(p, Flag::done(), step - n);
    return static_cast<int>(step % n);
  }
  void end_step() { t.post(Flag::done(), step); }

  // Bytes of one per-rank piece of a slot, 64-byte aligned (for pieces ordered by rank).
  size_t piece_bytes() const { return t.slot_bytes() / static_cast<size_t>(ws()) / 64 * 64; }
};

inline const std::byte* bytes_of(const void* p) { return static_cast<const std::byte*>(p); }
inline std::byte* bytes_of(void* p) { return static_cast<std::byte*>(p); }

// peer_inputs: every rank's `in` address (in its own address space) to read directly with
// Transport::get; empty to go through staging.
void all_gather(Ctx& c, const void* in, std::span<void* const> outs, size_t bytes,
                std::span<const uint64_t> peer_inputs = {});
// Messages at least this large go direct when the transport can get().
inline constexpr size_t kDirectMinBytes = 256 << 10;
void reduce_scatter(Ctx& c, std::span<const void* const> ins, void* out, size_t count, DType in_dtype,
                    DType out_dtype, ReduceArgs op);
void all_reduce(Ctx& c, void* inout, size_t count, DType dtype, ReduceArgs op);
void reduce(Ctx& c, void* inout, size_t count, DType dtype, ReduceArgs op, int root);
void broadcast(Ctx& c, void* buf, size_t bytes, int root);
void gather(Ctx& c, const void* in, std::span<void* const> outs, size_t bytes, int root);
void scatter(Ctx& c, std::span<const void* const> ins, void* out, size_t bytes, int root);
// max_bytes: the largest send_bytes entry over all ranks (sets the number of steps).
void all_to_all(Ctx& c, const void* in, std::span<const size_t> send_bytes, std::span<const size_t> send_offsets,
                void* out, std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets,
                size_t max_bytes);
// Sends and receives, one or several, progressing together (send_recv.cpp).
void send_recv(Ctx& c, std::span<const P2POp> ops);

// The FSDP2 zero-copy path: TIDE-AG on one host (param_all_gather.cpp). Arguments are
// checked and agreed; the descriptor exchange before them is the opening barrier.
void param_all_gather(Ctx& c, const ParamAllGather& args);
// The same result by paced recursive doubling (plan::allgather_schedule), through staging:
// the inter-node algorithm, run on one host (param_all_gather_doubling.cpp).
void param_all_gather_doubling(Ctx& c, const ParamAllGather& args, size_t pace_bytes);
// TIDE-RS's node on this communicator (param_reduce_scatter.cpp runs over it).
std::unique_ptr<RsNode> host_rs_node(Ctx& c);

}  // namespace tide::algo
