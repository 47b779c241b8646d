// Test doubles for stream-ordered executors on host threads (one thread per rank): a
// Stream runs enqueued work later, in order, as a CUDA stream does; a mailbox engine moves
// messages between ranks of different nodes; StreamEngine orders an engine on a Stream.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tide/engine.hpp"
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::test {

// A rank's queue of work run by a thread of its own, in the order enqueued. Nothing runs
// before start() or synchronize() (a stream that is slow to start), so an executor, which
// only enqueues, fails the test if it reads on the host what an enqueued move has not
// produced yet, or frees a buffer that queued work still uses.
class Stream {
 public:
  Stream() : thread_([this] { loop(); }) {}
  ~Stream() {
    start();
    enqueue({});
    thread_.join();
  }
  void enqueue(std::function<void()> f) {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(f));
    cv_.notify_all();
  }
  void start() {  // runs from now on (streams that wait on each other start together)
    std::lock_guard lock(mu_);
    running_ = true;
    cv_.notify_all();
  }
  std::string synchronize() {  // runs the queue out; the first error of the work so far
    std::unique_lock lock(mu_);
    running_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    running_ = false;
    return error_;
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return running_ && !queue_.empty(); });
        f = std::move(queue_.front());
        queue_.pop_front();
        if (!f) return;
        busy_ = true;
      }
      try {
        if (error_.empty()) f();
      } catch (const std::exception& e) {
        error_ = e.what();
      }
      std::lock_guard lock(mu_);
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false, running_ = false;
  std::string error_;
  std::thread thread_;
};

// Messages between ranks on different nodes, by (from, to) in the order sent.
struct Mailboxes {
  explicit Mailboxes(plan::Topology t) : topo(t) {}
  const plan::Topology topo;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<int, int>, std::deque<std::vector<std::byte>>> mail;
  int64_t bytes = 0;
};

class MailEngine : public Engine {
 public:
  MailEngine(Mailboxes& m, int rank) : m_(m), me_(rank) {}
  const char* name() const override { return "test mailbox"; }
  void start(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs,
             std::shared_ptr<const void>) override {
    std::unique_lock lock(m_.mu);
    for (const EngineSend& s : sends) {
      TIDE_CHECK(m_.topo.node_of(s.peer) != m_.topo.node_of(me_), "engine message within a node");
      const auto* p = static_cast<const std::byte*>(s.data);
      m_.mail[{me_, s.peer}].emplace_back(p, p + s.bytes);
      m_.bytes += static_cast<int64_t>(s.bytes);
    }
    m_.cv.notify_all();
    pending_.emplace_back(recvs.begin(), recvs.end());
  }
  void finish() override {
    std::unique_lock lock(m_.mu);
    const std::vector<EngineRecv> recvs = std::move(pending_.front());
    pending_.pop_front();
    for (const EngineRecv& r : recvs) {
      auto& box = m_.mail[{r.peer, me_}];
      if (!m_.cv.wait_for(lock, std::chrono::seconds(60), [&] { return !box.empty(); }))
        throw TimeoutError(detail::concat("rank ", me_, " waited 60 s for a message from rank ", r.peer));
      TIDE_CHECK(box.front().size() == r.bytes, "message of ", box.front().size(), " bytes, receive of ", r.bytes);
      std::memcpy(r.data, box.front().data(), r.bytes);
      box.pop_front();
    }
  }

 private:
  Mailboxes& m_;
  int me_;
  std::deque<std::vector<EngineRecv>> pending_;  // per start(), oldest first
};

// An engine whose exchanges start and finish in a Stream's order, keeping their buffers
// until they finished there (as an engine ordered on a CUDA stream).
class StreamEngine : public Engine {
 public:
  StreamEngine(Engine& inner, Stream& s) : inner_(inner), s_(s) {}
  const char* name() const override { return "test mailbox on a stream"; }
  void start(std::span<const EngineSend> sends, std::span<const EngineRecv> recvs,
             std::shared_ptr<const void> keep_alive) override {
    s_.enqueue([this, sends = std::vector<EngineSend>(sends.begin(), sends.end()),
                recvs = std::vector<EngineRecv>(recvs.begin(), recvs.end()), keep_alive] {
      inner_.start(sends, recvs);
      held_.push_back(keep_alive);  // until the exchange finished, in queue order
    });
  }
  void finish() override {
    s_.enqueue([this] {
      inner_.finish();
      held_.pop_front();
    });
  }

 private:
  Engine& inner_;
  Stream& s_;
  std::deque<std::shared_ptr<const void>> held_;  // touched by the queue's thread only
};

}  // namespace tide::test
