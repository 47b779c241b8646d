// The peers of a node as the two-level collectives see them (include/tide/engine.hpp):
// storages and progress words in symmetric memory of the node's host communicator. A
// waiter spins briefly, then sleeps in FUTEX_WAIT on the peer's word (shared, not
// FUTEX_PRIVATE: the waker is another process), woken by publish(): no sleep overshoots a
// peer's progress, which small collectives would pay at every wait.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <thread>

#include "tide/engine.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

// One rank's progress, in its 64-byte part of the progress buffer: the low 32 bits of the
// value (compared cyclically: values only grow) and the number of sleepers to wake.
struct Progress {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> waiters;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);

bool reached(uint32_t cur, uint32_t target) { return static_cast<int32_t>(cur - target) >= 0; }

class SymmetricNodePeers final : public NodePeers {
 public:
  SymmetricNodePeers(Comm& node, const plan::Topology& topo, int rank, SymmetricBuffer& progress,
                     SymmetricBuffer& storages, std::vector<size_t> offsets, std::chrono::milliseconds timeout)
      : node_(node), topo_(topo), me_(rank), progress_(progress), storages_(storages),
        offsets_(std::move(offsets)), timeout_(timeout) {}

  const std::byte* storage(int rank, int param) override {
    return storages_.peer(local(rank)) + offsets_.at(static_cast<size_t>(param));
  }
  void publish(uint64_t value) override {
    Progress& p = word(me_);
    p.value.store(static_cast<uint32_t>(value), std::memory_order_seq_cst);
    if (p.waiters.load(std::memory_order_seq_cst) != 0) futex(&p.value, FUTEX_WAKE, INT_MAX, nullptr);
  }
  void await(int rank, uint64_t value) override {
    Progress& p = word(rank);
    const uint32_t target = static_cast<uint32_t>(value);
    if (reached(p.value.load(std::memory_order_acquire), target)) return;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 2000; ++i) {  // a few microseconds: a peer that is nearly there
      if (reached(p.value.load(std::memory_order_acquire), target)) return;
      std::this_thread::yield();
    }
    const timespec nap{0, 5'000'000};  // between deadline checks
    for (;;) {
      p.waiters.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t cur = p.value.load(std::memory_order_seq_cst);
      if (!reached(cur, target)) futex(&p.value, FUTEX_WAIT, cur, &nap);
      p.waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (reached(p.value.load(std::memory_order_acquire), target)) return;
      if (std::chrono::steady_clock::now() - start >= timeout_)
        throw TimeoutError(detail::concat("tide param_all_gather: rank ", me_, " timed out after ", timeout_.count(),
                                          " ms waiting for rank ", rank, " (same node) to reach step ", value));
    }
  }
  void barrier() override { node_.barrier(); }

 private:
  int local(int rank) const {
    TIDE_CHECK(topo_.node_of(rank) == topo_.node_of(me_), "tide: rank ", me_, " asked for node-local memory of rank ",
               rank, " on another node");
    return topo_.local_rank(rank);
  }
  Progress& word(int rank) { return *reinterpret_cast<Progress*>(progress_.peer(local(rank))); }
  static long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
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
