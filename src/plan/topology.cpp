// The nodes of a group. torchrun numbers ranks node by node, LOCAL_WORLD_SIZE per node; a
// tide group checks that the hosts agree with that numbering, so that no transport ever
// treats ranks of two hosts as one node.
#include <set>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::plan {

Topology topology_from_hosts(const std::vector<std::string>& hosts) {
  const int ws = static_cast<int>(hosts.size());
  TIDE_CHECK(ws >= 1, "tide topology: no ranks");
  std::set<std::string> seen{hosts[0]};  // a host's ranks are one block of consecutive ranks
  for (int r = 1; r < ws; ++r)
    TIDE_CHECK(hosts[r] == hosts[r - 1] || seen.insert(hosts[r]).second, "tide topology: host '", hosts[r],
               "' holds rank ", r, " and ranks before ", r - 1, " (on '", hosts[r - 1],
               "'); the ranks of a host must be consecutive, as torchrun numbers them");
  int local = 1;  // one node per host: rank 0's host's ranks
  while (local < ws && hosts[local] == hosts[0]) ++local;
  TIDE_CHECK(ws % local == 0, "tide topology: ", ws, " ranks do not split into nodes of ", local,
             " ranks (the ranks on rank 0's host)");
  const Topology t{ws, local, ws / local};
  for (int node = 0; node < t.num_nodes; ++node) {
    const int first = t.rank_of(node, 0), last = t.rank_of(node, local - 1);
    TIDE_CHECK(hosts[first] == hosts[last], "tide topology: node ", node, " (ranks ", first, "..", last,
               ") would span hosts '", hosts[first], "' and '", hosts[last],
               "': every host must hold the same number of ranks, ", local);
    if (node + 1 < t.num_nodes)
      TIDE_CHECK(hosts[last + 1] != hosts[first], "tide topology: host '", hosts[first], "' holds ranks ", first,
                 "..", last + 1, ", more than rank 0's host (", local, "): every host must hold the same number");
  }
  return t;
}

}  // namespace tide::plan
