// The peers of a node as the two-level collectives see them (include/tide/engine.hpp):
// storages and progress words in symmetric memory of the node's host communicator.
#include <atomic>
#include <thread>

#include "tide/engine.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

class SymmetricNodePeers final : public NodePeers {
 public:
  SymmetricNodePeers(Comm& node, const plan::Topology& topo, int rank, SymmetricBuffer& progress,
                     SymmetricBuffer& storages, std::vector<size_t> offsets, std::chrono::milliseconds timeout)
      : node_(node), topo_(topo), me_(rank), progress_(progress), storages_(storages),
        offsets_(std::move(offsets)), timeout_(timeout) {}

  const std::byte* storage(int rank, int param) override {
    return storages_.peer(local(rank)) + offsets_.at(static_cast<size_t>(param));
  }
  void publish(uint64_t value) override { word(me_).store(value, std::memory_order_release); }
  void await(int rank, uint64_t value) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    auto nap = std::chrono::microseconds(1);
    while (word(rank).load(std::memory_order_acquire) < value) {
      if (std::chrono::steady_clock::now() >= deadline)
        throw TimeoutError(detail::concat("tide param_all_gather: rank ", me_, " timed out after ", timeout_.count(),
                                          " ms waiting for rank ", rank, " (same node) to reach step ", value));
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
  void barrier() override { node_.barrier(); }

 private:
  int local(int rank) const {
    TIDE_CHECK(topo_.node_of(rank) == topo_.node_of(me_), "tide: rank ", me_, " asked for node-local memory of rank ",
               rank, " on another node");
    return topo_.local_rank(rank);
  }
  std::atomic<uint64_t>& word(int rank) {
    return *reinterpret_cast<std::atomic<uint64_t>*>(progress_.peer(local(rank)));
  }

  Comm& node_;
  plan::Topology topo_;
  int me_;
  SymmetricBuffer& progress_;
  SymmetricBuffer& storages_;
  std::vector<size_t> offsets_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::unique_ptr<NodePeers> make_node_peers(Comm& node_comm, const plan::Topology& topology, int rank,
                                           SymmetricBuffer& progress, SymmetricBuffer& storages,
                                           std::vector<size_t> storage_offsets, std::chrono::milliseconds timeout) {
  return std::make_unique<SymmetricNodePeers>(node_comm, topology, rank, progress, storages,
                                              std::move(storage_offsets), timeout);
}

}  // namespace tide
