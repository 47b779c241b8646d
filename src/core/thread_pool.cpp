#include "tide/thread_pool.hpp"

#include <atomic>

namespace tide {

// One job per run(); workers hold it by shared_ptr so a late one never sees the next job's
// state half-written.
struct ThreadPool::Job {
  std::function<void(size_t)> fn;
  size_t n = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> pending{0};
};

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work(Job& job) {
  for (;;) {
    size_t i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job.n) return;
    job.fn(i);
    job.pending.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::worker() {
  uint64_t seen = 0;
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    if (!job) continue;  // woke after run() already finished that job
    work(*job);
    if (job->pending.load(std::memory_order_acquire) == 0) {
      std::lock_guard<std::mutex> lk(mu_);
      done_.notify_all();
    }
  }
}

void ThreadPool::run(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->n = n;
  job->pending.store(n);
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = job;
    ++generation_;
  }
  wake_.notify_all();
  work(*job);
  std::unique_lock<std::mutex> lk(mu_);
  done_.wait(lk, [&] { return job->pending.load(std::memory_order_acquire) == 0; });
  job_.reset();
}

}  // namespace tide
