#include "ProcessGroupTide.hpp"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "DelegatedWork.hpp"
#include "tide/error.hpp"
#include "tide/host_transport.hpp"
#include "tide/reduce_kernels.hpp"

namespace tide::torch_backend {
namespace {

// ---- c10d::Store as a tide::Store ---------------------------------------------------
class C10dStore : public tide::Store {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    store_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    // c10d reads a zero timeout as "wait forever" (Store::kNoTimeout): never pass one.
    TORCH_CHECK(timeout.count() > 0, "tide: store get of '", key, "' without a timeout");
    try {
      store_->wait({key}, timeout);
    } catch (const std::exception& e) {
      throw tide::TimeoutError(std::string("tide: store key '") + key + "' not set: " + e.what());
    }
    return store_->get(key);
  }
  bool check(const std::string& key) override { return store_->check({key}); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// ---- tensor checks and mapping --------------------------------------------------------
// Every check names the collective and the rank, as the built-in backends do.
struct OpContext {
  const char* name;
  int rank;
};

DType to_dtype(at::ScalarType t, const OpContext& ctx) {
  switch (t) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    case at::kChar: return DType::i8;
    case at::kByte: return DType::u8;
    case at::kShort: return DType::i16;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    case at::kBool: return DType::boolean;
    default:
      TORCH_CHECK(false, "tide ", ctx.name, ": rank ", ctx.rank, ": unsupported dtype ", t);
  }
}

void check_tensor(const at::Tensor& t, const OpContext& ctx, const char* what) {
  TORCH_CHECK(t.defined(), "tide ", ctx.name, ": rank ", ctx.rank, ": ", what, " is undefined");
  TORCH_CHECK(!t.is_cuda(), "tide ", ctx.name, ": rank ", ctx.rank, ": ", what,
              " is a CUDA tensor but the others are not; pass tensors of one device");
  TORCH_CHECK(t.device().is_cpu(), "tide ", ctx.name, ": rank ", ctx.rank, ": ", what,
              " is on ", t.device(), "; tide handles CPU tensors");
  TORCH_CHECK(t.layout() == at::kStrided, "tide ", ctx.name, ": rank ", ctx.rank, ": ", what,
              " must be a dense (strided) tensor");
}

// A tensor of the CUDA FSDP2 path: dense, contiguous, on the group's device.
void check_cuda_tensor(const at::Tensor& t, int device, const OpContext& ctx, const char* what) {
  TORCH_CHECK(t.defined(), "tide ", ctx.name, ": rank ", ctx.rank, ": ", what, " is undefined");
  TORCH_CHECK(t.is_cuda() && t.device().index() == device, "tide ", ctx.name, ": rank ", ctx.rank, ": ", what,
              " is on ", t.device(), " but the symmetric memory is on cuda:", device);
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), "tide ", ctx.name, ": rank ", ctx.rank, ": ", what,
              " must be a dense contiguous tensor");
}

// A tensor of the FSDP2 path: on the host (device -1) or on cuda:device.
void check_param_tensor(const at::Tensor& t, int device, const OpContext& ctx, const char* what) {
  if (device >= 0)
    check_cuda_tensor(t, device, ctx, what);
  else
    check_tensor(t, ctx, what);
}

// An input: checked and made contiguous (a copy only when the caller's was not).
at::Tensor input(const at::Tensor& t, const OpContext& ctx, const char* what = "input") {
  check_tensor(t, ctx, what);
  return t.contiguous();
}

// An output the collective writes: contiguous scratch when the caller's tensor is not,
// copied back when the collective ends.
struct Output {
  at::Tensor user;
  at::Tensor buf;
  void* data() { return buf.data_ptr(); }
  void finish() {
    if (!buf.is_same(user)) user.copy_(buf);
  }
};
Output output(const at::Tensor& t, const OpContext& ctx, const char* what = "output") {
  check_tensor(t, ctx, what);
  return Output{t, t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous)};
}

ReduceArgs to_reduce_op(const c10d::ReduceOp& op, const OpContext& ctx) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return {ReduceOp::sum};
    case c10d::ReduceOp::AVG: return {ReduceOp::avg};
    case c10d::ReduceOp::MAX: return {ReduceOp::max};
    case c10d::ReduceOp::MIN: return {ReduceOp::min};
    case c10d::ReduceOp::PRODUCT: return {ReduceOp::product};
    case c10d::ReduceOp::BAND: return {ReduceOp::band};
    case c10d::ReduceOp::BOR: return {ReduceOp::bor};
    case c10d::ReduceOp::BXOR: return {ReduceOp::bxor};
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(sup, "tide ", ctx.name, ": rank ", ctx.rank, ": PREMUL_SUM without a factor");
      double factor = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>()
                                                   : sup->double_factor;
      return {ReduceOp::premul_sum, factor};
    }
    default:
      TORCH_CHECK(false, "tide ", ctx.name, ": rank ", ctx.rank, ": reduce op ", int(op.op_),
                  " is not supported (SUM, AVG, MAX, MIN, PRODUCT, PREMUL_SUM, BAND, BOR, BXOR are)");
  }
}

// The op, checked locally against the dtypes (a local error leaves the group usable).
ReduceArgs to_reduce(const c10d::ReduceOp& op, const OpContext& ctx, DType in, DType out) {
  ReduceArgs args = to_reduce_op(op, ctx);
  check_reduce(ctx.name, ctx.rank, in, out, args.op);
  return args;
}

// The built-in backends' wording first (torch's own tests match it), then tide's detail.
void check_nonempty(const std::vector<at::Tensor>& tensors, const OpContext& ctx) {
  TORCH_CHECK(!tensors.empty(), "tide ", ctx.name, ": rank ", ctx.rank, ": requires non-empty tensor list");
}

void check_single(const std::vector<at::Tensor>& tensors, const OpContext& ctx) {
  check_nonempty(tensors, ctx);
  TORCH_CHECK(tensors.size() == 1, "tide ", ctx.name, ": rank ", ctx.rank,
              ": requires a single-element tensor list, got ", tensors.size(), " tensors");
}

void check_root(int64_t root, int size, const OpContext& ctx) {
  TORCH_CHECK(root >= 0 && root < size, "tide ", ctx.name, ": rank ", ctx.rank, ": invalid root rank: ", root,
              " (the group has ", size, " ranks)");
}

// Several tensors in one call (gloo's multi-tensor form): all of one dtype and size.
void check_alike(const std::vector<at::Tensor>& tensors, const OpContext& ctx) {
  for (size_t i = 1; i < tensors.size(); ++i) {
    check_tensor(tensors[i], ctx, "tensor");
    TORCH_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type(), "tide ", ctx.name, ": rank ", ctx.rank,
                ": invalid tensor type: tensor ", i, " is ", tensors[i].scalar_type(), ", tensor 0 is ",
                tensors[0].scalar_type());
    TORCH_CHECK(tensors[i].sizes() == tensors[0].sizes(), "tide ", ctx.name, ": rank ", ctx.rank,
                ": invalid tensor size: tensor ", i, " has size ", tensors[i].sizes(), ", tensor 0 has ",
                tensors[0].sizes());
  }
}

void check_numel(const at::Tensor& t, int64_t expected, const OpContext& ctx, const char* what,
                 const char* why) {
  TORCH_CHECK(t.numel() == expected, "tide ", ctx.name, ": rank ", ctx.rank, ": ", what, " has ",
              t.numel(), " elements, expected ", expected, " (", why, ")");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const OpContext& ctx) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "tide ", ctx.name, ": rank ", ctx.rank,
              ": input is ", a.scalar_type(), " but output is ", b.scalar_type());
}

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

// A peer's failure (tide::TimeoutError) as what ProcessGroupNCCL and ProcessGroupGloo raise
// for it; any other error as it is.
std::exception_ptr torch_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const tide::TimeoutError& e) {
    return std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, __LINE__}, e.what()));
  } catch (...) {
    return error;
  }
}

bool is_cuda(const std::vector<at::Tensor>& tensors) {
  return !tensors.empty() && tensors[0].defined() && tensors[0].is_cuda();
}

}  // namespace

// ---- WorkTide ---------------------------------------------------------------------------
WorkTide::WorkTide(c10d::OpType op, const char* profiling_title, std::vector<at::Tensor> outputs)
    : c10d::Work(-1, op, profiling_title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

void WorkTide::complete(std::exception_ptr eptr) {
  // The future first, as gloo does: whoever wakes from wait() may read its value at once.
  if (eptr) {
    future_->setError(eptr);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(eptr);
}

// ---- ProcessGroupTide -----------------------------------------------------------------------
ProcessGroupTide::ProcessGroupTide(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   std::chrono::milliseconds timeout, const std::string& group_name,
                                   int job_rank)
    : c10d::Backend(rank, size),
      store_(store),
      group_name_(group_name),
      job_rank_(job_rank >= 0 ? job_rank : rank),
      timeout_(timeout) {
  C10dStore tide_store(store);
  CommOptions options;
  options.timeout = timeout;
  try {
    // One node: the host communicator runs everything on CPU tensors. Several (hosts, or
    // pseudo-nodes): the standard ops on CPU tensors go to gloo (set_cpu_delegate), as CUDA
    // ones go to NCCL, and the parameter collectives run over the node's communicator.
    tide::GroupNodes nodes = tide::discover_nodes(tide_store, "pg" + group_name, rank, size, options, job_rank);
    num_nodes_ = nodes.num_nodes;
    topology_ = nodes.topology;
    topology_error_ = nodes.topology_error;
    if (num_nodes_ == 1) {
      comm_ = std::move(nodes.node_comm);
      cpu_params_ = make_host_params(*comm_);
    } else {
      cpu_params_ = make_host_params_across_nodes(std::move(nodes), rank, [this] { return timeout_.load(); },
                                                  [this] { return cpu_; });
    }
  } catch (const tide::TimeoutError& e) {
    C10_THROW_ERROR(DistBackendError, e.what());
  }
  worker_ = std::thread([this] { worker_loop(); });
}

ProcessGroupTide::~ProcessGroupTide() {
  // Torch drops a backend with the GIL held (pybind's dealloc), and this teardown waits for
  // threads that take it: this group's worker (future callbacks), gloo's run loops (a
  // finished work frees its Python-owned tensors) and NCCL's. So the GIL is released for all
  // of it, and the members that own such threads are dropped here rather than after the body.
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
  cuda_params_.reset();  // its teardown is collective over the store, not the worker
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();  // finishes what was queued, as gloo's destructor does
  finished_.clear();
  cpu_params_.reset();  // TIDE's gloo engine holds the delegate
  cpu_.reset();
  cuda_.reset();
}

void ProcessGroupTide::worker_loop() {
  for (;;) {
    std::pair<c10::intrusive_ptr<WorkTide>, std::function<void()>> item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr eptr;
    try {
      item.second();
    } catch (...) {
      eptr = torch_error(std::current_exception());
    }
    item.first->complete(eptr);
    std::lock_guard<std::mutex> lock(mutex_);
    finished_.push_back(std::move(item));
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::enqueue(c10d::OpType op, const char* name,
                                                         std::vector<at::Tensor> outputs,
                                                         std::function<void()> fn) {
  auto work = c10::make_intrusive<WorkTide>(op, name, std::move(outputs));
  if (coalescing_) queued_in_block_ = true;
  std::vector<Queued> finished;  // released on this thread, after the lock (see finished_)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(work, std::move(fn));
    finished.swap(finished_);
  }
  cv_.notify_one();
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(tensors, "broadcast")) return delegated("broadcast", d, d->broadcast(tensors, opts));
  OpContext ctx{"broadcast", getRank()};
  check_nonempty(tensors, ctx);
  check_root(opts.rootRank, getSize(), ctx);
  TORCH_CHECK(opts.rootTensor >= 0 && opts.rootTensor < static_cast<int64_t>(tensors.size()), "tide broadcast: rank ",
              getRank(), ": invalid root tensor: ", opts.rootTensor, " (", tensors.size(), " tensors)");
  check_alike(tensors, ctx);
  // The root's tensors[rootTensor] goes to every tensor of every rank.
  const size_t src = static_cast<size_t>(opts.rootTensor);
  auto out = output(tensors[src], ctx, "tensor");
  if (!out.buf.is_same(out.user)) out.buf.copy_(out.user);
  int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, "tide:broadcast", tensors, [this, out, root, tensors, src]() mutable {
    comm_->broadcast(out.data(), nbytes(out.buf), root);
    out.finish();
    for (size_t i = 0; i < tensors.size(); ++i)
      if (i != src) tensors[i].copy_(out.user);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(tensors, "allreduce")) return delegated("allreduce", d, d->allreduce(tensors, opts));
  OpContext ctx{"allreduce", getRank()};
  check_nonempty(tensors, ctx);
  check_alike(tensors, ctx);
  auto out = output(tensors[0], ctx, "tensor");
  if (!out.buf.is_same(out.user)) out.buf.copy_(out.user);
  auto dtype = to_dtype(out.buf.scalar_type(), ctx);
  auto red = to_reduce(opts.reduceOp, ctx, dtype, dtype);
  // Several tensors (gloo's multi-tensor form): every tensor of every rank is reduced into
  // all of them; this rank's first, in list order, then across ranks.
  std::vector<at::Tensor> rest;
  for (size_t i = 1; i < tensors.size(); ++i) rest.push_back(tensors[i].contiguous());
  TORCH_CHECK(rest.empty() || (red.op != ReduceOp::avg && red.op != ReduceOp::premul_sum), "tide allreduce: rank ",
              getRank(), ": ", reduce_op_name(red.op), " over a list of ", tensors.size(),
              " tensors is not supported (SUM, MIN, MAX, PRODUCT and the bitwise ops are)");
  return enqueue(c10d::OpType::ALLREDUCE, "tide:all_reduce", tensors, [=, this]() mutable {
    if (!rest.empty()) {
      std::vector<const void*> srcs{out.data()};
      for (auto& t : rest) srcs.push_back(t.data_ptr());
      reduce_kernel(out.data(), dtype, srcs.data(), srcs.size(), dtype, static_cast<size_t>(out.buf.numel()), red);
    }
    comm_->all_reduce(out.data(), out.buf.numel(), dtype, red);
    out.finish();
    for (size_t i = 1; i < tensors.size(); ++i) tensors[i].copy_(out.user);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(tensors, "allreduce_coalesced"))
    return delegated("allreduce_coalesced", d, d->allreduce_coalesced(tensors, opts));
  OpContext ctx{"allreduce_coalesced", getRank()};
  std::vector<Output> outs;
  std::vector<DType> dtypes;
  for (auto& t : tensors) {
    outs.push_back(output(t, ctx, "tensor"));
    if (!outs.back().buf.is_same(t)) outs.back().buf.copy_(t);
    dtypes.push_back(to_dtype(t.scalar_type(), ctx));
  }
  ReduceArgs red = to_reduce_op(opts.reduceOp, ctx);
  for (DType d : dtypes) red = to_reduce(opts.reduceOp, ctx, d, d);
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "tide:all_reduce_coalesced", tensors,
                 [=, this]() mutable {
                   for (size_t i = 0; i < outs.size(); ++i) {
                     comm_->all_reduce(outs[i].data(), outs[i].buf.numel(), dtypes[i], red);
                     outs[i].finish();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(tensors, "reduce")) return delegated("reduce", d, d->reduce(tensors, opts));
  OpContext ctx{"reduce", getRank()};
  check_single(tensors, ctx);
  check_root(opts.rootRank, getSize(), ctx);
  auto out = output(tensors[0], ctx, "tensor");
  if (!out.buf.is_same(out.user)) out.buf.copy_(out.user);
  auto dtype = to_dtype(out.buf.scalar_type(), ctx);
  auto red = to_reduce(opts.reduceOp, ctx, dtype, dtype);
  int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::REDUCE, "tide:reduce", tensors, [=, this]() mutable {
    comm_->reduce(out.data(), out.buf.numel(), dtype, red, root);
    out.finish();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(inputs, "allgather")) return delegated("allgather", d, d->allgather(outputs, inputs, opts));
  OpContext ctx{"allgather", getRank()};
  check_single(inputs, ctx);
  TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(getSize()),
              "tide allgather: rank ", getRank(), ": expects one list of ", getSize(),
              " output tensors");
  auto in = input(inputs[0], ctx);
  auto dtype = to_dtype(in.scalar_type(), ctx);
  std::vector<Output> outs;
  for (auto& t : outputs[0]) {
    check_same_dtype(in, t, ctx);
    check_numel(t, in.numel(), ctx, "an output tensor", "each output matches the input");
    outs.push_back(output(t, ctx));
  }
  return enqueue(c10d::OpType::ALLGATHER, "tide:all_gather", outputs[0], [=, this]() mutable {
    std::vector<void*> ptrs;
    for (auto& o : outs) ptrs.push_back(o.data());
    comm_->all_gather(in.data_ptr(), ptrs, in.numel(), dtype);
    for (auto& o : outs) o.finish();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::_allgather_base(at::Tensor& output_tensor,
                                                                 at::Tensor& input_tensor,
                                                                 const c10d::AllgatherOptions& opts) {
  ++collective_seq_;
  if (auto deferred = run_deferred(c10d::OpType::_ALLGATHER_BASE, output_tensor, input_tensor)) return deferred;
  if (auto d = delegate({input_tensor}, "_allgather_base"))
    return delegated("_allgather_base", d, d->_allgather_base(output_tensor, input_tensor, opts));
  OpContext ctx{"all_gather_into_tensor", getRank()};
  auto in = input(input_tensor, ctx);
  check_same_dtype(in, output_tensor, ctx);
  check_numel(output_tensor, in.numel() * getSize(), ctx, "output",
              "world size x input elements");
  auto out = output(output_tensor, ctx);
  auto dtype = to_dtype(in.scalar_type(), ctx);
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "tide:all_gather_into_tensor", {output_tensor},
                 [=, this]() mutable {
                   std::vector<void*> ptrs;
                   auto* base = static_cast<char*>(out.data());
                   for (int r = 0; r < getSize(); ++r) ptrs.push_back(base + r * nbytes(in));
                   comm_->all_gather(in.data_ptr(), ptrs, in.numel(), dtype);
                   out.finish();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(inputs, "allgather_coalesced"))
    return delegated("allgather_coalesced", d, d->allgather_coalesced(output_lists, inputs, opts));
  OpContext ctx{"allgather_coalesced", getRank()};
  TORCH_CHECK(output_lists.size() == static_cast<size_t>(getSize()), "tide allgather_coalesced: rank ",
              getRank(), ": expects ", getSize(), " output lists, got ", output_lists.size());
  // output_lists[r][i] receives rank r's inputs[i]: one all_gather per input.
  std::vector<at::Tensor> ins;
  std::vector<DType> dtypes;
  std::vector<std::vector<Output>> outs(inputs.size());
  std::vector<at::Tensor> all_outputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    ins.push_back(input(inputs[i], ctx));
    dtypes.push_back(to_dtype(inputs[i].scalar_type(), ctx));
    for (int r = 0; r < getSize(); ++r) {
      TORCH_CHECK(output_lists[r].size() == inputs.size(), "tide allgather_coalesced: rank ",
                  getRank(), ": output list ", r, " has ", output_lists[r].size(),
                  " tensors, expected ", inputs.size());
      auto& t = output_lists[r][i];
      check_same_dtype(inputs[i], t, ctx);
      check_numel(t, inputs[i].numel(), ctx, "an output tensor", "each output matches its input");
      outs[i].push_back(output(t, ctx));
      all_outputs.push_back(t);
    }
  }
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "tide:all_gather_coalesced", all_outputs,
                 [=, this]() mutable {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     std::vector<void*> ptrs;
                     for (auto& o : outs[i]) ptrs.push_back(o.data());
                     comm_->all_gather(ins[i].data_ptr(), ptrs, ins[i].numel(), dtypes[i]);
                     for (auto& o : outs[i]) o.finish();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(inputs, "allgather_into_tensor_coalesced"))
    return delegated("allgather_into_tensor_coalesced", d,
                     d->allgather_into_tensor_coalesced(outputs, inputs, opts));
  OpContext ctx{"allgather_into_tensor_coalesced", getRank()};
  TORCH_CHECK(outputs.size() == inputs.size(), "tide allgather_into_tensor_coalesced: rank ",
              getRank(), ": ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  std::vector<at::Tensor> ins;
  std::vector<Output> outs;
  std::vector<DType> dtypes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    ins.push_back(input(inputs[i], ctx));
    check_same_dtype(inputs[i], outputs[i], ctx);
    check_numel(outputs[i], inputs[i].numel() * getSize(), ctx, "an output",
                "world size x input elements");
    outs.push_back(output(outputs[i], ctx));
    dtypes.push_back(to_dtype(inputs[i].scalar_type(), ctx));
  }
  return enqueue(c10d::OpType::COALESCED, "tide:all_gather_into_tensor_coalesced", outputs,
                 [=, this]() mutable {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     std::vector<void*> ptrs;
                     auto* base = static_cast<char*>(outs[i].data());
                     for (int r = 0; r < getSize(); ++r) ptrs.push_back(base + r * nbytes(ins[i]));
                     comm_->all_gather(ins[i].data_ptr(), ptrs, ins[i].numel(), dtypes[i]);
                     outs[i].finish();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(inputs, "gather")) return delegated("gather", d, d->gather(outputs, inputs, opts));
  OpContext ctx{"gather", getRank()};
  check_single(inputs, ctx);
  check_root(opts.rootRank, getSize(), ctx);
  int root = static_cast<int>(opts.rootRank);
  auto in = input(inputs[0], ctx);
  std::vector<Output> outs;
  std::vector<at::Tensor> result;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(getSize()),
                "tide gather: root rank ", getRank(), ": expects one list of ", getSize(),
                " output tensors");
    for (auto& t : outputs[0]) {
      check_same_dtype(in, t, ctx);
      check_numel(t, in.numel(), ctx, "an output tensor", "each output matches the input");
      outs.push_back(output(t, ctx));
    }
    result = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(), "tide gather: rank ", getRank(),
                ": only the root (", root, ") takes output tensors");
  }
  return enqueue(c10d::OpType::GATHER, "tide:gather", result, [=, this]() mutable {
    std::vector<void*> ptrs;
    for (auto& o : outs) ptrs.push_back(o.data());
    comm_->gather(in.data_ptr(), ptrs, nbytes(in), root);
    for (auto& o : outs) o.finish();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(outputs, "scatter")) return delegated("scatter", d, d->scatter(outputs, inputs, opts));
  OpContext ctx{"scatter", getRank()};
  check_single(outputs, ctx);
  check_root(opts.rootRank, getSize(), ctx);
  int root = static_cast<int>(opts.rootRank);
  auto out = output(outputs[0], ctx);
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(getSize()),
                "tide scatter: root rank ", getRank(), ": expects one list of ", getSize(),
                " input tensors");
    for (auto& t : inputs[0]) {
      check_same_dtype(t, outputs[0], ctx);
      check_numel(t, outputs[0].numel(), ctx, "an input tensor", "each input matches the output");
      ins.push_back(input(t, ctx));
    }
  } else {
    TORCH_CHECK(inputs.empty() || inputs[0].empty(), "tide scatter: rank ", getRank(),
                ": only the root (", root, ") takes input tensors");
  }
  return enqueue(c10d::OpType::SCATTER, "tide:scatter", outputs, [=, this]() mutable {
    std::vector<const void*> ptrs;
    for (auto& t : ins) ptrs.push_back(t.data_ptr());
    comm_->scatter(ptrs, out.data(), nbytes(out.buf), root);
    out.finish();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(outputs, "reduce_scatter"))
    return delegated("reduce_scatter", d, d->reduce_scatter(outputs, inputs, opts));
  OpContext ctx{"reduce_scatter", getRank()};
  check_single(outputs, ctx);
  TORCH_CHECK(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(getSize()),
              "tide reduce_scatter: rank ", getRank(), ": expects one list of ", getSize(),
              " input tensors");
  auto out = output(outputs[0], ctx);
  std::vector<at::Tensor> ins;
  for (auto& t : inputs[0]) {
    check_same_dtype(t, outputs[0], ctx);
    check_numel(t, outputs[0].numel(), ctx, "an input tensor", "each input matches the output");
    ins.push_back(input(t, ctx));
  }
  auto dtype = to_dtype(outputs[0].scalar_type(), ctx);
  auto red = to_reduce(opts.reduceOp, ctx, dtype, dtype);
  return enqueue(c10d::OpType::REDUCE_SCATTER, "tide:reduce_scatter", outputs, [=, this]() mutable {
    std::vector<const void*> ptrs;
    for (auto& t : ins) ptrs.push_back(t.data_ptr());
    comm_->reduce_scatter(ptrs, out.data(), out.buf.numel(), dtype, dtype, red);
    out.finish();
  });
}

// Also the mixed-precision reduce-scatter NCCL lacks: bf16/f16 input, fp32 output.
std::function<void()> ProcessGroupTide::prepare_reduce_scatter_tensor(
    at::Tensor& output_tensor, at::Tensor& input_tensor, const c10d::ReduceScatterOptions& opts,
    const char* name) {
  OpContext ctx{name, getRank()};
  auto in = input(input_tensor, ctx);
  check_numel(in, output_tensor.numel() * getSize(), ctx, "input", "world size x output elements");
  auto in_dtype = to_dtype(in.scalar_type(), ctx);
  auto out_dtype = to_dtype(output_tensor.scalar_type(), ctx);
  bool mixed = out_dtype == DType::f32 && (in_dtype == DType::bf16 || in_dtype == DType::f16);
  TORCH_CHECK(in_dtype == out_dtype || mixed, "tide ", name, ": rank ", getRank(), ": input is ",
              in.scalar_type(), " and output is ", output_tensor.scalar_type(),
              "; they must match, or be bf16/fp16 input with fp32 output");
  auto out = output(output_tensor, ctx);
  auto red = to_reduce(opts.reduceOp, ctx, in_dtype, out_dtype);
  return [=, this]() mutable {
    std::vector<const void*> ptrs;
    auto* base = static_cast<const char*>(in.data_ptr());
    size_t slice = static_cast<size_t>(out.buf.numel()) * in.element_size();
    for (int r = 0; r < getSize(); ++r) ptrs.push_back(base + r * slice);
    comm_->reduce_scatter(ptrs, out.data(), out.buf.numel(), in_dtype, out_dtype, red);
    out.finish();
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::_reduce_scatter_base(
    at::Tensor& output_tensor, at::Tensor& input_tensor, const c10d::ReduceScatterOptions& opts) {
  ++collective_seq_;
  if (auto deferred = run_deferred(c10d::OpType::_REDUCE_SCATTER_BASE, output_tensor, input_tensor)) return deferred;
  if (auto d = delegate({output_tensor}, "_reduce_scatter_base"))
    return delegated("_reduce_scatter_base", d, d->_reduce_scatter_base(output_tensor, input_tensor, opts));
  auto fn = prepare_reduce_scatter_tensor(output_tensor, input_tensor, opts, "reduce_scatter_tensor");
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "tide:reduce_scatter_tensor", {output_tensor},
                 std::move(fn));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(outputs, "reduce_scatter_tensor_coalesced"))
    return delegated("reduce_scatter_tensor_coalesced", d,
                     d->reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  TORCH_CHECK(outputs.size() == inputs.size(), "tide reduce_scatter_tensor_coalesced: rank ",
              getRank(), ": ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  std::vector<std::function<void()>> fns;
  for (size_t i = 0; i < inputs.size(); ++i)
    fns.push_back(prepare_reduce_scatter_tensor(outputs[i], inputs[i], opts,
                                                "reduce_scatter_tensor_coalesced"));
  return enqueue(c10d::OpType::COALESCED, "tide:reduce_scatter_tensor_coalesced", outputs,
                 [fns = std::move(fns)]() {
                   for (auto& fn : fns) fn();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::alltoall_base(
    at::Tensor& output_tensor, at::Tensor& input_tensor, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate({input_tensor}, "alltoall_base"))
    return delegated("alltoall_base", d,
                     d->alltoall_base(output_tensor, input_tensor, output_split_sizes, input_split_sizes, opts));
  OpContext ctx{"all_to_all_single", getRank()};
  auto in = input(input_tensor, ctx);
  check_same_dtype(in, output_tensor, ctx);
  auto out = output(output_tensor, ctx);
  int ws = getSize();
  // Splits are in rows of dim 0; empty means equal splits.
  auto byte_splits = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    size_t row = t.dim() == 0 ? t.element_size()
                              : static_cast<size_t>(t.numel() / std::max<int64_t>(t.size(0), 1)) *
                                    t.element_size();
    int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    std::vector<size_t> sizes(ws), offsets(ws);
    if (splits.empty()) {
      TORCH_CHECK(rows % ws == 0, "tide all_to_all_single: rank ", getRank(), ": ", what, " has ",
                  rows, " rows, not divisible by the world size ", ws);
      for (int r = 0; r < ws; ++r) sizes[r] = static_cast<size_t>(rows / ws) * row;
    } else {
      TORCH_CHECK(splits.size() == static_cast<size_t>(ws), "tide all_to_all_single: rank ",
                  getRank(), ": ", what, " splits have ", splits.size(), " entries for ", ws,
                  " ranks");
      int64_t total = 0;
      for (int r = 0; r < ws; ++r) {
        sizes[r] = static_cast<size_t>(splits[r]) * row;
        total += splits[r];
      }
      TORCH_CHECK(total == rows, "tide all_to_all_single: rank ", getRank(), ": ", what,
                  " splits sum to ", total, " rows but the tensor has ", rows);
    }
    size_t off = 0;
    for (int r = 0; r < ws; ++r) {
      offsets[r] = off;
      off += sizes[r];
    }
    return std::make_pair(sizes, offsets);
  };
  auto [send_sizes, send_offsets] = byte_splits(in, input_split_sizes, "input");
  auto [recv_sizes, recv_offsets] = byte_splits(out.buf, output_split_sizes, "output");
  return enqueue(c10d::OpType::ALLTOALL_BASE, "tide:all_to_all_single", {output_tensor},
                 [=, this]() mutable {
                   comm_->all_to_all(in.data_ptr(), send_sizes, send_offsets, out.data(),
                                     recv_sizes, recv_offsets);
                   out.finish();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate(inputs, "alltoall")) return delegated("alltoall", d, d->alltoall(outputs, inputs, opts));
  OpContext ctx{"all_to_all", getRank()};
  int ws = getSize();
  TORCH_CHECK(inputs.size() == static_cast<size_t>(ws) && outputs.size() == static_cast<size_t>(ws),
              "tide all_to_all: rank ", getRank(), ": expects ", ws, " inputs and ", ws,
              " outputs, got ", inputs.size(), " and ", outputs.size());
  // Packed into one send and one receive buffer; all_to_all moves per-peer byte ranges.
  std::vector<at::Tensor> flat_in;
  for (auto& t : inputs) {
    auto flat = input(t, ctx).reshape({-1});
    // contiguous() keeps a 0- or 1-element tensor's stride as it is (torch.empty(1)[::2]
    // has stride 2), and a byte view needs stride 1: give the single element stride 1.
    if (flat.numel() <= 1) flat = flat.as_strided({flat.numel()}, {1});
    flat_in.push_back(flat.view(at::kByte));
  }
  auto send = at::cat(flat_in);
  std::vector<size_t> send_sizes, send_offsets, recv_sizes, recv_offsets;
  size_t off = 0;
  for (auto& t : flat_in) {
    send_sizes.push_back(t.numel());
    send_offsets.push_back(off);
    off += t.numel();
  }
  off = 0;
  for (auto& t : outputs) {
    check_tensor(t, ctx, "output");
    recv_sizes.push_back(nbytes(t));
    recv_offsets.push_back(off);
    off += nbytes(t);
  }
  auto recv = at::empty({static_cast<int64_t>(off)}, at::kByte);
  return enqueue(c10d::OpType::ALLTOALL, "tide:all_to_all", outputs, [=, this]() mutable {
    comm_->all_to_all(send.data_ptr(), send_sizes, send_offsets, recv.data_ptr(), recv_sizes,
                      recv_offsets);
    for (size_t r = 0; r < outputs.size(); ++r) {
      auto bytes = recv.narrow(0, static_cast<int64_t>(recv_offsets[r]),
                               static_cast<int64_t>(recv_sizes[r]));
      outputs[r].copy_(bytes.view(outputs[r].scalar_type()).view(outputs[r].sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::send(std::vector<at::Tensor>& tensors,
                                                      int dst_rank, int tag) {
  if (auto d = delegate(tensors, "send")) return coalesce(d, delegated("send", d, d->send(tensors, dst_rank, tag)));
  OpContext ctx{"send", getRank()};
  check_single(tensors, ctx);
  TORCH_CHECK(dst_rank >= 0 && dst_rank < getSize() && dst_rank != getRank(), "tide send: rank ",
              getRank(), ": invalid destination rank ", dst_rank, " in a group of ", getSize());
  auto in = input(tensors[0], ctx, "tensor");
  if (coalescing_)
    return coalesce(c10d::OpType::SEND, "tide:send", {true, in.data_ptr(), nbytes(in), dst_rank, tag}, tensors,
                    [in] {});
  return enqueue(c10d::OpType::SEND, "tide:send", tensors, [=, this]() {
    comm_->send(in.data_ptr(), nbytes(in), dst_rank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::recv(std::vector<at::Tensor>& tensors,
                                                      int src_rank, int tag) {
  if (auto d = delegate(tensors, "recv")) return coalesce(d, delegated("recv", d, d->recv(tensors, src_rank, tag)));
  OpContext ctx{"recv", getRank()};
  check_single(tensors, ctx);
  TORCH_CHECK(src_rank >= 0 && src_rank < getSize() && src_rank != getRank(), "tide recv: rank ",
              getRank(), ": invalid source rank ", src_rank, " in a group of ", getSize());
  auto out = output(tensors[0], ctx, "tensor");
  if (coalescing_)
    return coalesce(c10d::OpType::RECV, "tide:recv", {false, out.data(), nbytes(out.buf), src_rank, tag}, tensors,
                    [out]() mutable { out.finish(); });
  return enqueue(c10d::OpType::RECV, "tide:recv", tensors, [=, this]() mutable {
    comm_->recv(out.data(), nbytes(out.buf), src_rank, tag);
    out.finish();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false, "tide recv: rank ", getRank(),
              ": receiving from any source is not supported; name the source rank");
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupTide::getBackendOptions() {
  auto options = c10::make_intrusive<Options>(getBackendName(), timeout_.load());
  options->group_name = group_name_;
  return options;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupTide::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                          const std::vector<int>& ranks,
                                                          const c10::intrusive_ptr<Options>& opts) {
  const auto mine = std::find(ranks.begin(), ranks.end(), getRank());
  if (mine == ranks.end()) return nullptr;
  const std::chrono::milliseconds timeout = opts ? opts->timeout : timeout_.load();
  const std::string name = opts && !opts->group_name.empty() ? opts->group_name : group_name_ + ":split";
  pybind11::gil_scoped_acquire gil;
  pybind11::object made = pybind11::module_::import("tide._backend")
                              .attr("create")(store, static_cast<int>(mine - ranks.begin()),
                                              static_cast<int>(ranks.size()), timeout, name, job_rank_);
  return made.cast<c10::intrusive_ptr<ProcessGroupTide>>();
}

void ProcessGroupTide::abort() {
  const std::string why = tide::detail::concat("rank ", getRank(), " aborted group '", group_name_,
                                               "' (ProcessGroup.abort)");
  if (comm_) comm_->abort(why);
  cpu_params_->abort(why);
  if (cpu_) cpu_->abort();
  if (cuda_) cuda_->abort();
}

void ProcessGroupTide::startCoalescing() {
  TORCH_CHECK(!coalescing_, "tide startCoalescing: rank ", getRank(), ": a coalescing block is already open");
  coalescing_ = true;
  queued_in_block_ = false;
  if (cuda_) cuda_->startCoalescing();  // CUDA tensors' ops in the block: one NCCL group, as stock
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::coalesce(c10d::OpType type, const char* name, const tide::P2POp& op,
                                                          std::vector<at::Tensor> tensors,
                                                          std::function<void()> finish) {
  auto work = c10::make_intrusive<WorkTide>(type, name, std::move(tensors));
  coalesced_p2p_.push_back({op, std::move(finish), work});
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::coalesce(const c10::intrusive_ptr<c10d::Backend>& d,
                                                          c10::intrusive_ptr<c10d::Work> delegated) {
  if (coalescing_ && d == cpu_) coalesced_gloo_.push_back(delegated);  // NCCL's group has its own Work
  return delegated;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::endCoalescing() {
  TORCH_CHECK(coalescing_, "tide endCoalescing: rank ", getRank(), ": no coalescing block is open");
  coalescing_ = false;
  std::vector<CoalescedP2P> p2p;
  p2p.swap(coalesced_p2p_);
  std::vector<c10::intrusive_ptr<c10d::Work>> gloo;
  gloo.swap(coalesced_gloo_);
  // NCCL's group ends first: launched, its Work is the block's when it had CUDA tensors.
  c10::intrusive_ptr<c10d::Work> nccl = cuda_ ? cuda_->endCoalescing() : nullptr;
  TORCH_CHECK(!nccl || (p2p.empty() && gloo.empty()), "tide endCoalescing: rank ", getRank(),
              ": the block (batch_isend_irecv) mixed CUDA and CPU tensors; batch each device's separately");
  // An empty block (torch's abort wraps its aborts in one) has no Work, as NCCL's has none:
  // one queued behind a hung collective would hold the abort up to the timeout.
  if (p2p.empty() && gloo.empty() && !queued_in_block_) return nccl;
  // On the worker, after whatever it had: also what the block's "fast path" (torch's
  // allreduce_coalesced and the like, issued just before this) queued there. gloo's sends
  // and receives (across nodes) are waited for there too: they have no future of their own.
  auto host = enqueue(c10d::OpType::COALESCED, "tide:send_recv", {}, [this, p2p, gloo]() {
    for (const auto& w : gloo) w->wait();
    if (p2p.empty()) return;
    std::vector<tide::P2POp> ops;
    for (const CoalescedP2P& c : p2p) ops.push_back(c.op);
    std::exception_ptr error;
    try {
      comm_->send_recv(ops);
      for (const CoalescedP2P& c : p2p) c.finish();
    } catch (...) {
      error = torch_error(std::current_exception());
    }
    for (const CoalescedP2P& c : p2p) c.work->complete(error);
    if (error) std::rethrow_exception(error);
  });
  return nccl ? nccl : host;
}

void ProcessGroupTide::set_cpu_delegate(c10::intrusive_ptr<c10d::Backend> gloo) { cpu_ = std::move(gloo); }

void ProcessGroupTide::setTimeout(std::chrono::milliseconds timeout) {
  // A zero timeout means "wait forever" to c10d's stores and to some backends; refuse it
  // rather than let it mean that here, or something else in a delegate.
  TORCH_CHECK(timeout.count() > 0, "tide set_timeout: rank ", getRank(), " of group '", group_name_,
              "': the timeout must be positive, got ", timeout.count(), " ms");
  timeout_.store(timeout);
  if (comm_) comm_->set_timeout(timeout);
  cpu_params_->set_timeout(timeout);
  {
    std::lock_guard<std::mutex> lock(cuda_params_mutex_);
    if (cuda_params_) cuda_params_->set_timeout(timeout);
  }
  if (cpu_) cpu_->setTimeout(timeout);
  if (cuda_) cuda_->setTimeout(timeout);
}

ParamCollectives& ProcessGroupTide::params(int device) {
  if (device < 0) return *cpu_params_;
  std::lock_guard<std::mutex> lock(cuda_params_mutex_);
  if (!cuda_params_) {
    CudaParamsArgs args;
    args.store = std::make_shared<C10dStore>(store_);
    args.ns = "pg" + group_name_ + "/cuda";
    args.rank = getRank();
    args.world_size = getSize();
    args.timeout = [this] { return timeout_.load(); };
    // The CUDA path's argument checks all-gather a fingerprint through this group's own
    // all-gather of CPU bytes: ordered with the CPU collectives issued before it (the host
    // communicator's worker on one node, gloo across nodes).
    args.all_gather_bytes = [this](const std::vector<uint8_t>& mine) {
      auto bytes = [](const void* p, size_t n) {
        return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
      };
      std::vector<std::vector<uint8_t>> all(getSize(), std::vector<uint8_t>(mine.size()));
      std::vector<at::Tensor> in{bytes(mine.data(), mine.size())};
      std::vector<std::vector<at::Tensor>> out(1);
      for (auto& v : all) out[0].push_back(bytes(v.data(), v.size()));
      allgather(out, in, c10d::AllgatherOptions())->wait(timeout_.load());
      return all;
    };
    args.num_nodes = num_nodes_;
    args.topology = topology_;
    args.topology_error = topology_error_;
    args.nccl = [this] { return cuda_; };
    cuda_params_ = make_cuda_params(std::move(args));
  }
  return *cuda_params_;
}

std::string ProcessGroupTide::why_not_across_nodes(int device) { return params(device).why_not(); }

std::string ProcessGroupTide::inter_node_engine(int device) { return params(device).inter_node_engine(); }

int64_t ProcessGroupTide::inter_node_bytes_sent() const {
  std::lock_guard<std::mutex> lock(cuda_params_mutex_);
  return cpu_params_->inter_node_bytes_sent() + (cuda_params_ ? cuda_params_->inter_node_bytes_sent() : 0);
}

std::string ProcessGroupTide::host_allgather_algorithm() const { return cpu_params_->all_gather_algorithm(); }

c10::intrusive_ptr<c10d::Backend> ProcessGroupTide::delegate(const std::vector<at::Tensor>& tensors,
                                                             const char* op) const {
  if (is_cuda(tensors)) {
    TORCH_CHECK(cuda_, "tide ", op, ": rank ", getRank(),
                ": CUDA tensors need NCCL, and this process has no CUDA device or NCCL (the tide "
                "group then handles CPU tensors only)");
    return cuda_;
  }
  if (comm_) return {};
  TORCH_CHECK(cpu_, "tide ", op, ": rank ", getRank(), ": this group spans ", num_nodes_,
              " nodes, and no inter-node backend (gloo) was set for its CPU tensors");
  return cpu_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::delegated(const char* op, const c10::intrusive_ptr<c10d::Backend>& d,
                                                           c10::intrusive_ptr<c10d::Work> work) const {
  if (d != cpu_) return work;
  return c10::make_intrusive<DelegatedWork>(
      std::move(work), tide::detail::concat("tide ", op, ": rank ", getRank(), ": across ", num_nodes_,
                                            " nodes, gloo (this group's standard ops on CPU tensors) failed"));
}

std::pair<std::string, std::string> ProcessGroupTide::cuda_path_choice(int device) {
  return params(device).path_choice(device);
}

std::pair<size_t, int> ProcessGroupTide::cuda_staging_geometry(int device) {
  return params(device).staging_geometry(device);
}

std::shared_ptr<tide::SymmetricBuffer> ProcessGroupTide::allocate_symmetric(size_t bytes, int device) {
  ParamCollectives& p = params(device);
  const std::string why = p.why_not();
  TORCH_CHECK(why.empty(), "tide allocate_symmetric: rank ", getRank(), ": ", why);
  if (!p.on_worker()) return p.allocate_symmetric(bytes, device);
  auto result = std::make_shared<std::shared_ptr<tide::SymmetricBuffer>>();
  auto work = enqueue(c10d::OpType::UNKNOWN, "tide:allocate_symmetric", {},
                      [&p, bytes, device, result]() { *result = p.allocate_symmetric(bytes, device); });
  work->wait();
  return *result;
}

ProcessGroupTide::Launch ProcessGroupTide::make_param_all_gather(
    const tide::plan::GroupLayout& layout, std::shared_ptr<tide::SymmetricBuffer> shards,
    std::vector<size_t> shard_offsets, at::ScalarType shard_dtype, std::vector<at::Tensor> storages) {
  TORCH_CHECK(shards, "tide param_all_gather: rank ", getRank(), ": no shard memory");
  const int device = shards->device();
  ParamCollectives& p = params(device);
  const std::string why = p.why_not();
  TORCH_CHECK(why.empty(), "tide param_all_gather: rank ", getRank(), ": ", why);
  OpContext ctx{"param_all_gather", getRank()};
  const size_t n = layout.params.size();
  TORCH_CHECK(shard_offsets.size() == n && storages.size() == n, "tide param_all_gather: rank ",
              getRank(), ": ", n, " parameters but ", shard_offsets.size(), " shard offsets and ",
              storages.size(), " storages");
  TORCH_CHECK(layout.world_size == getSize(), "tide param_all_gather: rank ", getRank(),
              ": layout planned for ", layout.world_size, " ranks, group has ", getSize());
  auto storage_dtype = storages.empty() ? DType::f32 : to_dtype(storages[0].scalar_type(), ctx);
  for (size_t q = 0; q < n; ++q) {
    check_param_tensor(storages[q], device, ctx, "storage");
    TORCH_CHECK(storages[q].is_contiguous() && storages[q].numel() == layout.params[q].storage_numel &&
                    to_dtype(storages[q].scalar_type(), ctx) == storage_dtype,
                "tide param_all_gather: rank ", getRank(), ": storage of parameter ", q, " has ",
                storages[q].numel(), " elements of ", storages[q].scalar_type(), ", expected ",
                layout.params[q].storage_numel, " contiguous elements of one dtype");
  }
  auto src_dtype = to_dtype(shard_dtype, ctx);
  auto call = [&p, layout, shards, shard_offsets, src_dtype, storages, storage_dtype]() {
    std::vector<void*> ptrs;
    for (auto& t : storages) ptrs.push_back(t.data_ptr());
    tide::ParamAllGather args;
    args.layout = &layout;
    args.shards = shards.get();
    args.shard_offsets = shard_offsets;
    args.shard_dtype = src_dtype;
    args.storages = ptrs;
    args.storage_dtype = storage_dtype;
    return p.all_gather(args, storages);
  };
  return [this, call, on_worker = p.on_worker(), storages]() -> c10::intrusive_ptr<c10d::Work> {
    if (!on_worker) return call();
    return enqueue(c10d::OpType::ALLGATHER, "tide:param_all_gather", storages, [call]() { call(); });
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::param_all_gather(
    const tide::plan::GroupLayout& layout, std::shared_ptr<tide::SymmetricBuffer> shards,
    std::vector<size_t> shard_offsets, at::ScalarType shard_dtype, std::vector<at::Tensor> storages) {
  return make_param_all_gather(layout, std::move(shards), std::move(shard_offsets), shard_dtype,
                               std::move(storages))();
}

void ProcessGroupTide::defer_param_all_gather(const tide::plan::GroupLayout& layout,
                                              std::shared_ptr<tide::SymmetricBuffer> shards,
                                              std::vector<size_t> shard_offsets, at::ScalarType shard_dtype,
                                              std::vector<at::Tensor> storages) {
  Launch launch = make_param_all_gather(layout, std::move(shards), std::move(shard_offsets), shard_dtype,
                                        std::move(storages));
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  deferred_[std::this_thread::get_id()] = {c10d::OpType::_ALLGATHER_BASE, std::move(launch)};
}

ProcessGroupTide::Launch ProcessGroupTide::make_param_reduce_scatter(
    const tide::plan::GroupLayout& layout, std::vector<at::Tensor> grads, at::Tensor out,
    std::vector<int64_t> out_offsets, const c10d::ReduceOp& op,
    std::shared_ptr<tide::SymmetricBuffer> reuse,
    std::vector<std::pair<int64_t, int64_t>> reuse_regions) {
  const int device = out.defined() && out.is_cuda() ? out.device().index() : -1;
  ParamCollectives& p = params(device);
  const std::string why = p.why_not();
  TORCH_CHECK(why.empty(), "tide param_reduce_scatter: rank ", getRank(), ": ", why);
  OpContext ctx{"param_reduce_scatter", getRank()};
  std::vector<tide::plan::Region> regions;
  for (auto [offset, bytes] : reuse_regions) regions.push_back({0, offset, bytes});
  TORCH_CHECK(regions.empty() || reuse, "tide param_reduce_scatter: rank ", getRank(),
              ": reuse regions given without their symmetric memory");
  const size_t n = layout.params.size();
  TORCH_CHECK(grads.size() == n && out_offsets.size() == n, "tide param_reduce_scatter: rank ",
              getRank(), ": ", n, " parameters but ", grads.size(), " gradients and ",
              out_offsets.size(), " output offsets");
  TORCH_CHECK(layout.world_size == getSize(), "tide param_reduce_scatter: rank ", getRank(),
              ": layout planned for ", layout.world_size, " ranks, group has ", getSize());
  check_param_tensor(out, device, ctx, "output");
  TORCH_CHECK(!reuse || reuse->device() == device, "tide param_reduce_scatter: rank ", getRank(),
              ": Slot-Reuse memory on device ", reuse ? reuse->device() : -1, " but the output on device ", device,
              " (-1: the host)");
  TORCH_CHECK(out.is_contiguous(), "tide param_reduce_scatter: rank ", getRank(),
              ": the output must be contiguous");
  auto grad_dtype = n ? to_dtype(grads[0].scalar_type(), ctx) : DType::f32;
  for (size_t q = 0; q < n; ++q) {
    check_param_tensor(grads[q], device, ctx, "gradient");
    TORCH_CHECK(grads[q].is_contiguous() && grads[q].numel() == layout.params[q].numel &&
                    to_dtype(grads[q].scalar_type(), ctx) == grad_dtype,
                "tide param_reduce_scatter: rank ", getRank(), ": gradient of parameter ", q,
                " has ", grads[q].numel(), " elements of ", grads[q].scalar_type(), ", expected ",
                layout.params[q].numel, " contiguous elements of one dtype");
    TORCH_CHECK(out_offsets[q] >= 0 &&
                    out_offsets[q] + layout.params[q].padded_shard_numel <= out.numel(),
                "tide param_reduce_scatter: rank ", getRank(), ": parameter ", q,
                "'s shard does not fit the output of ", out.numel(), " elements at offset ",
                out_offsets[q]);
  }
  auto out_dtype = to_dtype(out.scalar_type(), ctx);
  auto red = to_reduce(op, ctx, grad_dtype, out_dtype);
  // On CUDA the group's copy stream reads the gradients after this returns: tide.fsdp
  // records them on its stream so they outlive the reads.
  auto call = [this, &p, layout, grads, out, out_offsets, grad_dtype, out_dtype, red, reuse, regions, device]() {
    std::vector<const void*> ptrs;
    for (auto& g : grads) ptrs.push_back(g.data_ptr());
    tide::ParamReduceScatter args;
    args.layout = &layout;
    args.grads = ptrs;
    args.grad_dtype = grad_dtype;
    args.out = out.data_ptr();
    args.out_offsets = out_offsets;
    args.out_dtype = out_dtype;
    args.op = red;
    args.reuse = reuse.get();
    args.reuse_regions = regions;
    // Host tensors: TIDE-RS may send from the gradients (one rank per node), and the engine
    // then keeps them past a failed exchange. CUDA keeps its copy into the partials.
    if (device < 0) args.grads_alive = std::make_shared<const std::vector<at::Tensor>>(grads);
    return p.reduce_scatter(args, out, last_staging_);
  };
  return [this, call, on_worker = p.on_worker(), out]() -> c10::intrusive_ptr<c10d::Work> {
    if (!on_worker) return call();
    return enqueue(c10d::OpType::REDUCE_SCATTER, "tide:param_reduce_scatter", {out}, [call]() { call(); });
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::param_reduce_scatter(
    const tide::plan::GroupLayout& layout, std::vector<at::Tensor> grads, at::Tensor out,
    std::vector<int64_t> out_offsets, const c10d::ReduceOp& op, std::shared_ptr<tide::SymmetricBuffer> reuse,
    std::vector<std::pair<int64_t, int64_t>> reuse_regions) {
  return make_param_reduce_scatter(layout, std::move(grads), std::move(out), std::move(out_offsets), op,
                                   std::move(reuse), std::move(reuse_regions))();
}

void ProcessGroupTide::defer_param_reduce_scatter(const tide::plan::GroupLayout& layout,
                                                  std::vector<at::Tensor> grads, at::Tensor out,
                                                  std::vector<int64_t> out_offsets, const c10d::ReduceOp& op,
                                                  std::shared_ptr<tide::SymmetricBuffer> reuse,
                                                  std::vector<std::pair<int64_t, int64_t>> reuse_regions) {
  Launch launch = make_param_reduce_scatter(layout, std::move(grads), std::move(out), std::move(out_offsets), op,
                                            std::move(reuse), std::move(reuse_regions));
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  deferred_[std::this_thread::get_id()] = {c10d::OpType::_REDUCE_SCATTER_BASE, std::move(launch)};
}

void ProcessGroupTide::drop_deferred() {
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  deferred_.erase(std::this_thread::get_id());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::run_deferred(c10d::OpType op, const at::Tensor& output,
                                                            const at::Tensor& input) {
  if (output.numel() != 0 || input.numel() != 0) return {};
  Launch launch;
  {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    auto it = deferred_.find(std::this_thread::get_id());
    if (it == deferred_.end() || it->second.first != op) return {};
    launch = std::move(it->second.second);
    deferred_.erase(it);
  }
  return launch();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTide::barrier(const c10d::BarrierOptions& opts) {
  ++collective_seq_;
  if (auto d = delegate({}, "barrier"))
    return delegated("barrier", d, d->barrier(const_cast<c10d::BarrierOptions&>(opts)));
  return enqueue(c10d::OpType::BARRIER, "tide:barrier", {}, [this]() { comm_->barrier(); });
}

}  // namespace tide::torch_backend
