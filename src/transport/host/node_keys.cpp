// Which node each rank of a group is on: the host identity, or a pseudo-node of it.
#include <unistd.h>

#include <cstdio>

#include "../../core/env.hpp"
#include "tide/error.hpp"
#include "tide/host_transport.hpp"

namespace tide {

std::string host_identity() {
  if (std::string id = env::get_string("TIDE_HOST_ID", ""); !id.empty()) return id;
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "re")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f)) boot = buf;
    std::fclose(f);
    boot.erase(boot.find_last_not_of(" \n") + 1);
  }
  return detail::concat(name, '/', boot);
}

NodeKeys exchange_node_keys(Store& store, const std::string& ns, int rank, int world_size,
                            std::chrono::milliseconds timeout, int job_rank) {
  std::string key = host_identity();
  if (const int64_t local = env::get_int("TIDE_LOCAL_WORLD_SIZE", 0); local > 0)
    key += detail::concat("#pseudo-node", (job_rank >= 0 ? job_rank : rank) / local);
  const std::string record = detail::concat(::getpid(), ' ', key);  // "<pid> <key>"
  store.set(ns + "/tide/node/" + std::to_string(rank), std::vector<uint8_t>(record.begin(), record.end()));
  NodeKeys out;
  for (auto& v : await_ranks(store, ns + "/tide/node/", world_size, ns + "/tide/host/failed", timeout,
                             detail::concat("tide node discovery: rank ", rank, " of group '", ns, "'"))) {
    const std::string r(v.begin(), v.end());
    const size_t space = r.find(' ');
    TIDE_CHECK(space != std::string::npos, "tide node discovery: a malformed record '", r, "'");
    out.pids.push_back(std::stoi(r.substr(0, space)));
    out.keys.push_back(r.substr(space + 1));
  }
  return out;
}

}  // namespace tide
