// The peers of a node as the two-level collectives see them (include/tide/engine.hpp):
// storages and progress words in symmetric memory of the node's host communicator. A
// waiter spins as the node's transport does (host_spin: long where every process has a
// core, short where processes share cores, so that a waiter never takes a core a computing
// peer needs), then sleeps on the peer's word (SharedCounter), woken by publish(): no sleep
// overshoots a peer's progress, which small collectives would pay at every wait.
#include <cstring>
#include <set>

#include "../core/shared_counter.hpp"

#include "tide/engine.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

class SymmetricNodePeers final : public NodePeers {
 public:
  SymmetricNodePeers(Comm& node, const plan::Topology& topo, int rank, SymmetricBuffer& progress,
                     SymmetricBuffer& storages, std::vector<size_t> offsets, std::chrono::milliseconds timeout)
      : node_(node), topo_(topo), me_(rank), progress_(progress), storages_(storages),
        offsets_(std::move(offsets)), timeout_(timeout), spin_(node.wait_spin()) {}

  const std::byte* storage(int rank, int param) override {
    return storages_.peer(local(rank)) + offsets_.at(static_cast<size_t>(param));
  }
  void publish(uint64_t value) override { word(me_).post(static_cast<uint32_t>(value)); }
  void await(int rank, uint64_t value) override {
    SharedCounter& p = word(rank);
    const uint32_t target = static_cast<uint32_t>(value);
    if (p.reached(target)) return;
    const auto start = std::chrono::steady_clock::now();
    if (p.spin(target, spin_)) return;
    const timespec nap{0, 5'000'000};  // between deadline checks
    for (;;) {
      if (p.sleep(target, nap)) return;
      if (std::chrono::steady_clock::now() - start >= timeout_)
        throw TimeoutError(detail::concat("timed out after ", timeout_.count(), " ms waiting for rank ", rank,
                                          " (same node) to reach step ", value));
    }
  }
  void barrier() override { node_.barrier(); }

 private:
  int local(int rank) const {
    TIDE_CHECK(topo_.node_of(rank) == topo_.node_of(me_), "tide: rank ", me_, " asked for node-local memory of rank ",
               rank, " on another node");
    return topo_.local_rank(rank);
  }
  // Each rank's progress (the low 32 bits of the value) in its 64-byte part of `progress`.
  SharedCounter& word(int rank) { return *reinterpret_cast<SharedCounter*>(progress_.peer(local(rank))); }

  Comm& node_;
  plan::Topology topo_;
  int me_;
  SymmetricBuffer& progress_;
  SymmetricBuffer& storages_;
  std::vector<size_t> offsets_;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_;
};

}  // namespace

std::string peer_list(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs) {
  std::set<int> peers;
  for (const EngineSend& s : sends) peers.insert(s.peer);
  for (const EngineRecv& r : recvs) peers.insert(r.peer);
  std::string out;
  for (int p : peers) out += (out.empty() ? "" : ", ") + std::to_string(p);
  return out;
}

void NodePeers::copy(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) {
  for (size_t k = 0; k < rows; ++k)
    std::memcpy(static_cast<std::byte*>(dst) + k * dst_pitch, static_cast<const std::byte*>(src) + k * src_pitch,
                width);
}

std::shared_ptr<std::byte> NodePeers::scratch(size_t bytes) {
  return std::shared_ptr<std::byte>(new std::byte[bytes], std::default_delete<std::byte[]>());
}

std::unique_ptr<NodePeers> make_node_peers(Comm& node_comm, const plan::Topology& topology, int rank,
                                           SymmetricBuffer& progress, SymmetricBuffer& storages,
                                           std::vector<size_t> storage_offsets, std::chrono::milliseconds timeout) {
  return std::make_unique<SymmetricNodePeers>(node_comm, topology, rank, progress, storages,
                                              std::move(storage_offsets), timeout);
}

}  // namespace tide
