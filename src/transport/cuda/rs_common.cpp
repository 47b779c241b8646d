#include "rs_common.hpp"

#include "tide/cuda/check.hpp"
#include "tide/cuda/kernels.hpp"

namespace tide::cuda::detail {

void check_rs_dtypes(const ParamReduceScatter& a, int rank) {
  TIDE_CHECK(a.out_dtype == DType::f32 &&
                 (a.grad_dtype == DType::bf16 || a.grad_dtype == DType::f16 || a.grad_dtype == DType::f32),
             "tide: cuda: param_reduce_scatter on rank ", rank, ": unsupported ", dtype_name(a.grad_dtype), " -> ",
             dtype_name(a.out_dtype), " (the CUDA path reduces bf16/f16/f32 gradients into fp32 shards)");
}

float rs_scale(const ParamReduceScatter& a, int group_size, int rank) {
  switch (a.op.op) {
    case ReduceOp::sum: return 1.f;
    case ReduceOp::avg: return 1.f / static_cast<float>(group_size);
    case ReduceOp::premul_sum: return static_cast<float>(a.op.premul_factor);
    default:
      throw Error(::tide::detail::concat("tide: cuda: param_reduce_scatter on rank ", rank, ": reduce op ",
                                         reduce_op_name(a.op.op), " unsupported (sum, avg, premul_sum)"));
  }
}

RsSlots::RsSlots(CudaGroup& g, const ParamReduceScatter& a, uint64_t first_step, StagingReport& report)
    : g_(g), reuse_off_(static_cast<size_t>(g.num_slots()), -1) {
  reuse_ = a.reuse ? dynamic_cast<CudaSymmetricBuffer*>(a.reuse) : nullptr;
  TIDE_CHECK(!a.reuse || reuse_, "tide: cuda: param_reduce_scatter on rank ", g.rank(),
             ": Slot-Reuse memory must be CUDA symmetric memory");
  if (reuse_ && !a.reuse_regions.empty() && report.num_slots > 0) {
    std::vector<plan::Region> regions(a.reuse_regions.begin(), a.reuse_regions.end());
    for (auto& r : regions) r.base_id = 0;
    const int64_t align = report.slot_bytes % 4096 == 0 ? 4096 : 256;
    plan::SlotReuse homes = plan::assign_staging_slots(std::move(regions), static_cast<int64_t>(report.slot_bytes),
                                                       report.num_slots, align);
    for (int i = 0; i < report.num_slots; ++i) {
      const auto idx = static_cast<size_t>((first_step + static_cast<uint64_t>(i)) % static_cast<uint64_t>(g.num_slots()));
      if (homes.slots[i].reused) {
        reuse_off_[idx] = homes.slots[i].offset;
        ++report.reused_slots;
      }
    }
  }
  report.fallback_bytes = static_cast<size_t>(report.num_slots - report.reused_slots) * report.slot_bytes;
}

void zero_shard_padding(const plan::GroupLayout& layout, float* out, std::span<const int64_t> out_offsets, int rank,
                        cudaStream_t stream) {
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const plan::ParamLayout& pl = layout.params[p];
    const int64_t n = pl.shards[rank].numel;
    if (pl.padded_shard_numel > n)
      TIDE_CUDA_CHECK(cudaMemsetAsync(out + out_offsets[p] + n, 0,
                                      static_cast<size_t>(pl.padded_shard_numel - n) * sizeof(float), stream));
  }
}

void stage_slices(CopyBatch& batch, std::byte* dst, const std::byte* grad, const std::vector<plan::Strided>& pats,
                  size_t es) {
  for (const plan::Strided& pat : pats) {
    const size_t run = static_cast<size_t>(pat.run) * es;
    const auto* src = grad + static_cast<size_t>(pat.offset) * es;
    if (pat.count == 1 || pat.run == pat.stride)
      batch.add(dst, src, run * static_cast<size_t>(pat.count));
    else
      batch.add(dst, run, src, static_cast<size_t>(pat.stride) * es, run, static_cast<size_t>(pat.count));
    dst += static_cast<size_t>(pat.numel()) * es;
  }
}

void accumulate_in_order(float* dst, std::span<const void* const> srcs, DType src_dtype, size_t count, float scale,
                         int ctas, cudaStream_t stream) {
  body::accumulate_in_order(srcs.data(), static_cast<int>(srcs.size()), scale,
                            [&](const AccumulateSources& batch, float s, bool carry) {
                              TIDE_CUDA_CHECK(launch_accumulate_f32(dst, batch, src_dtype, count, s, carry, ctas, stream));
                            });
}

}  // namespace tide::cuda::detail
