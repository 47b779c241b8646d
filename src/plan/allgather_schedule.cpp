// TIDE-AG's paced recursive-doubling all-gather for any world size (Bruck / dissemination
// order): at step k, with distance d = 2^k, rank r holds owners r, r-1, ..., r-d+1 and sends
// them to r + d, which then holds 2d consecutive owners. The last step sends only the
// world_size - d blocks the peer still lacks, so every block arrives exactly once, in
// ceil(log2(world_size)) steps. Blocks travel between parameter storages: a block sits at its
// placement on every rank, so a receiver forwards it from where it landed.
#include <algorithm>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {

// One sender's payload for a step, cut into messages of at most pace_bytes.
std::vector<std::vector<Transfer>> paced_messages(const GroupLayout& layout, int src, int dst,
                                                  int num_blocks, int64_t pace_bytes) {
  const int ws = layout.world_size;
  std::vector<std::vector<Transfer>> messages(1);
  int64_t used = 0;  // bytes in the last message
  for (int j = 0; j < num_blocks; ++j) {
    const int owner = ((src - j) % ws + ws) % ws;
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const ParamLayout& p = layout.params[i];
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
            {src, dst, owner, static_cast<int>(i), pos, end, slice(s.placement, pos, end)});
        used += (end - pos) * p.elem_size;
        pos = end;
      }
    }
  }
  if (messages.back().empty()) messages.pop_back();
  return messages;
}

}  // namespace

AllGatherSchedule allgather_schedule(const GroupLayout& layout, int64_t pace_bytes) {
  TIDE_CHECK(pace_bytes >= 1, "allgather_schedule: pace must be >= 1 byte, got ", pace_bytes);
  for (size_t i = 0; i < layout.params.size(); ++i)
    TIDE_CHECK(layout.params[i].elem_size <= pace_bytes, "allgather_schedule: pace of ", pace_bytes,
               " bytes is smaller than one element (", layout.params[i].elem_size,
               " bytes) of parameter ", i, " (world size ", layout.world_size, ")");
  const int ws = layout.world_size;
  AllGatherSchedule schedule{ws, pace_bytes, {}};
  for (int distance = 1; distance < ws; distance *= 2) {
    Step step{distance, {}};
    const int num_blocks = std::min(distance, ws - distance);
    for (int src = 0; src < ws; ++src) {
      auto messages = paced_messages(layout, src, (src + distance) % ws, num_blocks, pace_bytes);
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

}  // namespace tide::plan
