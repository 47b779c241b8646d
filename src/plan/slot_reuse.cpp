// Slot-Reuse: after a group's backward its unsharded parameter storages are dead until the
// next all-gather, so the reduce-scatter staging slots can live there instead of in a
// separate buffer. Slots go first-fit into the vacated regions; what does not fit needs a
// (bounded) fallback buffer.
#include <algorithm>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {
namespace {

int64_t align_up(int64_t x, int64_t alignment) {
  return (x + alignment - 1) / alignment * alignment;
}

}  // namespace

std::vector<Region> storage_regions(const GroupLayout& layout) {
  std::vector<Region> regions;
  for (size_t i = 0; i < layout.params.size(); ++i)
    regions.push_back({static_cast<int64_t>(i), 0, layout.params[i].storage_bytes()});
  return regions;
}

SlotReuse assign_staging_slots(std::vector<Region> vacated, int64_t slot_bytes, int num_slots,
                               int64_t alignment) {
  TIDE_CHECK(slot_bytes >= 0 && num_slots >= 0 && alignment >= 1,
             "assign_staging_slots: bad request: ", num_slots, " slots of ", slot_bytes,
             " bytes at alignment ", alignment);
  std::sort(vacated.begin(), vacated.end(), [](const Region& a, const Region& b) {
    return a.base_id != b.base_id ? a.base_id < b.base_id : a.offset < b.offset;
  });
  for (size_t i = 0; i < vacated.size(); ++i) {
    const Region& r = vacated[i];
    TIDE_CHECK(r.offset >= 0 && r.bytes >= 0, "assign_staging_slots: region of buffer ", r.base_id,
               " has offset ", r.offset, " and size ", r.bytes);
    TIDE_CHECK(i == 0 || vacated[i - 1].base_id != r.base_id ||
                   vacated[i - 1].offset + vacated[i - 1].bytes <= r.offset,
               "assign_staging_slots: vacated regions of buffer ", r.base_id,
               " overlap at byte offset ", r.offset);
  }

  SlotReuse out;
  std::vector<int64_t> next_free(vacated.size());  // first unused byte of each region
  for (size_t i = 0; i < vacated.size(); ++i) next_free[i] = vacated[i].offset;
  for (int slot = 0; slot < num_slots; ++slot) {
    SlotHome home;
    for (size_t i = 0; i < vacated.size() && !home.reused; ++i) {
      const int64_t start = align_up(next_free[i], alignment);
      if (start + slot_bytes > vacated[i].offset + vacated[i].bytes) continue;
      home = {true, vacated[i].base_id, start};
      next_free[i] = start + slot_bytes;
    }
    if (!home.reused) {
      home.offset = out.fallback_bytes;
      out.fallback_bytes += align_up(slot_bytes, alignment);
    }
    out.slots.push_back(home);
  }
  return out;
}

}  // namespace tide::plan
