#include "tide/node_memory.hpp"

#include "tide/error.hpp"

namespace tide {

int NodeSymmetric::local_rank(int rank) const {
  TIDE_CHECK(topo_.node_of(rank) == topo_.node_of(me_), "tide symmetric memory: rank ", me_, " asked for rank ", rank,
             "'s part, which is on another node");
  return topo_.local_rank(rank);
}

std::shared_ptr<NodeSymmetric> NodeHomes::add(std::shared_ptr<NodeSymmetric> buffer) {
  std::erase_if(buffers_, [](const std::weak_ptr<NodeSymmetric>& b) { return b.expired(); });
  buffers_.push_back(buffer);
  return buffer;
}

std::pair<std::shared_ptr<SymmetricBuffer>, std::vector<size_t>> NodeHomes::find(
    std::span<const std::pair<const void*, size_t>> ranges) const {
  for (const auto& weak : buffers_) {
    const std::shared_ptr<NodeSymmetric> buf = weak.lock();
    if (!buf) continue;
    const std::byte* base = buf->local();
    const size_t size = buf->bytes(buf->rank());
    std::vector<size_t> offsets;
    for (const auto& [p, bytes] : ranges) {
      const auto* at = static_cast<const std::byte*>(p);
      if (at < base || at + bytes > base + size) break;
      offsets.push_back(static_cast<size_t>(at - base));
    }
    if (offsets.size() == ranges.size()) return {buf->node_memory(), offsets};
  }
  return {};
}

}  // namespace tide
