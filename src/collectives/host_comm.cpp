// The communicator: checks arguments (locally, then across ranks through one small control
// exchange per call), then runs the algorithm over its transport. Any error breaks it and
// raises the transport's abort flag, so peers fail fast instead of waiting out the timeout.
#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "../core/convert.hpp"
#include "../core/env.hpp"
#include "algorithms.hpp"
#include "tide/engine.hpp"
#include "tide/error.hpp"
#include "tide/hash.hpp"
#include "tide/host_transport.hpp"
#include "tide/reduce_kernels.hpp"

namespace tide {
namespace {

enum class Kind : uint8_t { all_gather = 1, reduce_scatter, all_reduce, reduce, broadcast, gather, scatter,
                            all_to_all, barrier, allocate_symmetric, param_all_gather, param_reduce_scatter };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::all_gather: return "all_gather";
    case Kind::reduce_scatter: return "reduce_scatter";
    case Kind::all_reduce: return "all_reduce";
    case Kind::reduce: return "reduce";
    case Kind::broadcast: return "broadcast";
    case Kind::gather: return "gather";
    case Kind::scatter: return "scatter";
    case Kind::all_to_all: return "all_to_all";
    case Kind::barrier: return "barrier";
    case Kind::allocate_symmetric: return "allocate_symmetric";
    case Kind::param_all_gather: return "param_all_gather";
    case Kind::param_reduce_scatter: return "param_reduce_scatter";
  }
  return "?";
}

// What every rank publishes before a collective; all_to_all appends its byte counts.
struct Desc {
  Kind kind{};
  DType dtype{}, out_dtype{};
  ReduceOp op{};
  int32_t root = 0;
  uint64_t count = 0;  // elements, or bytes for the untyped collectives
  uint64_t addr = 0;   // all_gather: this rank's input address (for direct reads); not compared
  // param_*: a hash of the group layout (shapes, element sizes, shard dims, world size) and
  // of the other arguments that must agree (offsets, op factor, Slot-Reuse regions).
  uint64_t hash = 0, aux = 0;
  int32_t layout_ws = 0;  // param_*: the layout's world size
};

static_assert(sizeof(Desc) <= 64, "the control record holds 64 + 16 * world_size bytes");

std::string describe(const Desc& d, std::span<const uint64_t> a2a = {}) {
  std::ostringstream os;
  switch (d.kind) {
    case Kind::all_gather: os << "count=" << d.count << " dtype=" << dtype_name(d.dtype); break;
    case Kind::reduce_scatter:
      os << "count=" << d.count << " dtype=" << dtype_name(d.dtype);
      if (d.out_dtype != d.dtype) os << "->" << dtype_name(d.out_dtype);
      os << " op=" << reduce_op_name(d.op);
      break;
    case Kind::all_reduce: os << "count=" << d.count << " dtype=" << dtype_name(d.dtype) << " op=" << reduce_op_name(d.op); break;
    case Kind::reduce:
      os << "count=" << d.count << " dtype=" << dtype_name(d.dtype) << " op=" << reduce_op_name(d.op) << " root=" << d.root;
      break;
    case Kind::broadcast: case Kind::gather: case Kind::scatter: os << "bytes=" << d.count << " root=" << d.root; break;
    case Kind::all_to_all: {
      const size_t ws = a2a.size() / 2;
      os << "send_bytes=[";
      for (size_t i = 0; i < ws; ++i) os << (i ? "," : "") << a2a[i];
      os << "] recv_bytes=[";
      for (size_t i = 0; i < ws; ++i) os << (i ? "," : "") << a2a[ws + i];
      os << "]";
      break;
    }
    case Kind::barrier: case Kind::allocate_symmetric: break;
    case Kind::param_all_gather: case Kind::param_reduce_scatter:
      os << "params=" << d.root << " numel=" << d.count << " layout_world_size=" << d.layout_ws << " dtype="
         << dtype_name(d.dtype) << "->" << dtype_name(d.out_dtype);
      if (d.kind == Kind::param_reduce_scatter) os << " op=" << reduce_op_name(d.op);
      os << " layout_hash=" << std::hex << d.hash << " args_hash=" << d.aux << std::dec;
      break;
  }
  return os.str();
}

bool same(const Desc& a, const Desc& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.out_dtype == b.out_dtype && a.op == b.op &&
         a.root == b.root && a.count == b.count && a.hash == b.hash && a.aux == b.aux && a.layout_ws == b.layout_ws;
}

class HostComm final : public Comm {
 public:
  HostComm(std::unique_ptr<Transport> t, bool doubling, size_t pace)
      : t_(std::move(t)), ctx_(*t_), rank_(t_->rank()), ws_(t_->world_size()), doubling_(doubling),
        pace_(pace ? std::min(pace, t_->slot_bytes()) : t_->slot_bytes()) {  // same value, same hash
    record_ = sizeof(Desc) + 16 * static_cast<size_t>(ws_);
  }

  int rank() const override { return rank_; }
  const char* param_all_gather_algorithm() const override { return doubling_ ? "doubling" : "direct"; }
  int world_size() const override { return ws_; }
  std::chrono::microseconds wait_spin() const override { return t_->wait_spin(); }
  std::chrono::milliseconds timeout() const override { return t_->timeout(); }
  void set_timeout(std::chrono::milliseconds timeout) override { t_->set_timeout(timeout); }
  void abort(const std::string& why) override { t_->abort(why); }

  void all_gather(const void* in, std::span<void* const> outs, size_t count, DType dtype) override {
    const size_t bytes = count * dtype_size(dtype);
    const bool direct = t_->can_get() && bytes >= algo::kDirectMinBytes;
    Desc d{Kind::all_gather, dtype, dtype, ReduceOp::sum, 0, count, reinterpret_cast<uint64_t>(in)};
    run(d, [&] {
      check_outs("all_gather", outs, bytes);
      check_ptr("all_gather", in, count, "in");
    }, [&] {
      std::vector<uint64_t> inputs;
      if (direct)
        for (auto& r : descs_) inputs.push_back(r.addr);
      algo::all_gather(ctx_, in, outs, bytes, inputs);
    });
  }

  void reduce_scatter(std::span<const void* const> ins, void* out, size_t count, DType in_dtype, DType out_dtype,
                      ReduceArgs op) override {
    Desc d{Kind::reduce_scatter, in_dtype, out_dtype, op.op, 0, count};
    run(d, [&] {
      check_reduce("reduce_scatter", rank_, in_dtype, out_dtype, op.op);
      TIDE_CHECK(ins.size() == static_cast<size_t>(ws_), "tide reduce_scatter: rank ", rank_, " passed ", ins.size(),
                 " inputs, expected world_size=", ws_);
      for (size_t r = 0; r < ins.size(); ++r) check_ptr("reduce_scatter", ins[r], count, "ins[", r, "]");
      check_ptr("reduce_scatter", out, count, "out");
    }, [&] { algo::reduce_scatter(ctx_, ins, out, count, in_dtype, out_dtype, op); });
  }

  void all_reduce(void* inout, size_t count, DType dtype, ReduceArgs op) override {
    Desc d{Kind::all_reduce, dtype, dtype, op.op, 0, count};
    run(d, [&] {
      check_reduce("all_reduce", rank_, dtype, dtype, op.op);
      check_ptr("all_reduce", inout, count, "buffer");
    }, [&] { algo::all_reduce(ctx_, inout, count, dtype, op); });
  }

  void reduce(void* inout, size_t count, DType dtype, ReduceArgs op, int root) override {
    Desc d{Kind::reduce, dtype, dtype, op.op, root, count};
    run(d, [&] {
      check_reduce("reduce", rank_, dtype, dtype, op.op);
      check_root("reduce", root);
      check_ptr("reduce", inout, count, "buffer");
    }, [&] { algo::reduce(ctx_, inout, count, dtype, op, root); });
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    Desc d{Kind::broadcast, DType::u8, DType::u8, ReduceOp::sum, root, bytes};
    run(d, [&] {
      check_root("broadcast", root);
      check_ptr("broadcast", buf, bytes, "buffer");
    }, [&] { algo::broadcast(ctx_, buf, bytes, root); });
  }

  void gather(const void* in, std::span<void* const> outs, size_t bytes, int root) override {
    Desc d{Kind::gather, DType::u8, DType::u8, ReduceOp::sum, root, bytes};
    run(d, [&] {
      check_root("gather", root);
      if (rank_ == root) check_outs("gather", outs, bytes);
      check_ptr("gather", in, bytes, "in");
    }, [&] { algo::gather(ctx_, in, outs, bytes, root); });
  }

  void scatter(std::span<const void* const> ins, void* out, size_t bytes, int root) override {
    Desc d{Kind::scatter, DType::u8, DType::u8, ReduceOp::sum, root, bytes};
    run(d, [&] {
      check_root("scatter", root);
      if (rank_ == root) {
        TIDE_CHECK(ins.size() == static_cast<size_t>(ws_), "tide scatter: root rank ", rank_, " passed ", ins.size(),
                   " inputs, expected world_size=", ws_);
        for (size_t r = 0; r < ins.size(); ++r) check_ptr("scatter", ins[r], bytes, "ins[", r, "]");
      }
      check_ptr("scatter", out, bytes, "out");
    }, [&] { algo::scatter(ctx_, ins, out, bytes, root); });
  }

  void all_to_all(const void* in, std::span<const size_t> send_bytes, std::span<const size_t> send_offsets, void* out,
                  std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets) override {
    Desc d{Kind::all_to_all, DType::u8, DType::u8, ReduceOp::sum, 0, 0};
    std::vector<uint64_t> sizes(2 * ws_);
    const size_t n = static_cast<size_t>(ws_);
    const bool sized = send_bytes.size() == n && recv_bytes.size() == n;
    if (sized) {
      std::copy(send_bytes.begin(), send_bytes.end(), sizes.begin());
      std::copy(recv_bytes.begin(), recv_bytes.end(), sizes.begin() + ws_);
    }
    size_t max_bytes = 0;
    run(d, [&] {
      TIDE_CHECK(sized && send_offsets.size() == n && recv_offsets.size() == n, "tide all_to_all: rank ", rank_,
                 " passed ", send_bytes.size(), " send sizes, ", send_offsets.size(), " send offsets, ",
                 recv_bytes.size(), " recv sizes and ", recv_offsets.size(), " recv offsets; expected world_size=",
                 ws_, " of each");
      for (size_t r = 0; r < n; ++r) {
        check_ptr("all_to_all", in, send_bytes[r], "in");
        check_ptr("all_to_all", out, recv_bytes[r], "out");
      }
    }, [&] { algo::all_to_all(ctx_, in, send_bytes, send_offsets, out, recv_bytes, recv_offsets, max_bytes); },
        sizes, &max_bytes);
  }

  void barrier() override {
    Desc d{Kind::barrier, DType::u8, DType::u8, ReduceOp::sum, 0, 0};
    run(d, [] {}, [] {});
  }

  std::shared_ptr<SymmetricBuffer> allocate_symmetric(size_t bytes) override {
    Desc d{Kind::allocate_symmetric, DType::u8, DType::u8, ReduceOp::sum, 0, 0};
    std::shared_ptr<SymmetricBuffer> out;
    run(d, [] {}, [&] { out = t_->allocate_symmetric(bytes); });
    return out;
  }

  void param_all_gather(const ParamAllGather& a) override {
    const char* name = "param_all_gather";
    Desc d = param_desc(Kind::param_all_gather, a.layout, a.shard_dtype, a.storage_dtype, ReduceOp::sum);
    if (a.layout) {
      uint64_t h = kFnvBasis;
      for (size_t o : a.shard_offsets) h = fnv(h, o);
      h = fnv(h, doubling_ ? pace_ + 1 : 0);  // the ranks must run the same algorithm
      d.aux = h;
    }
    run(d, [&] {
      check_layout(name, a.layout);
      const size_t np = a.layout->params.size();
      TIDE_CHECK(can_convert(a.shard_dtype, a.storage_dtype), "tide param_all_gather: rank ", rank_,
                 " cannot convert shard dtype ", dtype_name(a.shard_dtype), " to storage dtype ",
                 dtype_name(a.storage_dtype), " (only equal types, f32 <-> bf16/f16)");
      TIDE_CHECK(a.shards != nullptr || d.count == 0, "tide param_all_gather: rank ", rank_, " passed no shards buffer");
      TIDE_CHECK(a.shard_offsets.size() == np && a.storages.size() == np, "tide param_all_gather: rank ", rank_,
                 " passed ", a.shard_offsets.size(), " shard offsets and ", a.storages.size(), " storages for ", np,
                 " parameters");
      for (size_t p = 0; p < np; ++p)
        check_ptr(name, a.storages[p], static_cast<size_t>(a.layout->params[p].storage_numel), "storages[", p, "]");
    }, [&] {
      check_layout_agreed(name, a.layout);
      // Every rank knows every rank's shard sizes: all reach the same verdict.
      const size_t es = dtype_size(a.shard_dtype);
      for (size_t p = 0; p < a.layout->params.size(); ++p)
        for (int r = 0; r < ws_; ++r) {
          const size_t need = a.shard_offsets[p] + static_cast<size_t>(a.layout->params[p].padded_shard_numel) * es;
          TIDE_CHECK(a.layout->params[p].shards[r].numel == 0 || need <= a.shards->bytes(r),
                     "tide param_all_gather: parameter ", p, "'s shard on rank ", r, " needs bytes [",
                     a.shard_offsets[p], ", ", need, ") of the shards buffer, which has ", a.shards->bytes(r),
                     " bytes on rank ", r);
        }
      if (doubling_)
        algo::param_all_gather_doubling(ctx_, a, pace_);
      else
        algo::param_all_gather(ctx_, a);
    });
  }

  StagingReport param_reduce_scatter(const ParamReduceScatter& a) override {
    const char* name = "param_reduce_scatter";
    Desc d = param_desc(Kind::param_reduce_scatter, a.layout, a.grad_dtype, a.out_dtype, a.op.op);
    uint64_t h = fnv(kFnvBasis, std::bit_cast<uint64_t>(a.op.op == ReduceOp::premul_sum ? a.op.premul_factor : 0.0));
    h = fnv(h, a.reuse != nullptr);
    for (const plan::Region& r : a.reuse_regions) {
      h = fnv(h, static_cast<uint64_t>(r.offset));
      h = fnv(h, static_cast<uint64_t>(r.bytes));
    }
    d.aux = h;
    StagingReport report;
    run(d, [&] {
      check_layout(name, a.layout);
      check_reduce(name, rank_, a.grad_dtype, a.out_dtype, a.op.op);
      const size_t np = a.layout->params.size();
      TIDE_CHECK(a.grads.size() == np && a.out_offsets.size() == np, "tide param_reduce_scatter: rank ", rank_,
                 " passed ", a.grads.size(), " gradients and ", a.out_offsets.size(), " output offsets for ", np,
                 " parameters");
      for (size_t p = 0; p < np; ++p) {
        check_ptr(name, a.grads[p], static_cast<size_t>(a.layout->params[p].numel), "grads[", p, "]");
        TIDE_CHECK(a.out_offsets[p] >= 0, "tide param_reduce_scatter: rank ", rank_, " passed out_offsets[", p,
                   "]=", a.out_offsets[p]);
      }
      check_ptr(name, a.out, d.count, "out");
      if (a.nodes) check_nodes(name, *a.nodes);
    }, [&] {
      check_layout_agreed(name, a.layout, a.nodes ? a.nodes->topology.world_size : ws_);
      if (a.reuse)
        for (const plan::Region& r : a.reuse_regions)
          for (int q = 0; q < ws_; ++q)
            TIDE_CHECK(r.offset >= 0 && r.bytes >= 0 && static_cast<size_t>(r.offset + r.bytes) <= a.reuse->bytes(q),
                       "tide param_reduce_scatter: Slot-Reuse region [", r.offset, ", ", r.offset + r.bytes,
                       ") is outside rank ", q, "'s reuse buffer of ", a.reuse->bytes(q), " bytes");
      const std::unique_ptr<RsNode> node = algo::host_rs_node(ctx_);
      report = a.nodes ? ::tide::param_reduce_scatter(a, *a.nodes, *node)
                       : ::tide::param_reduce_scatter(a, {{ws_, ws_, 1}, rank_, nullptr}, *node);
    });
    return report;
  }

  void send(const void* buf, size_t bytes, int peer, int tag) override {
    const P2POp op{true, const_cast<void*>(buf), bytes, peer, tag};  // a send only reads it
    p2p("send", detail::concat("bytes=", bytes, " tag=", tag), {&op, 1});
  }

  void recv(void* buf, size_t bytes, int peer, int tag) override {
    const P2POp op{false, buf, bytes, peer, tag};
    p2p("recv", detail::concat("bytes=", bytes, " tag=", tag), {&op, 1});
  }

  void send_recv(std::span<const P2POp> ops) override {
    size_t sends = 0, bytes = 0;
    for (const P2POp& op : ops) {
      sends += op.send;
      bytes += op.bytes;
    }
    p2p("send_recv", detail::concat(sends, " sends and ", ops.size() - sends, " receives, ", bytes, " bytes"), ops);
  }

 private:
  // Local checks, then the cross-rank check, then the algorithm; any failure breaks the comm.
  template <class Check, class Body>
  void run(const Desc& d, Check&& check, Body&& body, std::span<const uint64_t> extra = {},
           size_t* max_a2a = nullptr) {
    const char* name = kind_name(d.kind);
    guard(name, [&] {
      t_->begin(name, describe(d, extra));
      check();
      std::vector<std::byte> mine(record_), all(record_ * ws_);
      std::memcpy(mine.data(), &d, sizeof d);
      if (!extra.empty()) std::memcpy(mine.data() + sizeof d, extra.data(), extra.size_bytes());
      t_->exchange(mine.data(), record_, all.data());
      agree(d, all, max_a2a);
      body();
    });
  }

  void p2p(const char* name, std::string detail, std::span<const P2POp> ops) {
    guard(name, [&] {
      t_->begin(name, std::move(detail));
      for (const P2POp& op : ops) {
        TIDE_CHECK(op.peer >= 0 && op.peer < ws_ && op.peer != rank_, "tide ", name, ": rank ", rank_, " got peer ",
                   op.peer, " (world_size=", ws_, ")");
        check_ptr(name, op.buf, op.bytes, "buffer");
      }
      algo::send_recv(ctx_, ops);
    });
  }

  template <class Body>
  void guard(const char* name, Body&& body) {
    if (broken_) {
      std::string msg = detail::concat("tide ", name, ": the communicator is unusable after an earlier error: ", why_);
      if (broken_timeout_) throw TimeoutError(msg);
      throw Error(msg);
    }
    try {
      body();
    } catch (const TimeoutError& e) {
      fail(e.what(), true);
      throw;
    } catch (const std::exception& e) {
      fail(e.what(), false);
      throw;
    }
  }

  void fail(const std::string& why, bool timeout) {
    broken_ = true;
    broken_timeout_ = timeout;
    why_ = why;
    t_->abort(why);
  }

  // Every rank sees every record, so every rank reaches the same verdict.
  void agree(const Desc& d, const std::vector<std::byte>& all, size_t* max_a2a) {
    std::vector<Desc>& ds = descs_;
    ds.resize(ws_);
    std::vector<std::vector<uint64_t>> a2a(ws_);
    for (int r = 0; r < ws_; ++r) {
      std::memcpy(&ds[r], all.data() + r * record_, sizeof(Desc));
      if (d.kind == Kind::all_to_all) {
        a2a[r].resize(2 * ws_);
        std::memcpy(a2a[r].data(), all.data() + r * record_ + sizeof(Desc), 16 * static_cast<size_t>(ws_));
      }
    }
    bool ok = true;
    for (int r = 0; r < ws_; ++r) ok = ok && same(ds[r], ds[0]);
    if (ok && d.kind == Kind::all_to_all) {
      for (int s = 0; s < ws_; ++s)
        for (int r = 0; r < ws_; ++r) {
          ok = ok && a2a[s][r] == a2a[r][ws_ + s];  // what s sends to r == what r expects from s
          *max_a2a = std::max<size_t>(*max_a2a, a2a[s][r]);
        }
    }
    if (ok) return;
    std::ostringstream os;
    os << "tide " << kind_name(d.kind) << ": ranks disagree on the arguments:";
    bool kinds_differ = false;
    for (int r = 0; r < ws_; ++r) kinds_differ = kinds_differ || ds[r].kind != ds[0].kind;
    for (int r = 0; r < ws_; ++r) {
      os << (r ? "; " : " ") << "rank " << r << ": ";
      if (kinds_differ) os << kind_name(ds[r].kind) << " ";
      os << describe(ds[r], ds[r].kind == Kind::all_to_all ? std::span<const uint64_t>(a2a[r]) : std::span<const uint64_t>());
    }
    throw Error(os.str());
  }

  Desc param_desc(Kind k, const plan::GroupLayout* l, DType in, DType out, ReduceOp op) const {
    Desc d{k, in, out, op, 0, 0};
    if (!l) return d;
    d.root = static_cast<int32_t>(l->params.size());
    d.layout_ws = l->world_size;
    for (const plan::ParamLayout& p : l->params) d.count += static_cast<uint64_t>(p.padded_shard_numel);
    d.hash = plan::layout_hash(*l);
    return d;
  }
  // Local: the layout exists and is for this communicator (a layout that disagrees across
  // ranks fails the descriptor check on every rank instead).
  void check_layout(const char* name, const plan::GroupLayout* l) const {
    TIDE_CHECK(l != nullptr, "tide ", name, ": rank ", rank_, " passed no layout");
  }
  // After the descriptor check (so every rank reaches the same verdict).
  // group_ws: the world size of the group the layout is for (across nodes, larger than ws_).
  void check_layout_agreed(const char* name, const plan::GroupLayout* l, int group_ws = 0) const {
    if (group_ws == 0) group_ws = ws_;
    TIDE_CHECK(l->world_size == group_ws, "tide ", name, ": rank ", rank_, " passed a layout for world_size=",
               l->world_size, " to a group of world_size=", group_ws);
    for (size_t p = 0; p < l->params.size(); ++p)
      TIDE_CHECK(l->params[p].shards.size() == static_cast<size_t>(group_ws), "tide ", name, ": rank ", rank_,
                 ": parameter ", p, " of the layout has ", l->params[p].shards.size(), " shards, expected ",
                 group_ws);
  }
  // Across nodes: this communicator is the node of nodes.rank in nodes.topology.
  void check_nodes(const char* name, const TwoLevel& n) const {
    TIDE_CHECK(n.engine, "tide ", name, ": rank ", rank_, ": across nodes without an engine");
    const plan::Topology& t = n.topology;
    TIDE_CHECK(t.local_size == ws_ && n.rank >= 0 && n.rank < t.world_size && t.local_rank(n.rank) == rank_,
               "tide ", name, ": rank ", n.rank, " (local rank ", rank_, " of ", ws_, ") does not fit a topology of ",
               t.num_nodes, " nodes x ", t.local_size, " ranks");
  }

  void check_root(const char* name, int root) const {
    TIDE_CHECK(root >= 0 && root < ws_, "tide ", name, ": rank ", rank_, " got root ", root, " (world_size=", ws_, ")");
  }
  void check_outs(const char* name, std::span<void* const> outs, size_t bytes) const {
    TIDE_CHECK(outs.size() == static_cast<size_t>(ws_), "tide ", name, ": rank ", rank_, " passed ", outs.size(),
               " outputs, expected world_size=", ws_);
    for (size_t r = 0; r < outs.size(); ++r) check_ptr(name, outs[r], bytes, "outs[", r, "]");
  }
  template <class... What>
  void check_ptr(const char* name, const void* p, size_t size, const What&... what) const {
    TIDE_CHECK(p != nullptr || size == 0, "tide ", name, ": rank ", rank_, " passed a null ", what...,
               " for ", size, size == 1 ? " element/byte" : " elements/bytes");
  }

  std::unique_ptr<Transport> t_;
  algo::Ctx ctx_;
  int rank_, ws_;
  bool doubling_;  // param_all_gather by recursive doubling (CommOptions::allgather_algorithm)
  size_t pace_;
  size_t record_;
  std::vector<Desc> descs_;  // every rank's descriptor of the current collective
  bool broken_ = false, broken_timeout_ = false;
  std::string why_;
};

}  // namespace

std::unique_ptr<Comm> make_host_comm(Store& store, const std::string& ns, int rank, int world_size,
                                     CommOptions options) {
  std::string algorithm = options.allgather_algorithm;
  if (algorithm.empty()) {
    const char* v = std::getenv("TIDE_HOST_ALLGATHER");
    algorithm = v && *v ? v : "direct";
  }
  TIDE_CHECK(algorithm == "direct" || algorithm == "doubling", "tide: TIDE_HOST_ALLGATHER='", algorithm,
             "' is not 'direct' or 'doubling'");
  const size_t pace = options.allgather_pace_bytes ? options.allgather_pace_bytes
                                                   : env::get_bytes("TIDE_ALLGATHER_PACE_BYTES", 0);
  return std::make_unique<HostComm>(make_host_transport(store, ns, rank, world_size, options), algorithm == "doubling",
                                    pace);
}

}  // namespace tide
