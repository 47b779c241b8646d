// A 32-bit counter in memory that several processes map, which one process posts and others
// wait on: values only grow and compare cyclically ("at least"), so it is never reset. A
// waiter sleeps in FUTEX_WAIT on the word (shared, not FUTEX_PRIVATE: the poster is another
// process); post() only makes the wake syscall when someone sleeps. Used by the host
// transport's flags and by the node peers' progress words.
#pragma once
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

namespace tide {

inline bool counter_reached(uint32_t cur, uint32_t target) { return static_cast<int32_t>(cur - target) >= 0; }

struct SharedCounter {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> waiters;  // sleepers in FUTEX_WAIT

  bool reached(uint32_t target) const { return counter_reached(value.load(std::memory_order_acquire), target); }
  // Spins (pause, the clock read every 32 rounds) until reached(target) or `spin` passes, the
  // waiter's step before sleep(): host_spin says how long; returns reached(target).
  bool spin(uint32_t target, std::chrono::microseconds spin) const {
    const auto until = std::chrono::steady_clock::now() + spin;
    for (int i = 1;; ++i) {
      _mm_pause();
      if (reached(target)) return true;
      if ((i & 31) == 0 && std::chrono::steady_clock::now() >= until) return false;
    }
  }
  void post(uint32_t v) {
    value.store(v, std::memory_order_seq_cst);
    if (waiters.load(std::memory_order_seq_cst) != 0) futex(FUTEX_WAKE, INT_MAX, nullptr);
  }
  // Sleeps until posted or `nap` passes (or a spurious wake-up); returns reached(target).
  bool sleep(uint32_t target, const timespec& nap) {
    waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t cur = value.load(std::memory_order_seq_cst);
    if (!counter_reached(cur, target)) futex(FUTEX_WAIT, cur, &nap);
    waiters.fetch_sub(1, std::memory_order_seq_cst);
    return reached(target);
  }

 private:
  long futex(int op, uint32_t val, const timespec* ts) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&value), op, val, ts, nullptr, 0);
  }
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);

}  // namespace tide
