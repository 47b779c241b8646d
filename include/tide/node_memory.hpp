// Symmetric memory of a group over several nodes: each node's ranks map each other's parts
// (allocated on the node's communicator, host or CUDA), seen with the group's ranks.
#pragma once
#include <cstddef>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "tide/comm.hpp"
#include "tide/plan.hpp"

namespace tide {

// A node's symmetric memory with group ranks: peer(r) for the ranks of this rank's node only.
class NodeSymmetric final : public SymmetricBuffer {
 public:
  NodeSymmetric(std::shared_ptr<SymmetricBuffer> node_memory, plan::Topology topology, int rank)
      : inner_(std::move(node_memory)), topo_(topology), me_(rank) {}
  std::byte* local() override { return inner_->local(); }
  std::byte* peer(int rank) override { return inner_->peer(local_rank(rank)); }
  size_t bytes(int rank) const override { return inner_->bytes(local_rank(rank)); }
  void release(size_t offset, size_t bytes) override { inner_->release(offset, bytes); }
  int device() const override { return inner_->device(); }
  int rank() const { return me_; }  // in the group
  // The node's own view, by local rank (what the node's collectives index).
  const std::shared_ptr<SymmetricBuffer>& node_memory() const { return inner_; }

 private:
  int local_rank(int rank) const;
  std::shared_ptr<SymmetricBuffer> inner_;
  plan::Topology topo_;
  int me_;
};

// The node-symmetric buffers a group handed out, to find where a set of byte ranges lies:
// TIDE-AG across nodes reads node peers' storages, which must lie in one of them.
class NodeHomes {
 public:
  std::shared_ptr<NodeSymmetric> add(std::shared_ptr<NodeSymmetric> buffer);
  // The node memory all `ranges` (pointer, bytes) lie in, and their offsets there; null
  // when no buffer holds them all.
  std::pair<std::shared_ptr<SymmetricBuffer>, std::vector<size_t>> find(
      std::span<const std::pair<const void*, size_t>> ranges) const;

 private:
  std::vector<std::weak_ptr<NodeSymmetric>> buffers_;
};

}  // namespace tide
