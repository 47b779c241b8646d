// Which node each rank of a group is on: the host identity, or a pseudo-node of it.
#include <unistd.h>

#include <algorithm>
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

GroupNodes discover_nodes(Store& store, const std::string& ns, int rank, int world_size, CommOptions options,
                          int job_rank) {
  const NodeKeys nodes = exchange_node_keys(store, ns, rank, world_size, options.timeout, job_rank);
  const std::vector<std::string>& keys = nodes.keys;
  GroupNodes out;
  out.num_nodes = 0;
  for (size_t r = 0; r < keys.size(); ++r)
    if (std::find(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(r), keys[r]) ==
        keys.begin() + static_cast<std::ptrdiff_t>(r))
      ++out.num_nodes;
  // The group's ranks on this host: those whose key is this host's, pseudo-node or not.
  auto host_of = [](const std::string& k) { return k.substr(0, k.rfind("#pseudo-node")); };
  const std::string mine = host_of(keys[static_cast<size_t>(rank)]);
  options.host_ranks = static_cast<int>(
      std::count_if(keys.begin(), keys.end(), [&](const std::string& k) { return host_of(k) == mine; }));
  if (out.num_nodes == 1) {
    options.pids = nodes.pids;
    out.node_comm = make_host_comm(store, ns, rank, world_size, options);
    return out;
  }
  try {
    out.topology = plan::topology_from_hosts(keys);
  } catch (const Error& e) {
    out.topology_error = e.what();
    return out;
  }
  const plan::Topology& t = *out.topology;  // the node's ranks get a host communicator of their own
  const int node = t.node_of(rank), first = t.rank_of(node, 0);
  options.pids.assign(nodes.pids.begin() + first, nodes.pids.begin() + first + t.local_size);
  out.node_comm = make_host_comm(store, ns + "/node" + std::to_string(node), t.local_rank(rank), t.local_size, options);
  return out;
}

}  // namespace tide
