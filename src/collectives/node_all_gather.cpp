// TIDE-AG across nodes (plan::node_allgather_schedule): the paced recursive doubling over
// the nodes on this rank's rail, through the engine, and node-local copies of the other
// rails' blocks from the node's peers. Every block lands at its placement and is forwarded
// from there; each inter-node hop moves a block once (contiguous blocks go straight from
// the sender's storage into the receiver's).
#include <algorithm>
#include <deque>
#include <memory>
#include <vector>

#include "../core/convert.hpp"
#include "../core/env.hpp"
#include "tide/dtype.hpp"
#include "tide/engine.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

bool contiguous(const plan::Strided& p) { return p.count <= 1 || p.run == p.stride; }

// Copies block `pat` (elements of es bytes) to dst from src through the node's memory moves,
// each side either where the block lies in a storage (placed) or packed from the start of a
// buffer: one 2D copy of `count` rows of `run` elements.
enum class At { placed, packed };
void copy_block(NodePeers& peers, std::byte* dst, At dst_at, const std::byte* src, At src_at,
                const plan::Strided& pat, size_t es) {
  if (pat.count <= 0 || pat.run <= 0) return;
  const size_t width = static_cast<size_t>(pat.run) * es;
  auto start = [&](At where) { return where == At::placed ? static_cast<size_t>(pat.offset) * es : size_t{0}; };
  auto pitch = [&](At where) {
    return where == At::placed && pat.count > 1 ? static_cast<size_t>(pat.stride) * es : width;
  };
  peers.copy(dst + start(dst_at), pitch(dst_at), src + start(src_at), pitch(src_at), width,
             static_cast<size_t>(pat.count));
}

}  // namespace

namespace {
uint64_t run_node_all_gather(const NodeAllGather& a, Engine& engine, NodePeers& peers);
}

uint64_t node_param_all_gather(const NodeAllGather& a, Engine& engine, NodePeers& peers) {
  try {
    return run_node_all_gather(a, engine, peers);
  } catch (const TimeoutError& e) {  // a peer failed: say in which collective
    engine.abandon();                  // rounds may be in flight
    throw TimeoutError(detail::concat("tide param_all_gather across nodes: rank ", a.rank, ": ", e.what()));
  } catch (...) {
    engine.abandon();
    throw;
  }
}

namespace {
uint64_t run_node_all_gather(const NodeAllGather& a, Engine& engine, NodePeers& peers) {
  const plan::NodeAllGatherSchedule& s = *a.schedule;
  const plan::Topology& topo = s.topology;
  const int me = a.rank;
  const size_t es = a.storage_elem_size;
  TIDE_CHECK(a.storages.size() == a.layout->params.size(), "tide param_all_gather: rank ", me, ": ",
             a.storages.size(), " storages for ", a.layout->params.size(), " parameters");
  auto mine = [&](int param) { return static_cast<std::byte*>(a.storages[static_cast<size_t>(param)]); };

  // Progress: base + 1 once the own shard is in place, base + 2 + k after inter-node step k
  // (never the words' initial 0). A node-local copy runs once its source has published the
  // step after which it holds the block.
  auto reached = [&](int after_step) { return a.progress_base + static_cast<uint64_t>(after_step + 2); };
  // This rank's node-local copies, by the inter-node step after which their source has them.
  std::vector<std::vector<const plan::NodeLocalCopy*>> copies_after(s.inter_node.steps.size() + 1);
  for (const plan::NodeLocalCopy& c : s.node_local)
    if (c.block.dst_rank == me) copies_after[static_cast<size_t>(c.after_step + 1)].push_back(&c);
  auto local_copies = [&](int after_step) {
    for (const plan::NodeLocalCopy* c : copies_after[static_cast<size_t>(after_step + 1)]) {
      peers.await(c->block.src_rank, reached(after_step));
      const std::byte* src = peers.storage(c->block.src_rank, c->block.param);
      for (const plan::Strided& pat : c->block.storage)
        copy_block(peers, mine(c->block.param), At::placed, src, At::placed, pat, es);
    }
  };

  // A round's exchange as posted: strided blocks are sent from / received into packed
  // buffers (the node's scratch: device memory on CUDA), kept alive by the engine past a
  // failure, and unpacked once the round is finished.
  struct Unpack {
    std::byte* storage;
    plan::Strided pat;
    const std::byte* from;
  };
  struct Posted {
    std::shared_ptr<std::vector<std::shared_ptr<std::byte>>> packed;  // unpacked from after finish()
    std::vector<Unpack> unpacks;
  };
  std::vector<EngineSend> sends;
  std::vector<EngineRecv> recvs;
  auto start_round = [&](const plan::Round& round) {
    Posted posted;
    sends.clear();
    recvs.clear();
    posted.packed = std::make_shared<std::vector<std::shared_ptr<std::byte>>>();
    auto& packed = posted.packed;
    for (const plan::Transfer& tr : round.transfers) {
      if (tr.src_rank != me && tr.dst_rank != me) continue;
      const bool sending = tr.src_rank == me;
      const int peer = sending ? tr.dst_rank : tr.src_rank;
      TIDE_CHECK(topo.node_of(peer) != topo.node_of(me), "tide param_all_gather: rank ", me,
                 ": an inter-node transfer to rank ", peer, " on its own node");
      // Rounds run beside the node-local copies of the step before: what goes out must have
      // come along this rank's rail (own shard or an earlier round), never from a node peer.
      TIDE_CHECK(topo.local_rank(tr.owner_rank) == topo.local_rank(me), "tide param_all_gather: rank ", me,
                 ": the schedule forwards rank ", tr.owner_rank, "'s block, which is not on its rail");
      for (const plan::Strided& pat : tr.storage) {
        if (pat.numel() == 0) continue;  // on both sides: the same schedule
        const size_t bytes = static_cast<size_t>(pat.numel()) * es;
        std::byte* base = mine(tr.param);
        if (contiguous(pat)) {
          std::byte* at = base + static_cast<size_t>(pat.offset) * es;
          // Where it lies on both ranks: at the same offset of their storages (and of the
          // symmetric pool, where the storages are homed there).
          if (sending)
            sends.push_back({peer, at, bytes, a.symmetric_storages});
          else
            recvs.push_back({peer, at, bytes, a.symmetric_storages});
          continue;
        }
        std::byte* buf = packed->emplace_back(peers.scratch(bytes)).get();
        if (sending) {
          copy_block(peers, buf, At::packed, base, At::placed, pat, es);
          sends.push_back({peer, buf, bytes});
        } else {
          recvs.push_back({peer, buf, bytes});
          posted.unpacks.push_back({base, pat, buf});
        }
      }
    }
    engine.start(sends, recvs, packed);
    return posted;
  };
  auto finish_round = [&](const Posted& posted) {
    engine.finish();
    for (const Unpack& u : posted.unpacks) copy_block(peers, u.storage, At::placed, u.from, At::packed, u.pat, es);
  };

  // Step k's first round goes out before the node-local copies of what the node's peers hold
  // after step k - 1, so those copies run while it is on the wire; then two rounds in flight
  // (at most 2 x pace bytes per rank), each unpacked as it finishes.
  peers.publish(reached(-1));  // own shard in place
  const int steps = static_cast<int>(s.inter_node.steps.size());
  for (int k = 0; k < steps; ++k) {
    const std::vector<plan::Round>& rounds = s.inter_node.steps[static_cast<size_t>(k)].rounds;
    std::deque<Posted> in_flight;
    if (!rounds.empty()) in_flight.push_back(start_round(rounds[0]));
    local_copies(k - 1);
    for (size_t r = 0; r < rounds.size(); ++r) {
      if (r + 1 < rounds.size()) in_flight.push_back(start_round(rounds[r + 1]));
      finish_round(in_flight.front());
      in_flight.pop_front();
    }
    peers.publish(reached(k));
  }
  local_copies(steps - 1);
  peers.barrier();
  return reached(steps - 1);
}
}  // namespace

const plan::NodeAllGatherSchedule& NodeScheduleCache::get(const plan::GroupLayout& layout,
                                                          const plan::Topology& topology, int64_t pace_elems,
                                                          int rank) {
  int64_t numel = 0;
  for (const plan::ParamLayout& p : layout.params) numel += p.numel;
  const Key key{plan::layout_hash(layout), layout.params.size(), numel, topology.world_size, topology.local_size, rank,
                pace_elems};
  auto it = schedules_.find(key);
  if (it == schedules_.end()) {
    plan::NodeAllGatherSchedule all = plan::node_allgather_schedule(layout, topology, pace_elems);
    auto mine = std::make_shared<plan::NodeAllGatherSchedule>();
    mine->topology = all.topology;
    mine->inter_node.world_size = all.inter_node.world_size;
    mine->inter_node.pace_bytes = all.inter_node.pace_bytes;
    for (plan::Step& step : all.inter_node.steps) {  // every step stays: progress counts them
      plan::Step& kept = mine->inter_node.steps.emplace_back();
      kept.distance = step.distance;
      for (plan::Round& round : step.rounds) {
        plan::Round r;
        for (plan::Transfer& tr : round.transfers)
          if (tr.src_rank == rank || tr.dst_rank == rank) r.transfers.push_back(std::move(tr));
        if (!r.transfers.empty()) kept.rounds.push_back(std::move(r));
      }
    }
    for (plan::NodeLocalCopy& c : all.node_local)
      if (c.block.dst_rank == rank) mine->node_local.push_back(std::move(c));
    if (schedules_.size() >= 4096) schedules_.clear();  // far more groups than a model has
    it = schedules_.emplace(key, std::move(mine)).first;
  }
  return *it->second;
}

TwoLevelComm::TwoLevelComm(Comm& node, TwoLevel group)
    : node_(node), group_(group), progress_words_(node.allocate_symmetric(64)) {}

void TwoLevelComm::param_all_gather(const ParamAllGather& a, SymmetricBuffer& home, std::vector<size_t> offsets,
                                    size_t pace_bytes) {
  const plan::Topology& topo = group_.topology;
  const int rank = group_.rank;
  const plan::GroupLayout& layout = *a.layout;
  const size_t es = dtype_size(a.storage_dtype);
  if (pace_bytes == 0) pace_bytes = env::get_bytes("TIDE_ALLGATHER_PACE_BYTES", size_t{4} << 20);
  for (size_t p = 0; p < layout.params.size(); ++p) {  // own shard, cast, to its placement
    const plan::Shard& s = layout.params[p].shards[rank];
    const plan::Strided& pl = s.placement;
    const std::byte* src = a.shards->local() + a.shard_offsets[p];
    auto* dst = static_cast<std::byte*>(a.storages[p]);
    for (int64_t c = 0; c < (s.numel ? pl.count : 0); ++c)
      convert_kernel(dst + static_cast<size_t>(pl.offset + c * pl.stride) * es, a.storage_dtype,
                     src + static_cast<size_t>(c * pl.run) * dtype_size(a.shard_dtype), a.shard_dtype,
                     static_cast<size_t>(pl.run));
  }
  const plan::NodeAllGatherSchedule& schedule = schedules_.get(
      layout, topo, plan::planner_pace(layout, static_cast<int64_t>(pace_bytes), static_cast<int64_t>(es)), rank);
  const std::unique_ptr<NodePeers> peers =
      make_node_peers(node_, topo, rank, *progress_words_, home, std::move(offsets), node_.timeout());
  progress_ = node_param_all_gather({&layout, &schedule, rank, a.storages, es, progress_}, *group_.engine, *peers);
}

StagingReport TwoLevelComm::param_reduce_scatter(ParamReduceScatter args) {
  args.nodes = &group_;
  return node_.param_reduce_scatter(args);
}

}  // namespace tide
