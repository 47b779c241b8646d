// TIDE-RS on CUDA: the executor is the host's (src/collectives/param_reduce_scatter.cpp);
// here is its node on a CudaGroup, everything enqueued, nothing waited for on the host:
//   begin_window  copy stream waits for every node rank's rs_done of the window num_slots
//                 before (peers: flags; its own compute stream: the slot's event)
//   stage         copy engines on the copy stream: one contiguous or 2D copy per slice
//   ready         post rs_ready on the copy stream; record the phase-1 event
//   await_ready   compute stream waits for the phase-1 event and every peer's rs_ready
//   accumulate    launch_accumulate_f32 on the compute stream (fp32, sources in order,
//                 TIDE_RS_CTAS CTAs), in chained launches past kMaxAccumulateSources;
//                 one source of the destination's dtype (a node partial at one GPU per
//                 node) is a cudaMemcpyAsync there instead
//   end_window    post rs_done on the compute stream; record the slot's event
// The two streams overlap window s + 1's staging with window s's sums. Across nodes the
// engine (NCCL) must be ordered on the compute stream.
#include "copies.hpp"
#include "tide/cuda/check.hpp"
#include "tide/cuda/group.hpp"
#include "tide/cuda/kernels.hpp"
#include "tide/rs_node.hpp"

namespace tide::cuda {
namespace {

class CudaRsNode final : public RsNode {
 public:
  explicit CudaRsNode(CudaGroup& g) : g_(g), cs_(g.copy_stream()), ks_(g.compute_stream()) {}
  int local_rank() const override { return g_.rank(); }
  int local_size() const override { return g_.world_size(); }
  size_t slot_bytes() const override { return g_.slot_bytes(); }
  int num_slots() const override { return g_.num_slots(); }
  size_t piece_align() const override { return 256; }
  int64_t window_align() const override { return kAccumulateAlign; }
  uint64_t next_step() const override { return g_.current(CudaGroup::kRsReady) + 1; }
  uint64_t begin_window() override {
    const uint64_t t = g_.next(CudaGroup::kRsReady);
    (void)g_.next(CudaGroup::kRsDone);
    const auto n = static_cast<uint64_t>(g_.num_slots());
    if (t > n) wait_peers(cs_, CudaGroup::kRsDone, t - n);
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(cs_, g_.slot_free_event(index(t)), 0));
    return t;
  }
  std::byte* slot(int local, int index) override { return g_.slot(local, index); }
  void stage(std::span<const StridedCopy> copies, DType dtype) override {
    const size_t es = dtype_size(dtype);
    detail::CopyBatch batch(cs_, g_.device());
    for (const StridedCopy& c : copies)
      batch.add(c.dst, c.dst_stride * es, c.src, c.src_stride * es, c.run * es, c.count);
    batch.flush();
  }
  void ready(uint64_t step) override {
    g_.post(cs_, CudaGroup::kRsReady, step);
    TIDE_CUDA_CHECK(cudaEventRecord(g_.phase1_event(), cs_));
  }
  void await_ready(uint64_t step) override {
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(ks_, g_.phase1_event(), 0));  // flags are only for other ranks
    wait_peers(ks_, CudaGroup::kRsReady, step);
  }
  void accumulate(void* dst, DType dst_dtype, std::span<const void* const> srcs, DType src_dtype, size_t count,
                  ReduceArgs op) override {
    if (dst_dtype == src_dtype && srcs.size() == 1 && op.op == ReduceOp::sum) {  // one rank's node partial
      TIDE_CUDA_CHECK(cudaMemcpyAsync(dst, srcs[0], count * dtype_size(dst_dtype), cudaMemcpyDeviceToDevice, ks_));
      return;
    }
    TIDE_CHECK(dst_dtype == DType::f32, "tide: cuda: param_reduce_scatter on rank ", g_.rank(),
               ": accumulates into fp32 only, not ", dtype_name(dst_dtype));
    const float scale = op.op == ReduceOp::premul_sum ? static_cast<float>(op.premul_factor)
                        : op.op == ReduceOp::avg
                            ? 1.f / static_cast<float>(op.avg_divisor ? op.avg_divisor : srcs.size())
                            : 1.f;
    body::accumulate_in_order(srcs.data(), static_cast<int>(srcs.size()), scale,
                              [&](const AccumulateSources& batch, float s, bool carry) {
                                TIDE_CUDA_CHECK(launch_accumulate_f32(static_cast<float*>(dst), batch, src_dtype, count,
                                                                      s, carry, g_.rs_ctas(), ks_));
                              });
  }
  void end_window(uint64_t step) override {
    g_.post(ks_, CudaGroup::kRsDone, step);
    TIDE_CUDA_CHECK(cudaEventRecord(g_.slot_free_event(index(step)), ks_));
  }
  void release(uint64_t step) override { wait_peers(ks_, CudaGroup::kRsDone, step); }
  void zero(void* dst, size_t bytes) override { TIDE_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, ks_)); }
  std::shared_ptr<std::byte> scratch(size_t bytes) override {
    void* p = nullptr;
    TIDE_CUDA_CHECK(cudaMallocFromPoolAsync(&p, bytes, g_.transient_pool(), ks_));
    cudaStream_t s = ks_;
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [s](std::byte* q) {
      if (cudaFreeAsync(q, s) != cudaSuccess) (void)cudaGetLastError();  // in stream order
    });
  }

 private:
  int index(uint64_t step) const { return static_cast<int>(step % static_cast<uint64_t>(g_.num_slots())); }
  void wait_peers(cudaStream_t s, CudaGroup::FlagId f, uint64_t value) {
    for (int r = 0; r < g_.world_size(); ++r)
      if (r != g_.rank()) g_.wait(s, r, f, value);
  }
  CudaGroup& g_;
  cudaStream_t cs_, ks_;
};

StagingReport run(CudaGroup& g, const ParamReduceScatter& a, const TwoLevel& group, cudaStream_t stream) {
  const int me = group.rank;
  TIDE_CHECK(a.layout, "tide: cuda: param_reduce_scatter on rank ", me, ": no layout");
  TIDE_CHECK(g.allgather_path().path != AllGatherPath::nccl, "tide: cuda: param_reduce_scatter on rank ", me,
             ": the node's GPUs cannot map each other's memory (", g.allgather_path().reason, ")");
  const size_t np = a.layout->params.size();
  TIDE_CHECK(a.grads.size() == np && a.out_offsets.size() == np, "tide: cuda: param_reduce_scatter on rank ", me, ": ",
             np, " params but ", a.grads.size(), " grads and ", a.out_offsets.size(), " output offsets");
  TIDE_CHECK(a.out || np == 0, "tide: cuda: param_reduce_scatter on rank ", me, ": no output");
  TIDE_CHECK(a.out_dtype == DType::f32 &&
                 (a.grad_dtype == DType::bf16 || a.grad_dtype == DType::f16 || a.grad_dtype == DType::f32),
             "tide: cuda: param_reduce_scatter on rank ", me, ": unsupported ", dtype_name(a.grad_dtype), " -> ",
             dtype_name(a.out_dtype), " (the CUDA path reduces bf16/f16/f32 gradients into fp32 shards)");
  TIDE_CHECK(a.op.op == ReduceOp::sum || a.op.op == ReduceOp::avg || a.op.op == ReduceOp::premul_sum,
             "tide: cuda: param_reduce_scatter on rank ", me, ": reduce op ", reduce_op_name(a.op.op),
             " unsupported (sum, avg, premul_sum)");
  TIDE_CHECK(!a.reuse || dynamic_cast<CudaSymmetricBuffer*>(a.reuse), "tide: cuda: param_reduce_scatter on rank ", me,
             ": Slot-Reuse memory must be CUDA symmetric memory");
  CudaRsNode node(g);
  g.begin("param_reduce_scatter", stream, {g.copy_stream(), g.compute_stream()});
  const StagingReport report = param_reduce_scatter(a, group, node);
  g.end(stream, {g.copy_stream(), g.compute_stream()});
  return report;
}

}  // namespace

StagingReport param_reduce_scatter(CudaGroup& g, const ParamReduceScatter& a, cudaStream_t stream) {
  return run(g, a, {{g.world_size(), g.world_size(), 1}, g.rank(), nullptr}, stream);
}

StagingReport param_reduce_scatter_across_nodes(CudaGroup& g, const ParamReduceScatter& a, const TwoLevel& nodes,
                                                cudaStream_t stream) {
  return run(g, a, nodes, stream);
}

}  // namespace tide::cuda
