// Waiting for every rank's store key without blocking inside the store (include/tide/store.hpp).
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <thread>

#include "tide/error.hpp"
#include "tide/store.hpp"

namespace tide {
namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << ']';
  return os.str();
}

}  // namespace

std::vector<std::vector<uint8_t>> await_ranks(
    Store& store, const std::string& prefix, int world_size, const std::string& failure_key,
    std::chrono::milliseconds timeout, const std::string& who,
    const std::function<void(const std::vector<int>& missing)>& between_polls) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  // Late enough that a busy machine's ordinary start says nothing, early enough to explain a
  // long wait well before the timeout.
  const auto announce_at = start + std::min<std::chrono::milliseconds>(std::chrono::seconds(10), timeout / 4);
  bool announced = false;
  std::vector<std::vector<uint8_t>> values(world_size);
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) missing.push_back(r);
  auto nap = std::chrono::microseconds(200);
  for (;;) {
    std::vector<int> still;
    for (int r : missing) {
      const std::string key = prefix + std::to_string(r);
      if (store.check(key)) values[r] = store.get(key, timeout);
      else still.push_back(r);
    }
    missing.swap(still);
    if (missing.empty()) return values;
    if (!failure_key.empty() && store.check(failure_key)) {
      const std::vector<uint8_t> why = store.get(failure_key, timeout);
      throw TimeoutError(detail::concat(who, " gives up waiting for ranks ", rank_list(missing),
                                        ": another rank failed: ", std::string(why.begin(), why.end())));
    }
    if (between_polls) between_polls(missing);
    const auto now = Clock::now();
    if (now >= deadline)
      throw TimeoutError(detail::concat(who, " timed out after ", timeout.count(), " ms waiting for ranks ",
                                        rank_list(missing), " to join"));
    if (!announced && now >= announce_at) {
      announced = true;
      std::fprintf(stderr, "%s waits for ranks %s to join (timeout %lld s)\n", who.c_str(),
                   rank_list(missing).c_str(), static_cast<long long>(timeout.count() / 1000));
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(20000));
  }
}

}  // namespace tide
