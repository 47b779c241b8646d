// What TIDE-RS on one node (param_reduce_scatter.cpp) and across nodes
// (node_reduce_scatter.cpp) share on CUDA. Internal to tide_cuda.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

#include "copies.hpp"
#include "tide/cuda/group.hpp"

namespace tide::cuda::detail {

// The gradient and output dtypes the CUDA path reduces (bf16/f16/f32 into fp32), checked.
void check_rs_dtypes(const ParamReduceScatter& a, int rank);
// The op as the accumulate kernel applies it: sum 1, avg 1 / group_size, premul_sum its factor.
float rs_scale(const ParamReduceScatter& a, int group_size, int rank);

// Where the pipeline's slot `idx` of a node rank lies: in vacated all-gather storage
// (Slot-Reuse, a.reuse at a.reuse_regions: plan::assign_staging_slots) or in the group's own
// staging. `first_step` is the rs_ready value of window 0 (slot index = step % slots).
class RsSlots {
 public:
  RsSlots(CudaGroup& g, const ParamReduceScatter& a, uint64_t first_step, StagingReport& report);
  std::byte* at(int rank, int idx) const {
    return reuse_off_[static_cast<size_t>(idx)] >= 0 ? reuse_->peer(rank) + reuse_off_[static_cast<size_t>(idx)]
                                                     : g_.slot(rank, idx);
  }

 private:
  CudaGroup& g_;
  CudaSymmetricBuffer* reuse_ = nullptr;
  std::vector<int64_t> reuse_off_;
};

// Zeros into the padding of `rank`'s shards in the fp32 output (FSDP2 reduces zero-padded inputs).
void zero_shard_padding(const plan::GroupLayout& layout, float* out, std::span<const int64_t> out_offsets, int rank,
                        cudaStream_t stream);

// One destination's gradient slices (`pats`, elements of `es` bytes from `grad`) packed one
// after the other from `dst`: a contiguous or a 2D copy each.
void stage_slices(CopyBatch& batch, std::byte* dst, const std::byte* grad, const std::vector<plan::Strided>& pats,
                  size_t es);

// dst[i] = scale * sum over srcs, in their order, of float(src[i]) (fp32), in launches of at
// most kMaxAccumulateSources sources (body::accumulate_in_order: the bits of one launch).
void accumulate_in_order(float* dst, std::span<const void* const> srcs, DType src_dtype, size_t count, float scale,
                         int ctas, cudaStream_t stream);

}  // namespace tide::cuda::detail
