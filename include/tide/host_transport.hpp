// The host transport: ranks of one host over shared memory (one segment per rank, mapped
// by every peer). Segments are memfds without a name, handed to the peers over the
// FdChannel, so nothing outlives the processes, and /dev/shm's size does not limit them.
//
// Environment (CommOptions fields win where they are set):
//   TIDE_SHM_STAGING_BYTES  staging per rank, default 16M (K/M/G suffixes); ranks must agree
//   TIDE_SHM_SLOT_BYTES     pipeline slot size, default min(staging/2, 2M); ranks must agree
//   TIDE_NUM_THREADS        copy/reduce threads per rank, default hardware threads / ranks,
//                           at most 8; 1 = the calling thread only
//   TIDE_CMA                1 lets all_gather read peers' inputs directly (process_vm_readv)
//                           when a probe at creation shows it works; default 0 (staging)
//   TIDE_HOST_ALLGATHER     param_all_gather: direct (default) or doubling (the inter-node
//                           paced recursive doubling, through staging); ranks must agree
//   TIDE_ALLGATHER_PACE_BYTES  bytes per rank and doubling round, default one slot
//   TIDE_HOST_ID            which host this process is on (ranks must share it); default
//                           hostname/boot id
//   TIDE_LOCAL_WORLD_SIZE   splits a host into pseudo-nodes of this many consecutive ranks
//   TIDE_DEBUG              1 prints the transport, threads, staging and CMA decision
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tide/comm.hpp"
#include "tide/plan.hpp"
#include "tide/store.hpp"
#include "tide/transport.hpp"

namespace tide {

// The memfd labels (shown in /proc/<pid>/maps as "/memfd:tide-host (deleted)").
inline constexpr const char* kSegmentLabel = "tide-host";
inline constexpr const char* kSymmetricLabel = "tide-symmetric";
inline constexpr size_t kDefaultStagingBytes = size_t{16} << 20;

// Which host this process runs on: TIDE_HOST_ID when set (as NCCL_HOSTID), else the
// hostname and the kernel's boot id (containers of one machine share the boot id; two
// machines never do, even under one hostname).
std::string host_identity();

// Every rank's node, exchanged through the store (collective): its host identity, and with
// TIDE_LOCAL_WORLD_SIZE=L also job_rank / L, which splits a host into pseudo-nodes of L
// consecutive ranks of the job (for tests: real ranks, one machine). job_rank is the rank in
// the whole job (torchrun's numbering), so that a sub-group's ranks keep their pseudo-nodes;
// -1: `rank`. Ranks with equal keys share a node.
struct NodeKeys {
  std::vector<std::string> keys;
  std::vector<int> pids;
};
NodeKeys exchange_node_keys(Store& store, const std::string& ns, int rank, int world_size,
                            std::chrono::milliseconds timeout, int job_rank = -1);

// A group's nodes (collective, through the store; job_rank as above): how many, their
// topology where they are equal blocks of consecutive ranks (else why not), every rank's
// pid, and the host communicator of this rank's node (of the whole group on one node; none
// when the topology does not fit).
struct GroupNodes {
  int num_nodes = 1;
  std::optional<plan::Topology> topology;  // several nodes that fit
  std::string topology_error;
  std::unique_ptr<Comm> node_comm;
};
GroupNodes discover_nodes(Store& store, const std::string& ns, int rank, int world_size, CommOptions options,
                          int job_rank = -1);

// How long a rank waiting on a peer's flag (or TIDE-AG's node peers on a progress word)
// spins before it sleeps on the futex: where every process of the host has a core (`busy` =
// the most processes we know of there, `cores` = this process's CPUs), a long spin costs
// nobody anything and saves the wake-up of a sleeping core (tide.bench.step at 1 x 2 on a
// 2-core VM: exposed communication 12.4-12.9 ms a step with 200 us, 13.3-15.2 ms with
// 10 us); where processes share cores, spinning takes a core a peer needs, so a short spin.
// TIDE_HOST_SPIN_US overrides.
std::chrono::microseconds host_spin(int busy, int cores);

std::unique_ptr<Transport> make_host_transport(Store& store, const std::string& ns, int rank,
                                               int world_size, const CommOptions& options);

}  // namespace tide
