// TIDE-AG by paced recursive doubling: the inter-node algorithm (plan::allgather_schedule),
// executed by the host transport so that it runs, with real ranks and real bytes, where no
// network exists (TIDE_HOST_ALLGATHER=doubling). Across nodes the wire is RDMA; here it is
// the sender's staging slot:
//   before step 0: this rank's own shard goes to its placement in its own storages (the
//                  mixed-precision cast happens here, once);
//   step k, round m (every rank, in lockstep): the blocks this rank holds for its peer
//                  me + 2^k (at most pace bytes) are packed from where they sit in its
//                  storages into its slot; the peer me - 2^k's packed blocks are unpacked
//                  from that peer's slot to their placement in this rank's storages, from
//                  where the next step forwards them.
// Every (owner, param) block reaches every rank exactly once in ceil(log2(ws)) steps. RDMA
// would move each block once per hop; through staging it is copied twice (pack, unpack).
// Peers never read this rank's shards or storages, only its slots (Ctx's done protocol).
#include <algorithm>
#include <vector>

#include "algorithms.hpp"
#include "tide/error.hpp"

namespace tide::algo {

void param_all_gather_doubling(Ctx& c, const ParamAllGather& a, size_t pace_bytes) {
  Transport& t = c.t;
  const int me = c.rank(), ws = c.ws();
  const plan::GroupLayout& layout = *a.layout;
  const size_t es = dtype_size(a.storage_dtype);
  auto storage = [&](int p) { return bytes_of(a.storages[static_cast<size_t>(p)]); };

  // Own shard, cast, to its placement.
  std::vector<StridedCopy> ops;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const plan::Shard& s = layout.params[p].shards[me];
    if (s.numel == 0) continue;
    const plan::Strided& pl = s.placement;
    ops.push_back({bytes_of(a.storages[p]) + static_cast<size_t>(pl.offset) * es, a.shards->local() + a.shard_offsets[p],
                   static_cast<size_t>(pl.run), static_cast<size_t>(pl.count), static_cast<size_t>(pl.stride),
                   static_cast<size_t>(pl.run)});
  }
  t.convert(ops, a.storage_dtype, a.shard_dtype);
  if (ws == 1) return;

  const size_t pace = std::min(pace_bytes ? pace_bytes : t.slot_bytes(), t.slot_bytes());
  const plan::AllGatherSchedule schedule =
      plan::allgather_schedule(layout, plan::planner_pace(layout, static_cast<int64_t>(pace), static_cast<int64_t>(es)));

  for (const plan::Step& step : schedule.steps) {
    const int from = ((me - step.distance) % ws + ws) % ws;
    for (const plan::Round& round : step.rounds) {
      const int idx = c.begin_step();
      // Pack: my blocks for me + distance, in schedule order.
      ops.clear();
      size_t at = 0;
      bool receive = false;
      for (const plan::Transfer& tr : round.transfers) {
        receive = receive || tr.dst_rank == me;
        if (tr.src_rank != me) continue;
        for (const plan::Strided& pat : tr.storage) {
          ops.push_back({t.local(idx) + at, storage(tr.param) + static_cast<size_t>(pat.offset) * es,
                         static_cast<size_t>(pat.run), static_cast<size_t>(pat.count), static_cast<size_t>(pat.run),
                         static_cast<size_t>(pat.stride)});
          at += static_cast<size_t>(pat.numel()) * es;
        }
      }
      TIDE_CHECK(at <= t.slot_bytes(), "tide param_all_gather: rank ", me, ": a doubling round of ", at,
                 " bytes exceeds the ", t.slot_bytes(), "-byte slot");
      t.convert(ops, a.storage_dtype, a.storage_dtype);
      t.post(Flag::ready(), c.step);
      // Unpack: from's blocks for me, in the same order, to their placement.
      if (receive) {
        t.wait(from, Flag::ready(), c.step);
        ops.clear();
        at = 0;
        for (const plan::Transfer& tr : round.transfers) {
          if (tr.dst_rank != me) continue;
          for (const plan::Strided& pat : tr.storage) {
            ops.push_back({storage(tr.param) + static_cast<size_t>(pat.offset) * es, t.peer(from, idx) + at,
                           static_cast<size_t>(pat.run), static_cast<size_t>(pat.count),
                           static_cast<size_t>(pat.stride), static_cast<size_t>(pat.run)});
            at += static_cast<size_t>(pat.numel()) * es;
          }
        }
        t.convert(ops, a.storage_dtype, a.storage_dtype);
      }
      c.end_step();
    }
  }
}

}  // namespace tide::algo
