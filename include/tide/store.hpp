// The rendezvous store a communicator is created with. The torch adapter wraps the
// c10d::Store that init_process_group hands the backend; the core's tests use FileStore.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tide {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists, or throws TimeoutError after `timeout`.
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// A store over a directory of files (one file per key, atomic rename on set): enough for
// processes of one host, and what the C++ tests use.
std::unique_ptr<Store> make_file_store(const std::string& directory);

}  // namespace tide
