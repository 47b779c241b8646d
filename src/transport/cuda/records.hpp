// Fixed-size records the ranks of a CUDA group publish through the Store, one per rank
// under `key/<rank>` (internal to tide_cuda).
#pragma once
#include <chrono>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "tide/error.hpp"
#include "tide/store.hpp"

namespace tide::cuda {

template <class T>
void put_record(Store& store, const std::string& key, int rank, const T& record) {
  static_assert(std::is_trivially_copyable_v<T>);
  const auto* b = reinterpret_cast<const uint8_t*>(&record);
  store.set(key + "/" + std::to_string(rank), std::vector<uint8_t>(b, b + sizeof record));
}

// Rank `from`'s record (waits up to `timeout`); `rank` names the reader in errors.
template <class T>
T get_record(Store& store, const std::string& key, int from, std::chrono::milliseconds timeout, int rank) {
  static_assert(std::is_trivially_copyable_v<T>);
  const std::vector<uint8_t> v = store.get(key + "/" + std::to_string(from), timeout);
  TIDE_CHECK(v.size() == sizeof(T), "tide: cuda: rank ", rank, ": bad record from rank ", from, " under '", key, "' (",
             v.size(), " bytes, expected ", sizeof(T), ")");
  T record;
  std::memcpy(&record, v.data(), sizeof record);
  return record;
}

}  // namespace tide::cuda
