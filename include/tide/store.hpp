// The rendezvous store a communicator is created with. The torch adapter wraps the
// c10d::Store that init_process_group hands the backend; the core's tests use FileStore.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tide {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists, or throws TimeoutError after `timeout` (> 0).
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Whether the key exists, without waiting (and without the warnings some stores print
  // when a wait times out).
  virtual bool check(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// A store over a directory of files (one file per key, atomic rename on set): enough for
// processes of one host, and what the C++ tests use.
std::unique_ptr<Store> make_file_store(const std::string& directory);

// Every rank's value under `prefix + <rank>` (this rank's own included), waited for by
// polling Store::check, never by a blocking wait: a failure some rank publishes under
// `failure_key` ends the wait at once (Error with that message), and a wait past `timeout`
// is a TimeoutError naming the ranks still missing. `who` names the waiter in messages
// ("tide host transport: rank 3 of group 'pg0'"). A wait longer than a few seconds prints
// one line to stderr saying which ranks are awaited; a prompt start prints nothing.
// between_polls(missing), when given, runs between polls and may throw (e.g. a missing
// rank whose process is known to have died).
std::vector<std::vector<uint8_t>> await_ranks(
    Store& store, const std::string& prefix, int world_size, const std::string& failure_key,
    std::chrono::milliseconds timeout, const std::string& who,
    const std::function<void(const std::vector<int>& missing)>& between_polls = {});

}  // namespace tide
