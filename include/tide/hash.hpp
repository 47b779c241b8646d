// FNV-1a, the hash ranks use to agree on a call's arguments without sending them whole.
#pragma once
#include <cstdint>

namespace tide {

inline constexpr uint64_t kFnvBasis = 1469598103934665603ull;

// `h` with the 8 bytes of `v` mixed in (start from kFnvBasis).
inline uint64_t fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

}  // namespace tide
