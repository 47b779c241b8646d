// TIDE-AG's paced recursive-doubling all-gather for any world size (Bruck / dissemination
// order): at step k, with distance d = 2^k, rank r holds owners r, r-1, ..., r-d+1 and sends
// them to r + d, which then holds 2d consecutive owners. The last step sends only the
// world_size - d blocks the peer still lacks, so every block arrives exactly once, in
// ceil(log2(world_size)) steps. Blocks travel between parameter storages: a block sits at its
// placement on every rank, so a receiver forwards it from where it landed.
// Across nodes the same doubling runs over the nodes, on every rail at once (the ranks of
// one local rank), and each rank copies the other rails' blocks from its node's peers.
#include <algorithm>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {

// One sender's payload for a step of the doubling over `members` (ranks, in doubling order):
// member i sends to member i + distance the blocks of owners i, i-1, ..., i-num_blocks+1, cut
// into messages of at most pace_bytes.
std::vector<std::vector<Transfer>> paced_messages(const GroupLayout& layout, const std::vector<int>& members,
                                                  int i, int distance, int num_blocks, int64_t pace_bytes) {
  const int n = static_cast<int>(members.size());
  const int src = members[i], dst = members[(i + distance) % n];
  std::vector<std::vector<Transfer>> messages(1);
  int64_t used = 0;  // bytes in the last message
  for (int j = 0; j < num_blocks; ++j) {
    const int owner = members[((i - j) % n + n) % n];
    for (size_t p_i = 0; p_i < layout.params.size(); ++p_i) {
      const ParamLayout& p = layout.params[p_i];
      const Shard& s = p.shards[owner];
      for (int64_t pos = 0; pos < s.numel;) {
        const int64_t fits = (pace_bytes - used) / p.elem_size;
        if (fits == 0) {
          messages.emplace_back();
          used = 0;
          continue;
        }
        const int64_t end = std::min(s.numel, pos + fits);
        messages.back().push_back(
            {src, dst, owner, static_cast<int>(p_i), pos, end, slice(s.placement, pos, end)});
        used += (end - pos) * p.elem_size;
        pos = end;
      }
    }
  }
  if (messages.back().empty()) messages.pop_back();
  return messages;
}

void check_pace(const GroupLayout& layout, int64_t pace_bytes) {
  TIDE_CHECK(pace_bytes >= 1, "allgather_schedule: pace must be >= 1 byte, got ", pace_bytes);
  for (size_t i = 0; i < layout.params.size(); ++i)
    TIDE_CHECK(layout.params[i].elem_size <= pace_bytes, "allgather_schedule: pace of ", pace_bytes,
               " bytes is smaller than one element (", layout.params[i].elem_size,
               " bytes) of parameter ", i, " (world size ", layout.world_size, ")");
}

// The doubling on every group of `groups` at once (all of one size), round by round: a
// round holds at most pace_bytes from each sender.
AllGatherSchedule doubling(const GroupLayout& layout, const std::vector<std::vector<int>>& groups,
                           int64_t pace_bytes) {
  const int n = static_cast<int>(groups.front().size());
  AllGatherSchedule schedule{layout.world_size, pace_bytes, {}};
  for (int distance = 1; distance < n; distance *= 2) {
    Step step{distance, {}};
    const int num_blocks = std::min(distance, n - distance);
    for (const std::vector<int>& members : groups)
      for (int i = 0; i < n; ++i) {
        auto messages = paced_messages(layout, members, i, distance, num_blocks, pace_bytes);
        if (step.rounds.size() < messages.size()) step.rounds.resize(messages.size());
        for (size_t m = 0; m < messages.size(); ++m) {
          auto& round = step.rounds[m].transfers;
          round.insert(round.end(), std::make_move_iterator(messages[m].begin()),
                       std::make_move_iterator(messages[m].end()));
        }
      }
    schedule.steps.push_back(std::move(step));
  }
  return schedule;
}

int floor_log2(int v) {
  int k = 0;
  while ((2 << k) <= v) ++k;
  return k;
}

}  // namespace

int64_t planner_pace(const GroupLayout& layout, int64_t pace_bytes, int64_t storage_elem_size) {
  int64_t widen = 1, widest = 1;
  for (const ParamLayout& p : layout.params) {
    widen = std::max<int64_t>(widen, (storage_elem_size + p.elem_size - 1) / p.elem_size);
    widest = std::max<int64_t>(widest, p.elem_size);
  }
  return std::max<int64_t>(widest, pace_bytes / widen);
}

AllGatherSchedule allgather_schedule(const GroupLayout& layout, int64_t pace_bytes) {
  check_pace(layout, pace_bytes);
  std::vector<int> all(static_cast<size_t>(layout.world_size));
  for (int r = 0; r < layout.world_size; ++r) all[static_cast<size_t>(r)] = r;
  return doubling(layout, {all}, pace_bytes);
}

NodeAllGatherSchedule node_allgather_schedule(const GroupLayout& layout, const Topology& topology,
                                              int64_t pace_bytes) {
  check_pace(layout, pace_bytes);
  const Topology& t = topology;
  TIDE_CHECK(t.world_size == layout.world_size && t.local_size * t.num_nodes == t.world_size,
             "node_allgather_schedule: a topology of ", t.num_nodes, " nodes x ", t.local_size,
             " ranks for a group of ", layout.world_size);
  std::vector<std::vector<int>> rails(static_cast<size_t>(t.local_size));
  for (int l = 0; l < t.local_size; ++l)
    for (int node = 0; node < t.num_nodes; ++node) rails[static_cast<size_t>(l)].push_back(t.rank_of(node, l));
  NodeAllGatherSchedule schedule{t, doubling(layout, rails, pace_bytes), {}};
  // In the doubling, the member `hops` nodes behind a rank on its rail arrives at step
  // floor(log2(hops)); a peer's own shard (hops 0) is there before step 0.
  for (int dst = 0; dst < t.world_size; ++dst) {
    std::vector<NodeLocalCopy> copies;
    for (int l = 0; l < t.local_size; ++l) {
      const int src = t.rank_of(t.node_of(dst), l);
      if (src == dst) continue;
      for (int owner_node = 0; owner_node < t.num_nodes; ++owner_node) {
        const int owner = t.rank_of(owner_node, l);
        const int hops = ((t.node_of(src) - owner_node) % t.num_nodes + t.num_nodes) % t.num_nodes;
        for (size_t p_i = 0; p_i < layout.params.size(); ++p_i) {
          const Shard& s = layout.params[p_i].shards[owner];
          if (s.numel == 0) continue;
          copies.push_back({{src, dst, owner, static_cast<int>(p_i), 0, s.numel, {s.placement}},
                            hops == 0 ? -1 : floor_log2(hops)});
        }
      }
    }
    std::stable_sort(copies.begin(), copies.end(),
                     [](const NodeLocalCopy& a, const NodeLocalCopy& b) { return a.after_step < b.after_step; });
    schedule.node_local.insert(schedule.node_local.end(), copies.begin(), copies.end());
  }
  return schedule;
}

}  // namespace tide::plan
