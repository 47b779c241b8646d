// Between nodes: an existing engine moves the bytes (torch's gloo on CPUs; on GPUs the NCCL
// that torch loaded), behind this one small interface. Inside a node: the node's peers
// (their storages in symmetric memory, a progress counter per rank, a barrier). TIDE-AG
// across nodes is written once against both (src/collectives/node_all_gather.cpp); TIDE-RS
// against Engine and RsNode (include/tide/rs_node.hpp).
#pragma once
#include <chrono>
#include <cstddef>
#include <deque>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tide/comm.hpp"
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide {

// `symmetric`: the bytes lie at the same offset of the group's symmetric memory on the
// sender and on the receiver (a contiguous block of a storage in the symmetric pool), set
// alike on both sides of a message: an engine with one-sided puts may write them straight
// there (include/tide/one_sided.hpp); two-sided engines ignore it.
struct EngineSend {
  int peer = 0;  // a global rank on another node
  const void* data = nullptr;
  size_t bytes = 0;
  bool symmetric = false;
};
struct EngineRecv {
  int peer = 0;
  void* data = nullptr;
  size_t bytes = 0;
  bool symmetric = false;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const char* name() const = 0;  // what TIDE_DEBUG prints: "gloo", "nccl send-recv", ...
  // Posts every send and receive and returns; finish() waits for the oldest exchange
  // started and not yet finished (so several can be in flight, finished in order). The
  // byte ranges must stay valid until then; `keep_alive` (the buffers behind them) is held
  // until the exchange finished, and for the engine's life after a failure, so that a late
  // delivery of a failed exchange never lands in freed memory. Messages from one rank to
  // another match in the order they are posted; a receive names its exact size. A dead or
  // silent peer raises tide::TimeoutError (the engine's own timeout) from finish().
  virtual void start(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs,
                     std::shared_ptr<const void> keep_alive = nullptr) = 0;
  virtual void finish() = 0;
  // After a failure with exchanges still in flight (the collective threw between start()
  // and finish()): forgets them, keeping their buffers for the engine's life, so that the
  // next collective's finish() never pairs with a stale exchange. Engines that keep nothing
  // in flight have nothing to do.
  virtual void abandon() {}
};

// The distinct peers of an exchange in ascending order, as "2, 6": engines name them when
// an exchange fails.
std::string peer_list(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs);

// An engine's exchanges: those started and not finished, oldest first, and those that
// failed, kept for the engine's life (a late delivery may still land in their buffers).
// Exchange holds what the engine needs to finish one, its keep_alive and its `peers`.
template <class Exchange>
class InFlight {
 public:
  Exchange& start() { return in_flight_.emplace_back(); }
  // Starts an exchange with these peers: post(exchange) posts its messages. If that throws
  // (a peer already gone), the exchange is kept and a TimeoutError names the engine and the
  // peers, as finish() does.
  template <class Post>
  void start(const std::string& engine, std::string peers, Post&& post) {
    Exchange& exchange = start();
    exchange.peers = std::move(peers);
    try {
      post(exchange);
    } catch (const std::exception& e) {
      std::string why = failure(engine, exchange.peers, e);
      fail_newest();
      throw TimeoutError(std::move(why));
    }
  }
  // The newest exchange could not be started: kept with the failed.
  void fail_newest() {
    failed_.push_back(std::move(in_flight_.back()));
    in_flight_.pop_back();
  }
  // Finishes the oldest with wait(exchange). If that throws, the exchange is kept and a
  // TimeoutError names the engine and the exchange's peers.
  template <class Wait>
  void finish(const std::string& engine, Wait&& wait) {
    TIDE_CHECK(!in_flight_.empty(), "tide inter-node exchange over ", engine, ": finish() without start()");
    Exchange exchange = std::move(in_flight_.front());
    in_flight_.pop_front();
    try {
      wait(exchange);
    } catch (const std::exception& e) {
      std::string why = failure(engine, exchange.peers, e);
      failed_.push_back(std::move(exchange));
      throw TimeoutError(std::move(why));
    }
  }
  // Everything in flight joins the failed; returns whether there was any.
  bool abandon() {
    const bool any = !in_flight_.empty();
    for (Exchange& e : in_flight_) failed_.push_back(std::move(e));
    in_flight_.clear();
    return any;
  }
  bool empty() const { return in_flight_.empty(); }

 private:
  static std::string failure(const std::string& engine, const std::string& peers, const std::exception& e) {
    return detail::concat("inter-node exchange over ", engine, " with ranks ", peers, " failed: ", e.what());
  }
  std::deque<Exchange> in_flight_;
  std::vector<Exchange> failed_;
};

class NodePeers {
 public:
  virtual ~NodePeers() = default;
  // The unsharded storage of `param` of `rank`, a rank of this node (this rank included).
  virtual const std::byte* storage(int rank, int param) = 0;
  // Progress counters: values grow across collectives; await returns once `rank` has
  // published at least `value` (or raises tide::TimeoutError).
  virtual void publish(uint64_t value) = 0;
  virtual void await(int rank, uint64_t value) = 0;
  virtual void barrier() = 0;
  // The node's memory moves, in this rank's order of work: `rows` rows of `width` bytes,
  // rows dst_pitch / src_pitch bytes apart. The host does it at once (the default); CUDA
  // enqueues it on the collective's stream, as it does publish, await, barrier and the
  // engine's exchanges, so the executor never reads on the host what it moved.
  virtual void copy(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows);
  // A buffer of `bytes` in the memory the engine moves (host here, device memory on CUDA),
  // freed when its last owner lets go, after the work enqueued before that.
  virtual std::shared_ptr<std::byte> scratch(size_t bytes);
};

// TIDE-AG across nodes, once this rank's own shard sits at its placement in its own
// storages: the schedule's inter-node rounds over `engine`, straight from and into the
// storages (a contiguous block is sent and received where it lies; a strided one is packed
// and unpacked), and its node-local copies from the node peers' storages, each as soon as
// the peer has the block. Blocks travel in the storage dtype, storage_elem_size bytes per
// element (the schedule must be paced for it). Progress values progress_base + 1 ..
// progress_base + steps + 1 are published (words start at 0); returns the next collective's
// base. Ends with the node's barrier (no peer still reads this rank's storages).
struct NodeAllGather {
  const plan::GroupLayout* layout = nullptr;
  const plan::NodeAllGatherSchedule* schedule = nullptr;
  int rank = 0;
  std::span<void* const> storages;
  size_t storage_elem_size = 4;
  uint64_t progress_base = 0;
  // Every rank's storage of a parameter lies at the same offset of its symmetric memory (the
  // pool's blocks): contiguous blocks then travel as EngineSend::symmetric messages.
  bool symmetric_storages = false;
};
uint64_t node_param_all_gather(const NodeAllGather& args, Engine& engine, NodePeers& peers);

// The two-level schedules a rank has planned, by layout, topology and pace, each cut down
// to what `rank` sends, receives and copies (the executor's view): FSDP2 all-gathers the
// same groups every step, and planning one costs O(world size x blocks) in time and in
// memory (a transformer block's eight parameters, 8 ranks per node: 3.9 ms at 64 ranks,
// 69 ms at 256, with 287 K node-local copies for all ranks at 64).
class NodeScheduleCache {
 public:
  const plan::NodeAllGatherSchedule& get(const plan::GroupLayout& layout, const plan::Topology& topology,
                                         int64_t pace_elems, int rank);

 private:
  struct Key {  // the hash, and what a hash collision would have to match too
    uint64_t layout_hash;
    size_t params;
    int64_t numel;
    int world_size, local_size, rank;
    int64_t pace_elems;
    auto operator<=>(const Key&) const = default;
  };
  std::map<Key, std::shared_ptr<const plan::NodeAllGatherSchedule>> schedules_;
};

}  // namespace tide

namespace tide {

// NodePeers over a node's host communicator: rank r's storage of param p at
// storage_offsets[p] bytes into storages->peer(local rank of r), and each rank's progress
// (a futex word) in its 64-byte part of `progress` (both allocated on node_comm, so
// symmetric on the node). A waiter spins node_comm.wait_spin(), then sleeps.
std::unique_ptr<NodePeers> make_node_peers(Comm& node_comm, const plan::Topology& topology, int rank,
                                           SymmetricBuffer& progress, SymmetricBuffer& storages,
                                           std::vector<size_t> storage_offsets, std::chrono::milliseconds timeout);

// Both parameter collectives of a group over several nodes on the host, from one rank: the
// node's host communicator, the nodes and the engine between them, and what TIDE-AG carries
// from one call to the next (the node's progress words and values, the schedules).
class TwoLevelComm {
 public:
  // Collective over the node: allocates the progress words on `node`. Node peers wait for
  // each other up to the node communicator's timeout.
  TwoLevelComm(Comm& node, TwoLevel group);
  // TIDE-AG: this rank's own shard, cast, to its placement in its own storages, which lie in
  // `home` (node-symmetric memory) at `offsets`; then node_param_all_gather over the
  // two-level schedule paced at pace_bytes per rank and round (storage dtype; 0:
  // TIDE_ALLGATHER_PACE_BYTES or 4 MiB).
  void param_all_gather(const ParamAllGather& args, SymmetricBuffer& home, std::vector<size_t> offsets,
                        size_t pace_bytes = 0);
  // TIDE-RS: the node's communicator checks the arguments across the node and runs the
  // executor over its RsNode and the engine.
  StagingReport param_reduce_scatter(ParamReduceScatter args);

 private:
  Comm& node_;
  TwoLevel group_;
  std::shared_ptr<SymmetricBuffer> progress_words_;
  uint64_t progress_ = 0;
  NodeScheduleCache schedules_;
};

}  // namespace tide
