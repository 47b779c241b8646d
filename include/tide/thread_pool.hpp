// A small fixed pool for the host copy and reduce engines. The calling thread takes part,
// so a pool of size 1 has no workers and runs everything inline. Idle workers sleep on a
// condition variable: ranks that wait must not burn the cores their peers need.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tide {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(i) for every i in [0, n) and returns when all have finished.
  void run(size_t n, const std::function<void(size_t)>& fn);

 private:
  struct Job;
  void worker();
  static void work(Job& job);

  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::shared_ptr<Job> job_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace tide
